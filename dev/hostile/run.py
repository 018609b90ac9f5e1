"""Run the hostile set (docs/hardening.md) and classify what each case came to.

    nice -n 10 python dev/hostile/run.py            # everything, about 20 minutes on 2 busy cores
    nice -n 10 python dev/hostile/run.py --only server --only caches

Each case is run as a new user would meet it (the CLI in a child process, the Python API in this
one, the server as a child process on a port) on tiny random-weight models built in a temporary
folder, with a private EDGESPEC_CACHE. Classes: one-line error, 4xx, 5xx error reply (an
OpenAI-shaped 5xx the docs name, e.g. template_timeout), success, and the failures: traceback,
hang, files left behind, data lost, poisoned cache trusted. Writes dev/results/hostile.json and
dev/results/hostile.md; the exit status is 1 when any case failed or came to a class its row does
not allow.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from outcome import CLASSES, FAILURES, ONE_LINE, Outcome  # noqa: E402

RESULTS = HERE.parent / "results"
DRIVER_ERROR = "driver error"


def _run(c, arg) -> tuple[Outcome, float]:
    t0 = time.monotonic()
    try:
        out = c.run(arg)
    except Exception as e:  # noqa: BLE001 - a case the driver could not run is reported, not hidden
        out = Outcome(DRIVER_ERROR, f"{type(e).__name__}: {e} | {traceback.format_exc(limit=3)[-300:]}")
    return out, time.monotonic() - t0


def _record(rows: list, c, out: Outcome, seconds: float) -> None:
    from cases_api import TRUSTED

    failed = out.cls in FAILURES or out.cls in (TRUSTED, DRIVER_ERROR) or out.cls not in c.expect
    if c.needle is not None and out.cls == ONE_LINE and c.needle not in out.detail:
        failed = True  # an error, but not about the input the case is about
    rows.append({"group": c.group, "case": c.name, "expect": sorted(c.expect), "class": out.cls,
                 "detail": out.detail, "seconds": round(seconds, 1), "ok": not failed})
    mark = "ok  " if not failed else "FAIL"
    print(f"{mark} [{c.group}] {c.name}: {out.cls} ({out.detail[:110]}) {seconds:.1f}s", flush=True)


def _selected(group: str, only: list[str]) -> bool:
    return not only or any(o.lower() in group.lower() for o in only)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[], help="run the groups whose name holds this (repeatable)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds a case may take before it is a hang")
    ap.add_argument("--out", default=str(RESULTS / "hostile"), help="results path without suffix")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="edgespec-hostile-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the work folder is removed
    os.environ["EDGESPEC_CACHE"] = str(work / "cache")  # the API cases' cache too
    from cases_api import api_cases, cache_cases
    from cases_cli import cli_cases
    from cases_server import queue_case, server_cases, serving, template_server_case
    from fixtures import build_fixtures

    t0 = time.monotonic()
    rows: list[dict] = []
    try:
        fx = build_fixtures(work, args.timeout)
        print(f"fixtures built in {time.monotonic() - t0:.0f} s under {work}", flush=True)
        for c in [*cli_cases(), *api_cases(), template_server_case(fx), queue_case(fx)]:
            if _selected(c.group, args.only):
                _record(rows, c, *_run(c, fx))
        if _selected("caches", args.only):
            for c in cache_cases(fx):
                _record(rows, c, *_run(c, fx))
        if _selected("server", args.only):
            with serving(fx) as url:
                for c in server_cases():
                    _record(rows, c, *_run(c, url))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    wall = time.monotonic() - t0
    for r in rows:  # the results name no folder of this machine
        r["detail"] = r["detail"].replace(str(work), "<work>")
    _write(Path(args.out), rows, wall, " ".join(sys.argv[1:]))
    return 0 if all(r["ok"] for r in rows) else 1


def counts_by_class(rows: list[dict]) -> dict[str, int]:
    from cases_api import TRUSTED

    names = [*CLASSES, TRUSTED, DRIVER_ERROR]
    return {k: sum(r["class"] == k for r in rows) for k in names}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _write(out: Path, rows: list[dict], wall: float, argv: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    counts = counts_by_class(rows)
    summary = {"command": f"nice -n 10 python dev/hostile/run.py {argv}".strip(), "cases": len(rows),
               "failed": sum(not r["ok"] for r in rows), "wall_s": round(wall), "counts": counts,
               "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    groups = sorted({r["group"] for r in rows}, key=[r["group"] for r in rows].index)
    lines = [f"# Hostile set: {len(rows)} cases, {summary['failed']} failed", "",
             f"`{summary['command']}` ({summary['wall_s']} s)", "", "| Class | Cases |", "|---|---|",
             *[f"| {k} | {v} |" for k, v in counts.items()], "",
             "| Group | Case | Class | Detail |", "|---|---|---|---|"]
    for g in groups:
        for r in rows:
            if r["group"] == g:
                flag = "" if r["ok"] else " **(FAIL)**"
                detail, name = (_cell(r["detail"])[:160], _cell(r["case"]))
                lines.append(f"| {g} | {name} | {r['class']}{flag} | {detail} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(json.dumps({"cases": len(rows), "failed": summary["failed"], "counts": counts}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
