"""The compiled-model cache stays under its cap, evicting the least recently used models."""
from __future__ import annotations

import os
from pathlib import Path

from edgespec.runtimes.openvino.compile_cache import compile_cache_dir, evictions


def test_evictions_drop_least_recently_used_until_under_cap():
    entries = [("old", 1.0, 300), ("mid", 2.0, 300), ("new", 3.0, 300)]
    assert evictions(entries, 1000, keep="new") == []
    assert evictions(entries, 600, keep="new") == ["old"]
    assert evictions(entries, 300, keep="new") == ["old", "mid"]
    # the entry in use stays even when it alone is over the cap
    assert evictions(entries, 100, keep="old") == ["mid", "new"]


def _model(dir: Path, name: str, size: int) -> Path:
    xml = dir / f"{name}.xml"
    xml.write_text("<net/>")
    xml.with_suffix(".bin").write_bytes(b"\0" * size)
    return xml


def _blob(folder: str, size: int) -> None:
    Path(folder, "x.blob").write_bytes(b"\0" * size)


def test_one_folder_per_model_and_old_folders_evicted(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("EDGESPEC_COMPILE_CACHE_MB", "3")
    a, b, c = (_model(tmp_path, n, 10) for n in "abc")
    fa = compile_cache_dir(a, "CPU")
    assert compile_cache_dir(a, "CPU") == fa != compile_cache_dir(a, "GPU")
    _blob(fa, 2 << 20)
    os.utime(fa, (1, 1))  # used long ago
    fb = compile_cache_dir(b, "CPU")
    _blob(fb, 2 << 20)
    fc = compile_cache_dir(c, "CPU")  # 4 MB held, cap 3: the least recently used (a) goes
    assert not Path(fa).exists() and Path(fb).exists() and Path(fc).exists()
    # a re-export (new size or time) is a new model: its old blobs are not reused
    a.with_suffix(".bin").write_bytes(b"\0" * 11)
    assert compile_cache_dir(a, "CPU") != fa


def test_cap_zero_turns_the_cache_off(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("EDGESPEC_COMPILE_CACHE_MB", "0")
    assert compile_cache_dir(_model(tmp_path, "a", 1), "CPU") is None
    assert not (tmp_path / "cache").exists()
