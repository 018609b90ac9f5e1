"""Which cores an engine decodes on (edgespec/engine/cores.py), on recorded layouts of real CPUs
(tests/data/cores/: a Raspberry Pi 5, a Snapdragon 8 Gen 2 and a Dimensity 7300 phone, a hybrid
Intel, a cloud VM): the fast cores of a big.LITTLE CPU by default, --threads N the N fastest, and
nothing changed where every core is alike. The sysfs root is an argument, never a patched global."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgespec.engine.cores import CoreChoice, choose_cores, read_cores
from tests.conftest import SESSION_CPUS_ENV

LAYOUTS = Path(__file__).parent / "data" / "cores"


def _choice(name: str, threads: int | None = None, usable: set[int] | None = None) -> CoreChoice:
    layout = read_cores(LAYOUTS / name)
    return choose_cores(layout, usable if usable is not None else {c.cpu for c in layout.cores}, threads)


def test_the_recorded_layouts_read_as_their_cpus():
    pi, sd, mt = (read_cores(LAYOUTS / n) for n in ("raspberry-pi-5", "snapdragon-8-gen-2", "dimensity-7300"))
    assert [c.name for c in pi.cores] == ["Cortex-A76"] * 4 and pi.uniform
    assert pi.describe() == "4x Cortex-A76 (capacity 1024, 2.40 GHz)"
    assert sd.describe() == ("1x Cortex-X3 (capacity 1024, 3.19 GHz) + 2x Cortex-A715 (capacity 852, 2.80 GHz) + "
                             "2x Cortex-A710 (capacity 852, 2.80 GHz) + 3x Cortex-A510 (capacity 350, 2.02 GHz)")
    assert [c.efficient for c in sd.cores] == [True] * 3 + [False] * 5
    assert mt.kinds() == [("Cortex-A78 (capacity 1024, 2.50 GHz)", (4, 5, 6, 7)),
                          ("Cortex-A55 (capacity 372, 2.00 GHz)", (0, 1, 2, 3))]
    intel = read_cores(LAYOUTS / "intel-i5-12600k")
    assert [c.efficient for c in intel.cores] == [False] * 12 + [True] * 4
    assert intel.describe().startswith("12x 12th Gen Intel(R) Core(TM) i5-12600K (4.90 GHz) + 4x ")


@pytest.mark.parametrize("name, cpus, threads", [
    ("snapdragon-8-gen-2", (3, 4, 5, 6, 7), 5),  # the X3, A715s and A710s; not the A510s
    ("dimensity-7300", (4, 5, 6, 7), 4),  # the A78s
    ("intel-i5-12600k", tuple(range(12)), 12),  # the P-cores' threads, not the E-cores
])
def test_big_little_cpus_decode_on_their_fast_cores_pinned(name, cpus, threads):
    c = _choice(name)
    assert (c.cpus, c.threads, c.pin) == (cpus, threads, True)
    assert f"the {len(cpus)} fast cores" in c.reason and c.to_dict()["pinned"]


@pytest.mark.parametrize("name", ["raspberry-pi-5", "epyc-vm"])
def test_cpus_of_one_kind_keep_the_backends_choice(name):
    """A Pi 5 (four equal A76s) and a VM with no cpufreq or capacity: no core left out, no pinning,
    threads left to the backend (None) or as given."""
    n = len(read_cores(LAYOUTS / name).cores)
    assert _choice(name) == CoreChoice(tuple(range(n)), None, False, "every core alike", _choice(name).layout)
    assert _choice(name, threads=1).threads == 1 and not _choice(name, threads=1).pin


def test_threads_take_the_fastest_cores_first():
    assert _choice("snapdragon-8-gen-2", threads=1).cpus == (7,)  # the X3
    assert _choice("snapdragon-8-gen-2", threads=3).cpus == (3, 4, 7)
    assert _choice("dimensity-7300", threads=2).cpus == (4, 5)
    every = _choice("dimensity-7300", threads=8)  # as many threads as cores: all of them, nothing to pin
    assert every.cpus == tuple(range(8)) and every.threads == 8 and not every.pin


def test_only_the_cores_this_process_may_use_count():
    """A process confined to the little cores (taskset) runs there, unpinned; one given two kinds
    keeps the faster."""
    little = _choice("dimensity-7300", usable={0, 1, 2, 3})
    assert little.cpus == (0, 1, 2, 3) and not little.pin and little.threads is None
    mixed = _choice("snapdragon-8-gen-2", usable={0, 1, 7})
    assert mixed.cpus == (7,) and mixed.threads == 1 and mixed.pin


def test_without_cpu_capacity_the_clock_and_the_core_design_decide(tmp_path):
    """Kernels without cpu_capacity (older Android): the top clock, an in-order A55/A510 counted at
    under half its clock, picks the same cores."""
    for name in ("snapdragon-8-gen-2", "dimensity-7300"):
        root = Path(shutil.copytree(LAYOUTS / name, tmp_path / name))
        for f in root.glob("sys/devices/system/cpu/cpu*/cpu_capacity"):
            f.unlink()
        assert read_cores(root).cores[0].capacity is None
        assert _choice(name).cpus == choose_cores(read_cores(root), set(range(8)), None).cpus


def test_a_missing_tree_is_no_layout(tmp_path):
    c = choose_cores(read_cores(tmp_path), {0, 1}, None)
    assert (c.cpus, c.threads, c.pin, c.reason) == ((0, 1), None, False, "no core layout readable")


def test_the_plan_runs_the_chosen_threads_and_the_config_overrides(zoo):
    """plan_engine gives every model the chosen thread count; --threads given, the choice was made
    for it (the N fastest)."""
    from edgespec.bundle import load_bundle
    from edgespec.engine.assembly import plan_engine
    from edgespec.engine.config import EngineConfig

    manifest = load_bundle(zoo.bundle("qwen2")).manifest
    phone = _choice("snapdragon-8-gen-2")
    plan = plan_engine(manifest, EngineConfig(draft_body="own"), ["onnxruntime"], cores=phone)
    assert plan.threads == 5 and plan.draft.options["threads"] == 5 and plan.cores is phone
    assert plan.describe()["cores"]["cpus"] == [3, 4, 5, 6, 7]
    one = plan_engine(manifest, EngineConfig(threads=1), ["onnxruntime"], cores=_choice("snapdragon-8-gen-2", 1))
    assert one.threads == 1 and one.cores.cpus == (7,)
    assert plan_engine(manifest, EngineConfig(), ["onnxruntime"]).threads is None  # today's default


def _session_cpus() -> set[int]:
    """The CPUs the test session started with (conftest pins each xdist worker to some of them)."""
    saved = os.environ.get(SESSION_CPUS_ENV)
    return {int(c) for c in saved.split(",")} if saved else set(os.sched_getaffinity(0))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(_session_cpus()) < 2,
                    reason="pinning needs Linux and two usable CPUs")
def test_pinning_covers_every_thread_of_the_process():
    """In a child process started on every CPU of the session, with a thread already running:
    both it and threads started later run on the chosen core only."""
    cpus = _session_cpus()
    cpu = min(cpus)
    code = f"""
import os, threading
from edgespec.engine.cores import CoreChoice, pin_process
ev = threading.Event(); t = threading.Thread(target=ev.wait); t.start()
pin_process(CoreChoice(({cpu},), 1, True, "test", "test"))
later = []
t2 = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0))); t2.start(); t2.join()
print(sorted(os.sched_getaffinity(t.native_id)), sorted(os.sched_getaffinity(0)), sorted(later[0])); ev.set()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == f"[{cpu}] [{cpu}] [{cpu}]"


def test_info_says_which_cores():
    import io
    from contextlib import redirect_stdout

    from edgespec.cli.info import main

    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["--no-probe"]) == 0
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("cores: ") and "x " in lines[0]
    assert lines[1].startswith("  decoding on cores ") and "--threads N" in lines[1]
