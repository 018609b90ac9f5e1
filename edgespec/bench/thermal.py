"""Heat in the bench: CPU clocks and temperatures before and after every measured run.

A phone or a fanless Raspberry Pi throttles within a minute of decoding: its cores drop from their
top clock as they heat, so a configuration measured hot runs slower than one measured cold, and a
benchmark that does not look calls the difference a speed-up (or hides one). The bench already
interleaves its configurations; this module records what the CPU did meanwhile:

- per run, before and after: the clock of each core the engine runs on
  (`/sys/devices/system/cpu/cpuN/cpufreq/scaling_cur_freq`, against its `cpuinfo_max_freq`), every
  thermal zone's temperature (`/sys/class/thermal/thermal_zone*/temp` and `type`), and on a
  Raspberry Pi `vcgencmd get_throttled` (the firmware's under-voltage, capping and throttling bits);
- per configuration: the median clock right after its runs (the clock under load), the hottest
  zone, and a verdict: "throttled" when the firmware says so or the clock after some run was under
  THROTTLED_SHARE of the top clock, "steady" when it held, "unknown" with nothing to read (a VM);
- a warning when the configurations compared ran at clocks more than CLOCK_TOLERANCE apart: their
  speed ratio then mixes heat into speculation.

`--cooldown S` pauses S seconds before every measured run. Every path is read under a root folder
the caller gives (tests use recorded trees whose values they change during the run).
"""
from __future__ import annotations

import logging
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

__all__ = ["Reading", "Thermal", "vcgencmd_throttled", "summarise_heat", "run_heat", "heat_rows", "clock_warning",
           "THROTTLED_SHARE", "CLOCK_TOLERANCE", "THROTTLE_BITS"]

logger = logging.getLogger(__name__)

THROTTLED_SHARE = 0.9  # a core under load below this share of its top clock is being held back
CLOCK_TOLERANCE = 0.05  # configurations whose clocks under load differ by more were not compared alike
# `vcgencmd get_throttled` bits that mean "now": under-voltage, ARM clock capped, throttled, soft
# temperature limit (bits 16-19 say the same "has occurred since boot", not counted per run)
THROTTLE_BITS = {0: "under-voltage", 1: "arm clock capped", 2: "throttled", 3: "soft temperature limit"}
_CPU_ZONE = re.compile(r"cpu|soc|pkg|core|cluster|tsens|big|little|x86|acpitz", re.IGNORECASE)


def vcgencmd_throttled() -> int | None:
    """The Raspberry Pi firmware's throttling bits (`vcgencmd get_throttled`), None without vcgencmd."""
    exe = shutil.which("vcgencmd")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "get_throttled"], capture_output=True, text=True, timeout=5).stdout
        return int(out.strip().split("=")[-1], 16)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


@dataclass(frozen=True)
class Reading:
    """One look at the CPU: clocks in kHz per core, temperatures in °C per zone, the Pi firmware's bits."""

    clocks_khz: dict[int, int] = field(default_factory=dict)
    max_khz: dict[int, int] = field(default_factory=dict)
    zones_c: dict[str, float] = field(default_factory=dict)
    throttled_bits: int | None = None

    @property
    def clock_mhz(self) -> float | None:
        """The mean clock over the cores read."""
        return sum(self.clocks_khz.values()) / len(self.clocks_khz) / 1e3 if self.clocks_khz else None

    @property
    def clock_share(self) -> float | None:
        """The slowest core's clock over its top clock (1.0: at its top clock)."""
        shares = [self.clocks_khz[c] / self.max_khz[c] for c in self.clocks_khz if self.max_khz.get(c)]
        return min(shares) if shares else None

    @property
    def temp_c(self) -> float | None:
        """The hottest CPU zone (or the hottest zone, where none is named for the CPU)."""
        cpu = [t for name, t in self.zones_c.items() if _CPU_ZONE.search(name)]
        return max(cpu or self.zones_c.values(), default=None)

    @property
    def throttled_now(self) -> list[str]:
        bits = self.throttled_bits or 0
        return [what for bit, what in THROTTLE_BITS.items() if bits >> bit & 1]

    def to_dict(self) -> dict:
        return {"clock_mhz": _round(self.clock_mhz), "clock_share": _round(self.clock_share, 3),
                "temp_c": _round(self.temp_c), "zones_c": {k: _round(v) for k, v in self.zones_c.items()},
                "throttled_bits": None if self.throttled_bits is None else hex(self.throttled_bits)}


def _round(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class Thermal:
    """Reads clocks of `cpus` and every thermal zone under `root`; `throttled()` gives the
    firmware's bits (default: vcgencmd where installed)."""

    def __init__(self, cpus, root: Path | str = "/", throttled: Callable[[], int | None] | None = vcgencmd_throttled):
        self.root = Path(root)
        self.cpus = tuple(sorted(cpus))
        self._throttled = throttled
        cpu_dir = self.root / "sys" / "devices" / "system" / "cpu"
        self._freq = {c: cpu_dir / f"cpu{c}" / "cpufreq" for c in self.cpus}
        zone_dir = self.root / "sys" / "class" / "thermal"
        self._zones = sorted(zone_dir.glob("thermal_zone*"), key=lambda p: int(re.sub(r"\D", "", p.name) or 0))
        self.max_khz = {c: v for c in self.cpus if (v := _read_int(self._freq[c] / "cpuinfo_max_freq"))}

    def read(self) -> Reading:
        clocks = {c: v for c in self.cpus if (v := _read_int(self._freq[c] / "scaling_cur_freq"))}
        zones = {}
        for z in self._zones:
            temp = _read_int(z / "temp")
            if temp is not None:
                try:
                    name = (z / "type").read_text().strip() or z.name
                except OSError:
                    name = z.name
                zones[name if name not in zones else f"{name} ({z.name})"] = temp / 1e3
        return Reading(clocks, self.max_khz, zones, self._throttled() if self._throttled else None)

    def source(self) -> dict:
        """What this machine lets the bench read (for the JSON)."""
        first = self.read()
        return {"cpus": list(self.cpus), "clocks": bool(first.clocks_khz), "zones": list(first.zones_c),
                "vcgencmd": first.throttled_bits is not None}


def _verdict(pairs: list[tuple[Reading, Reading]], shares: list[float], held_back: int, firmware: list[str]) -> str:
    """"throttled" (the firmware says so, or a run ended below THROTTLED_SHARE of the top clock),
    "steady" (clocks or the firmware's bits were read and show none of it), "unknown"."""
    if firmware or held_back:
        return "throttled"
    if shares or any(a.throttled_bits is not None for _, a in pairs):
        return "steady"
    return "unknown"


def _config_heat(pairs: list[tuple[Reading, Reading]]) -> dict:
    """One configuration's runs: clocks under load (after each run), temperatures, its verdict."""
    shares = [a.clock_share for _, a in pairs if a.clock_share is not None]
    rises = [a.temp_c - b.temp_c for b, a in pairs if a.temp_c is not None and b.temp_c is not None]
    firmware = sorted({w for b, a in pairs for w in (*b.throttled_now, *a.throttled_now)})
    held_back = sum(s < THROTTLED_SHARE for s in shares)
    return {"runs": len(pairs), "verdict": _verdict(pairs, shares, held_back, firmware),
            "runs_below_top_clock": held_back, "firmware": firmware,
            "clock_mhz": _spread([a.clock_mhz for _, a in pairs if a.clock_mhz is not None]),
            "clock_share_min": _round(min(shares), 3) if shares else None,
            "temp_c": _spread([t for b, a in pairs for t in (b.temp_c, a.temp_c) if t is not None]),
            "temp_rise_c": _spread(rises)}


def _spread(values: list[float]) -> dict | None:
    """{median, min, max} of `values` (None: nothing read)."""
    if not values:
        return None
    return {"median": _round(median(values)), "min": _round(min(values)), "max": _round(max(values))}


def clock_warning(configs: dict[str, dict]) -> str | None:
    """A warning when the configurations' median clocks under load differ by more than CLOCK_TOLERANCE."""
    clocks = {c: h["clock_mhz"]["median"] for c, h in configs.items() if h.get("clock_mhz")}
    if len(clocks) < 2:
        return None
    lo, hi = min(clocks, key=clocks.get), max(clocks, key=clocks.get)
    if clocks[hi] <= clocks[lo] * (1 + CLOCK_TOLERANCE):
        return None
    return (f"the configurations ran at different clocks: {hi} at a median {clocks[hi]:.0f} MHz, {lo} at "
            f"{clocks[lo]:.0f} MHz under load; their speed ratio mixes heat into speculation (cool the device, "
            "or give --cooldown)")


def run_heat(run) -> dict | None:
    """One run's clock and hottest zone right after it (under load), and the rise over it, for the
    JSON's per-prompt rows; None where nothing was read."""
    if run.heat is None:
        return None
    before, after = run.heat
    rise = after.temp_c - before.temp_c if after.temp_c is not None and before.temp_c is not None else None
    return {"clock_mhz": _round(after.clock_mhz), "clock_share": _round(after.clock_share, 3),
            "temp_c": _round(after.temp_c), "temp_rise_c": _round(rise),
            "throttled": after.throttled_now or None}


def heat_rows(runs) -> dict:
    """{"heat": run_heat per repeat} for one prompt's runs of one configuration ({}: none read)."""
    if all(r.heat is None for r in runs):
        return {}
    return {"heat": [run_heat(r) for r in runs]}


def summarise_heat(runs, source: dict, cooldown_s: float) -> dict:
    """The JSON's "thermal" block from measured runs (each with `.config` and `.heat`, a (before,
    after) pair of Readings or None)."""
    by_config: dict[str, list[tuple[Reading, Reading]]] = {}
    for r in runs:
        if r.heat is not None:
            by_config.setdefault(r.config, []).append(r.heat)
    configs = {c: _config_heat(pairs) for c, pairs in by_config.items()}
    warning = clock_warning(configs)
    throttled = [c for c, h in configs.items() if h["verdict"] == "throttled"]
    warnings = [warning] if warning else []
    if throttled:
        warnings.append(f"throttled while measuring: {', '.join(throttled)} (clock under "
                        f"{THROTTLED_SHARE:.0%} of the top clock after a run, or the firmware said so)")
    return {"source": source, "cooldown_s": cooldown_s, "configs": configs, "warnings": warnings}
