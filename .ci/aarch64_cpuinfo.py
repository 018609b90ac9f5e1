"""Print a /proc/cpuinfo for the emulated CPU; run under qemu-aarch64 by .ci/aarch64.

qemu-user 7.2 (Debian 12) passes the host's x86 /proc/cpuinfo through, and the cpuinfo library
inside onnxruntime's aarch64 wheel crashes on it (SIGSEGV at import). qemu looks a guest's absolute
paths up under its -L root first, so a file at ROOT/proc/cpuinfo is what the guest reads. Its
Features line is decoded from the AT_HWCAP/AT_HWCAP2 words qemu hands the guest (what the emulated
CPU really implements) and the MIDR fields are those qemu gives the CPU model named on the command
line (the -cpu / QEMU_CPU value), as a qemu-system guest's kernel would print them.

The same lookup serves /sys/devices/system/cpu/cpuN/regs/identification/midr_el1, which
OpenVINO's ARM plugin reads (it warns on every start when the file is missing).

usage (under qemu): python3 aarch64_cpuinfo.py CPU [--midr]   -> /proc/cpuinfo (or midr_el1) text
"""
from __future__ import annotations

import os
import struct
import sys

# bit -> name, from the Linux arm64 uapi hwcap.h (the order of the Features line the kernel prints)
HWCAP = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop "
         "sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs sb paca pacg").split()
HWCAP2 = ("dcpodp sve2 sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm svef32mm svef64mm svebf16 "
          "i8mm bf16 dgh rng bti mte ecv afp rpres mte3 sme sme_i16i64 sme_f64f64 sme_i8i32 sme_f16f32 sme_b16f32 "
          "sme_f32f32 sme_fa64 wfxt ebf16 sve_ebf16 cssc rprfm sve2p1 sme2 sme2p1 sme_i16i32 sme_bi32i32 "
          "sme_b16b16 sme_f16f16 mops hbc").split()
AT_HWCAP, AT_HWCAP2 = 16, 26
# qemu CPU model -> MIDR_EL1 fields (implementer, variant, part, revision), from qemu's target/arm
# CPU definitions; "max" is qemu's own (implementer 0 = reserved for software, part 'Q')
MIDR = {
    "cortex-a53": (0x41, 0x0, 0xd03, 4),
    "cortex-a72": (0x41, 0x0, 0xd08, 3),  # Raspberry Pi 4
    "cortex-a76": (0x41, 0x4, 0xd0b, 1),  # Raspberry Pi 5
    "neoverse-n1": (0x41, 0x4, 0xd0c, 1),
    "max": (0x00, 0x0, 0x051, 0),
}


def auxv() -> dict[int, int]:
    data = open("/proc/self/auxv", "rb").read()
    return dict(struct.iter_unpack("<QQ", data[: len(data) // 16 * 16]))


def features(hwcap: int, hwcap2: int) -> list[str]:
    names = [n for i, n in enumerate(HWCAP) if hwcap >> i & 1]
    return names + [n for i, n in enumerate(HWCAP2) if hwcap2 >> i & 1]


def midr_el1(cpu: str) -> int:
    impl, variant, part, rev = MIDR[cpu]
    return impl << 24 | variant << 20 | 0xF << 16 | part << 4 | rev


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2 or argv[0] not in MIDR or argv[1:] not in ([], ["--midr"]):
        print(f"usage: aarch64_cpuinfo.py CPU ({' '.join(MIDR)}) [--midr]", file=sys.stderr)
        return 2
    if os.uname().machine != "aarch64":
        print("run this under qemu-aarch64", file=sys.stderr)
        return 1
    if argv[1:] == ["--midr"]:
        print(f"{midr_el1(argv[0]):#018x}")
        return 0
    impl, variant, part, rev = MIDR[argv[0]]
    vec = auxv()
    line = " ".join(features(vec.get(AT_HWCAP, 0), vec.get(AT_HWCAP2, 0)))
    cores = len(os.sched_getaffinity(0))
    for i in range(cores):
        print(f"processor\t: {i}\nBogoMIPS\t: 2000.00\nFeatures\t: {line}\n"
              f"CPU implementer\t: {impl:#04x}\nCPU architecture: 8\nCPU variant\t: {variant:#x}\n"
              f"CPU part\t: {part:#05x}\nCPU revision\t: {rev}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
