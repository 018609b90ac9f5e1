"""What a benchmark ran on: the machine and the library versions, so runs from different devices
can be put side by side. Reads only; imports no backend (versions come from package metadata)."""
from __future__ import annotations

import os
import platform
import re
from importlib import metadata
from pathlib import Path

from ..cpus import usable_cpu_count
from ..engine.cores import read_cores

__all__ = ["machine_info", "library_versions", "cpu_model", "isa_features", "run_label"]

# distributions whose versions a bench run records, when installed
LIBRARIES = ("edgespec", "numpy", "tokenizers", "onnxruntime", "openvino", "openvino-genai", "llama-cpp-python",
             "psutil")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def cpu_model(cpuinfo: str | None = None) -> str:
    """A human CPU name: x86 "model name", a Raspberry Pi's "Model" line, or an ARM part list."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    fields: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and value.strip():
            fields.setdefault(key.strip().lower(), []).append(value.strip())
    for key in ("model name", "model", "hardware", "cpu model", "processor"):
        values = [v for v in fields.get(key, []) if not re.fullmatch(r"\d+", v)]  # "processor: 0" is an index
        if values:
            return values[0]
    if "cpu part" in fields:  # ARM without a name: implementer and part ids (e.g. 0x41 0xd08 = Cortex-A72)
        parts = sorted(set(fields["cpu part"]))
        impl = fields.get("cpu implementer", ["?"])[0]
        return f"ARM implementer {impl} part {'/'.join(parts)}"
    return platform.processor() or platform.machine() or "unknown"


# /proc/cpuinfo names of the ISA extensions that decide which kernels llama.cpp, onnxruntime and
# OpenVINO pick, and the names people know them by. aarch64 lists them under "Features", x86 under
# "flags"; 32-bit ARM says "neon" where aarch64 says "asimd".
ARM_FEATURES = {"asimd": "NEON", "neon": "NEON", "asimdhp": "FP16", "asimddp": "DOTPROD", "i8mm": "I8MM",
                "bf16": "BF16", "sve": "SVE", "sve2": "SVE2", "sme": "SME"}
X86_FEATURES = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "avx_vnni": "AVX-VNNI"}
# every avx512*/amx_* flag, named as Intel does: avx512f -> AVX-512F, avx512_vnni -> AVX-512VNNI, amx_tile -> AMX-TILE
X86_FAMILIES = (("avx512", "AVX-512"), ("amx_", "AMX-"))


def _x86_name(flag: str) -> str | None:
    if flag in X86_FEATURES:
        return X86_FEATURES[flag]
    for prefix, name in X86_FAMILIES:
        if flag.startswith(prefix):
            return name + flag[len(prefix):].lstrip("_").upper()
    return None


def isa_features(cpuinfo: str | None = None) -> list[str]:
    """The SIMD/matrix extensions the CPU reports, e.g. ["AVX", "AVX2", "FMA", "F16C"] or
    ["NEON", "FP16", "DOTPROD", "I8MM"]; [] where /proc/cpuinfo is not readable (macOS, Windows).

    Read from the first core's "flags" (x86) or "Features" (ARM) line: big.LITTLE cores share the ISA."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip().lower()
        if not sep or key not in ("flags", "features"):
            continue
        flags = value.split()
        if key == "flags":
            names = [_x86_name(f) for f in flags]
        else:
            names = [ARM_FEATURES.get(f) for f in flags]
        return list(dict.fromkeys(n for n in names if n))
    return []


def _os_name() -> str:
    if "ANDROID_ROOT" in os.environ or "TERMUX_VERSION" in os.environ:
        return f"Android (Linux {platform.release()})"
    if platform.system() == "Linux":
        try:
            rel = platform.freedesktop_os_release()
            return f"{rel.get('PRETTY_NAME', 'Linux')} (Linux {platform.release()})"
        except OSError:
            pass
    if platform.system() == "Darwin":
        return f"macOS {platform.mac_ver()[0]}"
    return platform.platform(terse=True)


def machine_info() -> dict:
    """CPU model, ISA features, cores, RAM, arch, OS, Python, and the load when the run started."""
    import psutil

    try:
        load = round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):  # Windows
        load = None
    return {
        "cpu": cpu_model(),
        "arch": platform.machine(),
        "isa": isa_features(),
        "cores_physical": psutil.cpu_count(logical=False),
        "cores_logical": psutil.cpu_count(logical=True),
        "cores_usable": usable_cpu_count(),
        # the kinds of core, fastest first, as sysfs and /proc/cpuinfo describe them (engine/cores.py)
        "core_kinds": [{"kind": what, "cpus": list(cpus)} for what, cpus in read_cores().kinds()],
        "ram_bytes": psutil.virtual_memory().total,
        "os": _os_name(),
        "python": platform.python_version(),
        "load_avg_1min": load,
    }


def library_versions(names=LIBRARIES) -> dict[str, str]:
    """Installed versions of the libraries that shape the numbers (missing ones are left out)."""
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def run_label(machine: dict, backend: str) -> str:
    """A short default name for a run in compare reports: CPU, cores, backend."""
    cpu = re.sub(r"\(R\)|\(TM\)|CPU|Processor|\s+@.*$", "", machine.get("cpu", "?"))
    cpu = re.sub(r"\s+", " ", cpu).strip()
    return f"{cpu} ({machine.get('arch', '?')}, {machine.get('cores_usable', '?')} cores) / {backend}"
