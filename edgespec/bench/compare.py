"""Merge bench results from several devices (or configurations) into one list of runs."""
from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from .schema import load_runs

__all__ = ["merge_runs"]


def merge_runs(paths: list[str | Path]) -> list[dict]:
    """The runs of every file, validated, with labels made unique (file name appended on a clash)."""
    if not paths:
        raise ConfigError("compare needs at least one bench result (.json)")
    merged: list[dict] = []
    for path in paths:
        for run in load_runs(path):
            run = dict(run)
            if any(r["label"] == run["label"] for r in merged):
                run["label"] = f"{run['label']} [{Path(path).stem}]"
            n, base = 2, run["label"]
            while any(r["label"] == run["label"] for r in merged):
                run["label"], n = f"{base} #{n}", n + 1
            merged.append(run)
    return merged
