"""Which cores to decode on: the fast ones of a big.LITTLE CPU, read from sysfs.

A phone's CPU has cores of two or three kinds (a Snapdragon 8 Gen 2: one Cortex-X3, four
Cortex-A715/A710, three Cortex-A510). A forward splits its matrix products evenly among its
threads and waits for the last one, so a thread on a little core paces every step: llama.cpp
and LiteRT-LM users learn to run on the big cores only. The kernel says how fast each core is:
`cpu_capacity` (arm64 and RISC-V: the core's throughput at its top clock, the fastest 1024), the
top clock (`cpufreq/cpuinfo_max_freq`), and the core's design (`CPU part` in /proc/cpuinfo). An
Intel hybrid CPU lists its efficiency cores in /sys/devices/cpu_atom/cpus.

The default is every core at least half as fast as the fastest (by capacity; without one, by top
clock, an in-order efficiency design counted at EFFICIENT_SHARE of its clock): a thread per such
core, the process pinned to them. Where every core is alike (a Raspberry Pi 5, a desktop, a cloud
VM) nothing changes: the backend picks its threads and no core is excluded. `--threads N` still
decides the count; on a mixed CPU it runs on the N fastest cores.

Everything is read under a root folder the caller passes (tests give recorded trees of real
devices; see tests/data/cores/).
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..cpus import usable_cpu_ids

__all__ = ["Core", "CoreLayout", "CoreChoice", "read_cores", "choose_cores", "machine_cores", "pin_process",
           "part_name", "BIG_SHARE", "EFFICIENT_SHARE"]

logger = logging.getLogger(__name__)

BIG_SHARE = 0.5  # a core slower than this share of the fastest is a little core
# an in-order efficiency core's speed per clock against an out-of-order core's, used only where
# the kernel gives no cpu_capacity (a Cortex-A55 at 2.0 GHz against a Cortex-A78 at 2.5 GHz)
EFFICIENT_SHARE = 0.4

# (implementer, part) from MIDR_EL1, as /proc/cpuinfo prints them -> (name, an in-order efficiency core)
PARTS: dict[tuple[str, str], tuple[str, bool]] = {
    ("0x41", "0xd03"): ("Cortex-A53", True), ("0x41", "0xd04"): ("Cortex-A35", True),
    ("0x41", "0xd05"): ("Cortex-A55", True), ("0x41", "0xd07"): ("Cortex-A57", False),
    ("0x41", "0xd08"): ("Cortex-A72", False), ("0x41", "0xd09"): ("Cortex-A73", False),
    ("0x41", "0xd0a"): ("Cortex-A75", False), ("0x41", "0xd0b"): ("Cortex-A76", False),
    ("0x41", "0xd0c"): ("Neoverse-N1", False), ("0x41", "0xd0d"): ("Cortex-A77", False),
    ("0x41", "0xd41"): ("Cortex-A78", False), ("0x41", "0xd44"): ("Cortex-X1", False),
    ("0x41", "0xd46"): ("Cortex-A510", True), ("0x41", "0xd47"): ("Cortex-A710", False),
    ("0x41", "0xd48"): ("Cortex-X2", False), ("0x41", "0xd4d"): ("Cortex-A715", False),
    ("0x41", "0xd4e"): ("Cortex-X3", False), ("0x41", "0xd80"): ("Cortex-A520", True),
    ("0x41", "0xd81"): ("Cortex-A720", False), ("0x41", "0xd82"): ("Cortex-X4", False),
    ("0x41", "0xd85"): ("Cortex-X925", False), ("0x41", "0xd87"): ("Cortex-A725", False),
    ("0x51", "0x802"): ("Kryo 3xx Gold", False), ("0x51", "0x803"): ("Kryo 3xx Silver", True),
    ("0x51", "0x804"): ("Kryo 4xx Gold", False), ("0x51", "0x805"): ("Kryo 4xx Silver", True),
}


def part_name(implementer: str | None, part: str | None) -> str | None:
    """"Cortex-A76" for ("0x41", "0xd0b"); "part 0xabc" for a part not listed; None without one."""
    if part is None:
        return None
    known = PARTS.get(((implementer or "").lower(), part.lower()))
    return known[0] if known else f"part {part.lower()}"


@dataclass(frozen=True)
class Core:
    """One online CPU as the kernel describes it (None: not said)."""

    cpu: int
    capacity: int | None = None  # cpu_capacity: 1024 for the fastest core
    max_khz: int | None = None  # cpufreq/cpuinfo_max_freq
    implementer: str | None = None  # "CPU implementer", e.g. "0x41" (Arm)
    part: str | None = None  # "CPU part", e.g. "0xd0b"
    efficient: bool = False  # an in-order efficiency design (Cortex-A55, A510, an Intel E-core...)
    model: str | None = None  # x86's "model name"

    @property
    def name(self) -> str | None:
        return part_name(self.implementer, self.part) or self.model

    @property
    def kind(self) -> tuple:
        """What makes two cores alike."""
        return (self.name, self.capacity, self.max_khz, self.efficient)

    def describe(self) -> str:
        facts = [f"capacity {self.capacity}" if self.capacity is not None else None,
                 f"{self.max_khz / 1e6:.2f} GHz" if self.max_khz else None]
        name = self.name or ("efficiency core" if self.efficient else "core")
        extra = ", ".join(f for f in facts if f)
        return f"{name} ({extra})" if extra else name


@dataclass(frozen=True)
class CoreLayout:
    """The online cores, in CPU order."""

    cores: tuple[Core, ...]

    def speed(self, core: Core) -> float:
        """How fast `core` is against the others: its capacity where every core has one, else its
        top clock (an efficiency design counted at EFFICIENT_SHARE), else 1."""
        if all(c.capacity for c in self.cores):
            return float(core.capacity)
        clock = float(core.max_khz) if all(c.max_khz for c in self.cores) else 1.0
        return clock * (EFFICIENT_SHARE if core.efficient else 1.0)

    @property
    def uniform(self) -> bool:
        return len({self.speed(c) for c in self.cores}) <= 1

    def kinds(self) -> list[tuple[str, tuple[int, ...]]]:
        """(description, cpus) per kind of core, the fastest first."""
        groups: dict[tuple, list[Core]] = {}
        for c in self.cores:
            groups.setdefault(c.kind, []).append(c)
        ordered = sorted(groups.values(), key=lambda cs: -self.speed(cs[0]))
        return [(cs[0].describe(), tuple(c.cpu for c in cs)) for cs in ordered]

    def describe(self) -> str:
        """"4x Cortex-A78 (capacity 1024, 2.50 GHz) + 4x Cortex-A55 (capacity 372, 2.00 GHz)"."""
        return " + ".join(f"{len(cpus)}x {what}" for what, cpus in self.kinds()) or "unknown"


@dataclass(frozen=True)
class CoreChoice:
    """The cores an engine runs on and how many threads each model takes."""

    cpus: tuple[int, ...]  # the cores run on
    threads: int | None  # threads per model; None: the backend's own choice
    pin: bool  # the process is pinned to `cpus` (only where some usable core is left out)
    reason: str  # one line for `edgespec info` and the bench
    layout: str  # CoreLayout.describe()

    def to_dict(self) -> dict:
        return {"cpus": list(self.cpus), "threads": self.threads, "pinned": self.pin, "reason": self.reason,
                "layout": self.layout}


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _cpu_list(text: str) -> list[int]:
    """"0-3,6" -> [0, 1, 2, 3, 6] (the kernel's cpulist format)."""
    out: list[int] = []
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        if lo.strip().isdigit():
            out += range(int(lo), int(hi) + 1) if hi.strip().isdigit() else [int(lo)]
    return out


def _online(cpu_dir: Path) -> list[int]:
    try:
        return _cpu_list((cpu_dir / "online").read_text())
    except OSError:
        return sorted(int(m.group(1)) for p in cpu_dir.glob("cpu*") if (m := re.fullmatch(r"cpu(\d+)", p.name)))


def _cpuinfo_parts(text: str) -> dict[int, tuple[str | None, str | None, str | None]]:
    """processor -> (CPU implementer, CPU part, model name) from /proc/cpuinfo (ARM lists the part
    per core, x86 the model name)."""
    out: dict[int, tuple[str | None, str | None, str | None]] = {}
    for block in re.split(r"\n\s*\n", text):
        fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in block.splitlines())}
        if fields.get("processor", "").isdigit():
            out[int(fields["processor"])] = (fields.get("cpu implementer"), fields.get("cpu part"),
                                             fields.get("model name"))
    return out


def read_cores(root: Path | str = "/") -> CoreLayout:
    """The online cores under `root` (sysfs and /proc/cpuinfo; "/" on a live system)."""
    root = Path(root)
    cpu_dir = root / "sys" / "devices" / "system" / "cpu"
    try:
        parts = _cpuinfo_parts((root / "proc" / "cpuinfo").read_text(errors="replace"))
    except OSError:
        parts = {}
    try:
        atoms = set(_cpu_list((root / "sys" / "devices" / "cpu_atom" / "cpus").read_text()))
    except OSError:
        atoms = set()
    cores = []
    for n in _online(cpu_dir):
        d = cpu_dir / f"cpu{n}"
        impl, part, model = parts.get(n, (None, None, None))
        known = PARTS.get(((impl or "").lower(), (part or "").lower()))
        cores.append(Core(n, _read_int(d / "cpu_capacity"), _read_int(d / "cpufreq" / "cpuinfo_max_freq"), impl, part,
                          efficient=n in atoms or bool(known and known[1]), model=model))
    return CoreLayout(tuple(cores))


def _usable() -> set[int]:
    return set(usable_cpu_ids())


def choose_cores(layout: CoreLayout, usable: set[int], threads: int | None) -> CoreChoice:
    """The cores to run on: where the usable cores are of one speed, all of them, `threads` as given
    (None: the backend's choice) and no pinning; else the fast ones (at least BIG_SHARE of the
    fastest), or with `threads` the `threads` fastest, the process pinned to them."""
    cores = [c for c in layout.cores if c.cpu in usable] or list(layout.cores)
    here = CoreLayout(tuple(cores))
    text = here.describe()
    every = tuple(sorted(usable)) or tuple(c.cpu for c in cores)
    if not cores or here.uniform:
        return CoreChoice(every, threads, False, "every core alike" if cores else "no core layout readable", text)
    ranked = sorted(cores, key=lambda c: (-here.speed(c), c.cpu))
    top = here.speed(ranked[0])
    if threads is None:
        chosen = [c for c in ranked if here.speed(c) >= BIG_SHARE * top]
        why = (f"the {len(chosen)} fast cores of {len(cores)}; the others run under {BIG_SHARE:.0%} of the "
               "fastest's speed and would pace every step")
    else:
        chosen = ranked[:threads]
        why = f"--threads {threads}: the {len(chosen)} fastest of {len(cores)} cores"
    cpus = tuple(sorted(c.cpu for c in chosen))
    pin = set(cpus) != set(every)
    return CoreChoice(cpus, threads if threads is not None else len(cpus), pin, why, text)


def machine_cores(threads: int | None, root: Path | str = "/") -> CoreChoice:
    """choose_cores for this machine (or the tree under `root`) and the CPUs this process may use."""
    return choose_cores(read_cores(root), _usable(), threads)


def pin_process(choice: CoreChoice | None) -> None:
    """Pin every thread of this process to `choice.cpus` (threads started later inherit the mask);
    a no-op unless the choice pins (None: no choice made). Done when an engine opens, not at import."""
    if choice is None or not choice.pin or not hasattr(os, "sched_setaffinity"):
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, choice.cpus)
        except OSError as e:  # a thread that ended meanwhile, or a sandbox that forbids it
            logger.debug("cannot pin thread %s to cores %s: %s", tid, choice.cpus, e)
    logger.info("running on cores %s: %s", ",".join(map(str, choice.cpus)), choice.reason)
