"""edgespec on aarch64, under qemu user-mode emulation: the tier .ci/aarch64 runs.

Bundles are exported here, on x86-64, with torch; the emulated python (an arm64 Debian root with
the aarch64 wheels of the runtime extras, no torch) loads a copy of them. Both sides run
.ci/aarch64_probe.py: the same bytes (sha256 of every file) must give the same greedy tokens,
plain and speculative, on every backend the aarch64 wheels provide. The emulated side also chats
one turn (the same reply as on x86-64) and runs `edgespec bench --json`, whose JSON must say
aarch64.

Skipped unless EDGESPEC_AARCH64_PYTHONS names the emulated pythons (.ci/aarch64 sets it: one
wrapper per emulated CPU model, the first the main one). EDGESPEC_AARCH64_RESULTS also writes the
emulated bench JSON there, marked as emulated. EDGESPEC_AARCH64_DEFAULT_BUNDLE names the default
model's bundle (.ci/aarch64 exports it): its probe, greedy identity and a bench run on the emulated
Cortex-A76 (EDGESPEC_AARCH64_DEFAULT_RESULTS writes that bench JSON); without it the test fails,
unless EDGESPEC_AARCH64_DEFAULT=0 leaves the default model out.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny import PROMPTS
from tests.zoo import AGREEING

PYTHONS = [Path(p) for p in os.environ.get("EDGESPEC_AARCH64_PYTHONS", "").split(os.pathsep) if p]
RESULTS = os.environ.get("EDGESPEC_AARCH64_RESULTS")
DEFAULT_BUNDLE = os.environ.get("EDGESPEC_AARCH64_DEFAULT_BUNDLE")
DEFAULT_RESULTS = os.environ.get("EDGESPEC_AARCH64_DEFAULT_RESULTS")
# The default model under emulation, with a shortened exactness probe: qemu runs this 270M model at
# about 0.2 CPU s per prompt token and 0.4 s per one-token forward, so the full probe (contexts to
# 4096 keys, verify widths 2-17) did not finish in 10 CPU minutes (estimated 18), and a load probes
# twice where the default mode is not exact (it tries the padded-rows mode). A fixed k = 2 probes
# widths 2-3, a 128-token context bounds its reach (prefixes 5, 14, 60, 63, 123): the same kernels.
DEFAULT_ARGS = ("--max-context", "128", "-k", "2")

pytestmark = [pytest.mark.aarch64,
              pytest.mark.skipif(not PYTHONS, reason="needs the emulated aarch64 python: run .ci/aarch64")]

PROBE = Path(__file__).resolve().parents[1] / ".ci" / "aarch64_probe.py"
# what the aarch64 wheels provide: llama-cpp-python has none (it compiles llama.cpp at install,
# hours under emulation), so its GGUF backend is not in this tier
BACKENDS = ("onnxruntime", "openvino")
MAX_TOKENS = 24
TIMEOUT_S = 1800  # one emulated process: a tiny bundle takes well under a minute, the default model minutes


def _cpu(python: Path) -> str:
    return python.name.removeprefix("python-")  # .ci/aarch64 names them python-<qemu cpu model>


def _run(python: Path | str, args: list[str], stdin: str | None = None, ok: tuple[int, ...] = (0,)
         ) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(python), *args], input=stdin, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode in ok, f"{python} {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


def _probe(python: Path | str, bundle: Path, backends=BACKENDS, prompts=PROMPTS, max_tokens=MAX_TOKENS,
           extra: tuple[str, ...] = ()) -> dict:
    args = [str(PROBE), str(bundle), *prompts, "--max-tokens", str(max_tokens), *extra]
    args += [a for b in backends for a in ("--backend", b)]
    return json.loads(_run(python, args).stdout)


@pytest.fixture(scope="module")
def bundle(zoo) -> Path:
    """A tiny Gemma 3 bundle (ONNX and OpenVINO IR, int8 self-draft), exported on x86-64."""
    return zoo.bundle("gemma3", AGREEING, formats=("onnx", "openvino"))


@pytest.fixture(scope="module")
def shipped(bundle, tmp_path_factory) -> Path:
    """The bundle as a device gets it: copied, byte for byte, to a folder of its own."""
    return Path(shutil.copytree(bundle, tmp_path_factory.mktemp("device") / bundle.name))


@pytest.fixture(scope="module")
def x86(bundle) -> dict:
    """The x86-64 reference: checksums of the exported bundle and its greedy tokens."""
    return _probe(sys.executable, bundle)


def _assert_same_decoding(arm: dict, x86: dict, backends) -> None:
    for backend in backends:
        a, x = arm["runs"][backend], x86["runs"][backend]
        for i, (xp, xs, ap, as_) in enumerate(zip(x["plain"]["prompts"], x["speculative"]["prompts"],
                                                  a["plain"]["prompts"], a["speculative"]["prompts"], strict=True)):
            where = f"{backend}, prompt {i}"
            assert xs["ids"] == xp["ids"], f"{where}: x86-64 speculative != plain"
            assert len(ap["ids"]) > 0, where
            assert ap["ids"] == xp["ids"], f"{where}: aarch64 greedy tokens differ from x86-64"
            assert as_["ids"] == xp["ids"], f"{where}: aarch64 speculative != greedy"
            assert as_["drafted"] > 0, f"{where}: the draft never ran on aarch64"


def _backends(python: Path) -> tuple[str, ...]:
    # OpenVINO compiles every model under emulation (about a minute for a tiny one): on the main CPU only
    return BACKENDS if python == PYTHONS[0] else ("onnxruntime",)


@pytest.mark.parametrize("python", PYTHONS, ids=_cpu)
def test_bundle_from_x86_decodes_identically_on_aarch64(python, bundle, shipped, x86):
    assert platform.machine() in ("x86_64", "AMD64") and x86["machine"] == platform.machine()
    arm = _probe(python, shipped, backends=_backends(python))
    assert arm["machine"] == "aarch64"
    assert not arm["torch_installed"], "the aarch64 runtime side must not need torch"
    # byte-portable: what the emulated python read is what x86-64 wrote, and loading rewrote nothing
    assert arm["checksums"] == x86["checksums"]
    assert any(name.endswith(".onnx") for name in arm["checksums"]) and len(arm["checksums"]) >= 4
    assert arm["unchanged_by_loading"] and x86["unchanged_by_loading"]
    _assert_same_decoding(arm, x86, _backends(python))


def test_chat_one_turn_on_aarch64(shipped, bundle):
    """`edgespec chat` with a piped message, greedy: the emulated reply is the x86-64 reply."""
    args = ["-m", "edgespec", "chat", None, "--max-tokens", "16", "--temperature", "0", "--backend", "onnxruntime"]
    x86 = _run(sys.executable, [str(bundle) if a is None else a for a in args], stdin="hello world\n")
    arm = _run(PYTHONS[0], [str(shipped) if a is None else a for a in args], stdin="hello world\n")
    assert x86.stdout.strip(), "the x86-64 reply is empty"
    assert arm.stdout == x86.stdout


def _bench(python: Path, bundle: Path, out: Path, label: str, max_tokens: int, prompts: str,
           extra: tuple[str, ...] = (), lossless: bool = True) -> dict:
    """`edgespec bench --json` under emulation; `lossless`: speculative output must equal plain (else
    a difference is recorded, exit code 1, not a failure: drafting where the verify is not exact)."""
    from edgespec.bench.schema import validate

    # --allow-inexact: onnxruntime's aarch64 kernels round a multi-token verify differently from a
    # one-token forward (~3e-6 on the tiny model, the exactness probe), so bench would refuse to draft;
    # measuring anyway still checks speculative output against plain, token for token ("identical")
    _run(python, ["-m", "edgespec", "bench", str(bundle), "--backend", "onnxruntime", "--prompts", prompts,
                  "--repeat", "2", "--warmup", "1", "--max-tokens", str(max_tokens), "--json", str(out),
                  "--label", label, "--allow-inexact", *extra], ok=(0,) if lossless else (0, 1))
    doc = validate(json.loads(out.read_text()), str(out))
    assert doc["machine"]["arch"] == "aarch64"
    assert "NEON" in doc["machine"]["isa"], doc["machine"]  # a missing ISA list is a failure, not a pass
    assert doc["backend"]["name"] == "onnxruntime"
    assert doc["identical"] or not lossless, doc["mismatches"]
    assert doc["overall"]["plain"]["new_tokens"] > 0 and doc["overall"]["speculative"]["tok_s"] > 0
    return doc


def _emulation(python: Path) -> dict:
    """What the bench JSON's own fields cannot say: the run was emulated, on what."""
    from edgespec.bench.machine import cpu_model

    qemu = subprocess.run(["qemu-aarch64-static", "--version"], capture_output=True, text=True).stdout
    return {
        "emulated": True,
        "emulator": qemu.splitlines()[0] if qemu else "qemu-aarch64-static",
        "emulated_cpu": _cpu(python),
        "host": {"cpu": cpu_model(), "arch": platform.machine(), "cores": os.cpu_count()},
        "note": "aarch64 code translated by qemu user-mode emulation on an x86-64 host: this run shows edgespec "
                "loads, decodes losslessly and benchmarks on aarch64; its speeds, timings and memory say nothing "
                "about a real aarch64 device",
    }


def test_bench_json_on_aarch64(shipped, tmp_path):
    python = PYTHONS[0]
    doc = _bench(python, shipped, tmp_path / "bench.json", f"qemu {_cpu(python)} on x86-64 (emulated)",
                 max_tokens=16, prompts="chat")
    if RESULTS:
        doc = {**doc, "emulation": _emulation(python)}
        Path(RESULTS).write_text(json.dumps(doc, indent=1) + "\n")


def _default_bundle() -> Path:
    if DEFAULT_BUNDLE:
        return Path(DEFAULT_BUNDLE)
    if os.environ.get("EDGESPEC_AARCH64_DEFAULT") == "0":
        pytest.skip("the default model left out (EDGESPEC_AARCH64_DEFAULT=0)")
    pytest.fail("no default-model bundle: .ci/aarch64 exports one (EDGESPEC_AARCH64_DEFAULT_BUNDLE); "
                "EDGESPEC_AARCH64_DEFAULT=0 leaves the default model out")


def test_default_bundle_on_aarch64(tmp_path):
    """The default model on the emulated Cortex-A76: the same bytes as on x86-64, its exactness
    probe run there (shortened: DEFAULT_ARGS), greedy plain tokens equal to x86-64's, speculative
    tokens equal to plain where the probe found the verify exact, and a bench run whose JSON stands
    in for a Raspberry Pi 5's until one is measured."""
    bundle = _default_bundle()
    prompts = ("The capital of France is", "def add(a, b):")
    x86 = _probe(sys.executable, bundle, backends=("onnxruntime",), prompts=prompts, max_tokens=8, extra=DEFAULT_ARGS)
    arm = _probe(PYTHONS[0], bundle, backends=("onnxruntime",), prompts=prompts, max_tokens=8, extra=DEFAULT_ARGS)
    assert arm["machine"] == "aarch64" and arm["checksums"] == x86["checksums"] and arm["unchanged_by_loading"]
    spec, plain = arm["runs"]["onnxruntime"]["speculative"], arm["runs"]["onnxruntime"]["plain"]
    assert spec["exactness"] and spec["probe_ms"], spec  # probed on the emulated CPU, not read from a cache
    for i, (xp, ap) in enumerate(zip(x86["runs"]["onnxruntime"]["plain"]["prompts"], plain["prompts"], strict=True)):
        assert ap["ids"] and ap["ids"] == xp["ids"], f"prompt {i}: aarch64 greedy tokens differ from x86-64"
    same = [s_["ids"] == p["ids"] for s_, p in zip(spec["prompts"], plain["prompts"], strict=True)]
    exact = spec["exact_width"] >= int(DEFAULT_ARGS[-1]) + 1  # every verify the fixed k runs
    assert all(same) or not exact, "speculative != plain where the probe found the verify exact"
    assert all(p["drafted"] > 0 for p in spec["prompts"]), "the draft never ran on aarch64"
    print(f"default model, emulated {_cpu(PYTHONS[0])}: probe {spec['probe_ms'] / 1e3:.0f} s and load "
          f"{spec['load_s']:.0f} s wall, {spec['exactness']}; speculative == plain on {sum(same)} of {len(same)}")
    suite = tmp_path / "one.jsonl"
    suite.write_text(json.dumps({"id": "capital", "class": "chat",
                                 "messages": [{"role": "user", "content": "What is the capital of France?"}]}) + "\n")
    doc = _bench(PYTHONS[0], bundle, tmp_path / "bench.json", f"default model, qemu {_cpu(PYTHONS[0])} (emulated)",
                 max_tokens=8, prompts=str(suite), extra=DEFAULT_ARGS, lossless=exact)
    assert doc["exactness"] is not None and doc["bundle"]["draft"] is not None
    if DEFAULT_RESULTS:
        probe = {"args": list(DEFAULT_ARGS), "probe_ms": spec["probe_ms"], "verdict": spec["exactness"],
                 "speculative_equals_plain": same, "x86_64_verdict": x86["runs"]["onnxruntime"]["speculative"][
                     "exactness"]}
        Path(DEFAULT_RESULTS).write_text(json.dumps({**doc, "emulation": {**_emulation(PYTHONS[0]), "probe": probe}},
                                                    indent=1) + "\n")
