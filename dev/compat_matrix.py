"""Run tests/test_compat_matrix.py (every row, slow tier included) and tests/test_slow_quants.py (the
real Gemma 3 270M per quant type) and render their outcomes into the two tables of docs/models.md,
each between its markers there.

    python dev/compat_matrix.py            # run both tests, then rewrite the tables
    python dev/compat_matrix.py rows.jsonl # render rows recorded earlier (EDGESPEC_MATRIX_OUT)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "models.md"
BEGIN, END = "<!-- compat-matrix:begin -->", "<!-- compat-matrix:end -->"
REAL_BEGIN, REAL_END = "<!-- real-quants:begin -->", "<!-- real-quants:end -->"
TESTS = ("tests/test_compat_matrix.py", "tests/test_slow_quants.py")


def run_matrix() -> list[dict]:
    """Every row's last record: the test appends one when a row starts checking and one when it passes."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "rows.jsonl"
        # every row: the slow tier, and the real model's quant rows CI leaves out
        env = dict(os.environ, EDGESPEC_MATRIX_OUT=str(out), EDGESPEC_SLOW="1", EDGESPEC_SLOW_QUANTS="all")
        subprocess.run([sys.executable, "-m", "pytest", *TESTS, "-q"], cwd=ROOT, env=env)
        return read_rows(out)


def read_rows(path: Path) -> list[dict]:
    rows: dict[tuple, dict] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        rows[row.get("family", row.get("model")), row["quant"], row["format"]] = row
    return list(rows.values())


def cell(row: dict | None) -> str:
    if row is None:
        return "not run"
    if row["status"] == "pass":
        flips = row.get("flips", 0)  # a mixture of experts' positions routed apart (tests/test_compat_matrix.py)
        theirs = row.get("llama_cpp")
        own = f" (llama.cpp {theirs:.0e})" if theirs is not None and row["quant"] != "F32" else ""
        return f"✓ {row['max_abs']:.0e}{own}" + (f" ({flips} routed apart)" if flips else "")
    if row["status"] == "refused":
        return f"✗ {row['reason']}"
    return f"✗ failed ({row['max_abs']:.0e} > {row['atol']:.0e})"


def render(rows: list[dict]) -> str:
    """One line per family x quant type, one column per format: ✓ and the largest logit difference
    from the reference (llama-cpp-python on the same file; for a quantized file, the exact product
    of its blocks, with llama-cpp-python's own difference beside it), or why the row does not pass."""
    by = {(r["family"], r["quant"], r["format"]): r for r in rows}
    fams = list(dict.fromkeys(r["family"] for r in rows))
    quants = list(dict.fromkeys(r["quant"] for r in rows))
    fmts = list(dict.fromkeys(r["format"] for r in rows))
    lines = ["| family | GGUF type | " + " | ".join(f"`--format {f}`" for f in fmts) + " |",
             "| --- | --- | " + " | ".join("---" for _ in fmts) + " |"]
    for fam in fams:
        for q in quants:
            if any((fam, q, f) in by for f in fmts):
                lines.append(f"| {fam} | {q} | " + " | ".join(cell(by.get((fam, q, f))) for f in fmts) + " |")
    return "\n".join(lines)


def render_real(rows: list[dict]) -> str:
    """One line per quant type of the real model: its GGUF block types, the largest next-token logit
    difference from the exact product of its blocks (and llama-cpp-python's own), top-1 agreement
    with llama-cpp-python, greedy tokens agreed per prompt and their median."""
    lines = ["| GGUF type | block types | max logit diff from the exact product (llama.cpp's own) | top-1 | "
             "greedy tokens agreed (of {n}) | median | result |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        types = ", ".join(f"{k} {v}" for k, v in sorted((r.get("block_types") or {}).items()))
        result = "✓ speculative == plain" if r["status"] == "pass" else f"✗ {_real_failure(r)}"
        own = f"; {r['llama_cpp']:.2f}" if r.get("llama_cpp") is not None else ""
        lines.append(f"| {r['quant']} | {types} | {r['max_abs']:.2f} (≤ {r['atol']}{own}) | {r['top1']:.1%} | "
                     f"{', '.join(map(str, r['agree']))} | {r['median_agree']:g} | {result} |")
    n = rows[0]["n_greedy"] if rows else "?"
    return "\n".join(lines).replace("{n}", str(n))


def _real_failure(r: dict) -> str:
    """The first check a real-model row failed, as tests/test_slow_quants.py runs them."""
    if r["max_abs"] > r["atol"]:
        return "logits beyond the tolerance"
    if r["top1"] < r.get("min_top1", 0):
        return "top-1 agreement below its bound"
    if r["median_agree"] < r.get("min_agree", 0):
        return "greedy agreement below its bound"
    return "speculative != plain, or interrupted"


def write_doc(table: str, begin: str = BEGIN, end: str = END) -> None:
    text = DOC.read_text(encoding="utf-8")
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    if not rest:
        raise SystemExit(f"{DOC} has no {begin} marker")
    DOC.write_text(f"{head}{begin}\n{table}\n{end}{tail}", encoding="utf-8")


if __name__ == "__main__":
    rows = read_rows(Path(sys.argv[1])) if len(sys.argv) > 1 else run_matrix()
    real = [r for r in rows if r.get("kind") == "real"]
    matrix = [r for r in rows if r.get("kind") != "real"]
    if matrix:
        write_doc(render(matrix))
    if real:
        write_doc(render_real(real), REAL_BEGIN, REAL_END)
    print(f"{len(matrix)} matrix rows and {len(real)} real-model rows written to {DOC.relative_to(ROOT)}")
