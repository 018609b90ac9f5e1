"""Heat in the bench (edgespec/bench/thermal.py): clocks and temperatures read before and after
every measured run, a verdict per configuration, a warning when the configurations ran at
different clocks, --cooldown, and the spread over repeats, on recorded sysfs trees
(tests/data/cores/) copied and changed while the runs go on."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from edgespec.bench import BenchConfig, Prompt, build_decoders, build_document, run_bench, validate
from edgespec.bench.measure import RunRecord
from edgespec.bench.thermal import Reading, Thermal, summarise_heat, vcgencmd_throttled
from edgespec.errors import ConfigError

LAYOUTS = Path(__file__).parent / "data" / "cores"


def _tree(tmp_path, name: str) -> Path:
    return Path(shutil.copytree(LAYOUTS / name, tmp_path / name))


def _set(root: Path, cpus, mhz: int | None = None, zone: int = 0, temp_c: float | None = None) -> None:
    """Change the tree as the kernel would while the device works: clocks of `cpus`, one zone's temperature."""
    for c in cpus if mhz is not None else ():
        (root / f"sys/devices/system/cpu/cpu{c}/cpufreq/scaling_cur_freq").write_text(f"{mhz * 1000}\n")
    if temp_c is not None:
        (root / f"sys/class/thermal/thermal_zone{zone}/temp").write_text(f"{int(temp_c * 1000)}\n")


def test_readings_of_the_recorded_devices(tmp_path):
    pi = Thermal(range(4), LAYOUTS / "raspberry-pi-5", throttled=lambda: 0).read()
    assert (pi.clock_mhz, pi.clock_share, pi.temp_c, pi.zones_c) == (2400.0, 1.0, 51.45, {"cpu-thermal": 51.45})
    phone = Thermal((3, 4, 5, 6, 7), LAYOUTS / "snapdragon-8-gen-2", throttled=None).read()
    # the hottest zone named for the CPU (not the battery's), the slowest core against its top clock
    assert phone.temp_c == 47.8 and phone.clock_share == 1.0 and phone.throttled_bits is None
    assert round(phone.clock_mhz) == round((4 * 2803.2 + 3187.2) / 5)
    vm = Thermal((0, 1), LAYOUTS / "epyc-vm", throttled=None).read()
    assert (vm.clock_mhz, vm.temp_c, vm.clock_share) == (None, None, None)


def _runs(root: Path, cpus, plan: list[tuple[str, int, float, int, float]], throttled=None) -> list[RunRecord]:
    """Runs whose CPU changes as `plan` says: (config, clock before, temp before, clock after, temp after)."""
    thermal = Thermal(cpus, root, throttled=throttled)
    out = []
    for rep, (config, mhz0, t0, mhz1, t1) in enumerate(plan):
        _set(root, cpus, mhz0, temp_c=t0)
        before = thermal.read()
        _set(root, cpus, mhz1, temp_c=t1)  # the run heats the board
        out.append(RunRecord.timed(4, [1, 2, 3], 0.1, 1.0, config=config, cls="chat", prompt="p", repeat=rep // 2,
                                   heat=(before, thermal.read())))
    return out


def test_a_pi_that_throttles_during_speculative_runs_is_said_so(tmp_path):
    """Plain held 2.4 GHz; speculative runs ended at 1.5 GHz and 82 °C: speculative is throttled,
    plain steady, and the report warns that the two ran at different clocks."""
    root = _tree(tmp_path, "raspberry-pi-5")
    runs = _runs(root, range(4), [("plain", 2400, 50, 2400, 55), ("speculative", 2400, 55, 1500, 82),
                                  ("speculative", 1500, 80, 1500, 84), ("plain", 2400, 70, 2400, 72)])
    heat = summarise_heat(runs, {"cpus": [0, 1, 2, 3]}, 0.0)
    plain, spec = heat["configs"]["plain"], heat["configs"]["speculative"]
    assert plain["verdict"] == "steady" and plain["runs_below_top_clock"] == 0
    assert spec["verdict"] == "throttled" and spec["runs_below_top_clock"] == 2 and spec["clock_share_min"] == 0.625
    assert spec["clock_mhz"] == {"median": 1500.0, "min": 1500.0, "max": 1500.0}
    assert spec["temp_rise_c"]["max"] == 27.0 and plain["temp_c"]["max"] == 72.0
    assert any("different clocks" in w and "speculative at 1500 MHz" in w for w in heat["warnings"])
    assert any("throttled while measuring: speculative" in w for w in heat["warnings"])


def test_configurations_at_the_same_clock_give_no_warning(tmp_path):
    root = _tree(tmp_path, "dimensity-7300")
    big = (4, 5, 6, 7)
    runs = _runs(root, big, [("plain", 2500, 40, 2500, 44), ("speculative", 2500, 44, 2450, 47)])
    heat = summarise_heat(runs, {}, 0.0)
    assert heat["warnings"] == [] and {h["verdict"] for h in heat["configs"].values()} == {"steady"}


def test_the_pi_firmware_bits_make_a_throttled_verdict(tmp_path, monkeypatch):
    """`vcgencmd get_throttled` as the Pi prints it: bits 0-3 now (counted), 16-19 since boot (not)."""
    fake = tmp_path / "bin" / "vcgencmd"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho throttled=0x50004\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    assert vcgencmd_throttled() == 0x50004
    assert Reading(throttled_bits=0x50004).throttled_now == ["throttled"]
    assert Reading(throttled_bits=0x50000).throttled_now == []
    root = _tree(tmp_path, "raspberry-pi-5")
    runs = _runs(root, range(4), [("plain", 2400, 60, 2400, 61)], throttled=vcgencmd_throttled)
    plain = summarise_heat(runs, {}, 0.0)["configs"]["plain"]
    assert plain["verdict"] == "throttled" and plain["firmware"] == ["throttled"]
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert vcgencmd_throttled() is None


def test_nothing_readable_is_an_unknown_verdict(tmp_path):
    runs = _runs(tmp_path / "empty", (0, 1), [("plain", None, None, None, None)])
    heat = summarise_heat(runs, {}, 0.0)
    assert heat["configs"]["plain"]["verdict"] == "unknown" and heat["warnings"] == []


def test_cooldown_is_checked():
    for bad in (-1, float("nan"), True, 4000):
        with pytest.raises(ConfigError, match="--cooldown"):
            BenchConfig(cooldown_s=bad)


def test_a_bench_records_heat_per_run_in_the_json_and_the_report(zoo, tmp_path):
    """A real bench on a tiny bundle with a recorded Pi tree that heats with every read: every
    measured run carries its readings, the JSON says heat per configuration and per repeat, the
    pause before each run is taken, and the report has the heat table and plot."""
    from edgespec.bench.report import HEAT_PLOT, write_report
    from edgespec.engine.engine import load

    root = _tree(tmp_path, "raspberry-pi-5")
    _set(root, range(4), 2400, temp_c=50)
    state = {"reads": 0}

    def heating() -> int:  # called at the end of each reading: the board warms, and past 60 °C it clocks down
        state["reads"] += 1
        temp = 50 + 2 * state["reads"]
        _set(root, range(4), 1500 if temp > 60 else 2400, temp_c=temp)
        return 0

    cfg = BenchConfig(repeat=2, max_tokens=6, warmup=0, cooldown_s=0.05)
    prompts = [Prompt("a", "chat", text="the cat and the dog"), Prompt("b", "code", text="def f(x):")]
    with load(zoo.bundle("llama"), drafter="ngram", allow_inexact=True) as engine:
        thermal = Thermal(range(4), root, throttled=heating)
        t0 = time.perf_counter()
        runs = run_bench(engine, prompts, cfg, thermal=thermal)
        took = time.perf_counter() - t0
        heat = summarise_heat(runs, thermal.source(), cfg.cooldown_s)
        doc = build_document(engine, runs, cfg, prompts_spec="test", configs=list(build_decoders(engine)),
                             backend={"name": engine.backend}, memory={"engine": engine.memory()}, thermal=heat)
    assert len(runs) == 8 and took >= 8 * cfg.cooldown_s
    assert all(r.heat is not None and r.heat[1].temp_c > r.heat[0].temp_c for r in runs)
    doc = validate(json.loads(json.dumps(doc)))
    assert doc["config"]["cooldown_s"] == 0.05 and doc["thermal"]["source"]["clocks"]
    assert {h["verdict"] for h in doc["thermal"]["configs"].values()} == {"throttled"}  # the later runs ran hot
    row = doc["prompts"][0]["configs"]["plain"]
    assert len(row["heat"]) == 2 and all(h["temp_rise_c"] == 2.0 for h in row["heat"])
    spread = doc["overall"]["plain"]["tok_s_spread"]
    assert spread["min"] <= doc["overall"]["plain"]["tok_s"] * 1.5 and spread["max"] >= spread["min"]
    md = write_report([doc], tmp_path / "report").read_text()
    assert "| plain | **throttled** |" in md and "WARNING: throttled while measuring" in md
    assert (tmp_path / "report" / HEAT_PLOT).stat().st_size > 10_000
