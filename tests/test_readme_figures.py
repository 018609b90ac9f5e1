"""The README's results are a committed benchmark's output, not numbers typed by hand: every row
of the results table between the README's markers stands verbatim in the summary that
benchmarks/bench_peer.py wrote, and that summary's figures are the ones in its results JSONs."""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = re.compile(r"<!-- results: (\S+) -->\n(.*?)<!-- /results -->", re.S)


def _blocks() -> list[tuple[Path, list[str]]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return [(ROOT / src, [ln for ln in body.splitlines() if ln.startswith("|") and "---" not in ln][1:])
            for src, body in MARK.findall(text)]


def test_readme_results_rows_are_the_committed_summary_rows():
    blocks = _blocks()
    assert blocks, "README.md has no <!-- results: FILE --> block"
    for src, rows in blocks:
        assert src.is_file(), f"README cites {src.relative_to(ROOT)}, which is not committed"
        summary = src.read_text(encoding="utf-8").splitlines()
        assert rows, f"the README block citing {src.name} has no table rows"
        missing = [r for r in rows if r not in summary]
        assert not missing, f"README rows not in {src.relative_to(ROOT)}: {missing}"


def test_the_summary_is_its_results_files():
    """Each summary row's figures are recomputed from the mode's results.json (bench_peer.summary_rows)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_peer", ROOT / "benchmarks" / "bench_peer.py")
    bench_peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_peer)
    for src, _ in _blocks():
        summary = src.read_text(encoding="utf-8").splitlines()
        modes = [d for d in sorted(src.parent.iterdir()) if (d / "results.json").is_file()]
        assert modes, f"no results.json beside {src.relative_to(ROOT)}"
        for d in modes:
            doc = json.loads((d / "results.json").read_text(encoding="utf-8"))
            for row in bench_peer.summary_rows(d.name, doc):
                assert row in summary, f"{d.name}: {row} is not in {src.name}"
