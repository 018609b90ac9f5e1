"""Hostile situations for the exporter's output folder (issue 27, items 1 and 7): `--force` on a
user's own files or a file, a replace that fails half-way, leftovers of killed exports, SIGTERM
during an export, an unwritable output. Nothing the user had is lost, nothing is left behind."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgespec.bundle import MANIFEST, load_bundle
from edgespec.errors import BundleError
from edgespec.staging import staged_bundle_dir, sweep_stale
from tests.test_hardening import cli, one_line_error
from tests.tiny import make_model
from tests.zoo import AGREEING


@pytest.fixture
def bundle(zoo, tmp_path) -> Path:
    return Path(shutil.copytree(zoo.bundle("llama"), tmp_path / "bundle"))


def _user_files(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "thesis.tex").write_text("years of work")
    return folder


def test_force_does_not_replace_a_folder_that_is_not_a_bundle(tmp_path):
    out = _user_files(tmp_path / "mine")
    with pytest.raises(BundleError, match="--force replaces only an edgespec bundle"):
        with staged_bundle_dir(out, force=True):
            pytest.fail("the export must not start")
    assert (out / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_force_does_not_replace_a_file(tmp_path):
    out = tmp_path / "notes.txt"
    out.write_text("keep me")
    with pytest.raises(BundleError, match="not a folder"):
        with staged_bundle_dir(out, force=True):
            pass
    assert out.read_text() == "keep me"


def test_force_replaces_a_bundle_and_an_empty_folder(bundle, tmp_path):
    with staged_bundle_dir(bundle, force=True) as tmp:
        (tmp / MANIFEST).write_text("{}")
        (tmp / "new").write_text("new")
    assert sorted(p.name for p in bundle.iterdir()) == [MANIFEST, "new"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with staged_bundle_dir(empty, force=True) as tmp:
        (tmp / "new").write_text("new")
    assert (empty / "new").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "empty"]  # nothing left beside them


def test_a_failed_swap_keeps_the_old_bundle(bundle, monkeypatch):
    before = sorted(p.name for p in bundle.iterdir())

    def rename(src, dst):  # moving the new bundle in fails (a full disk, a virus scanner)
        raise PermissionError(13, "Permission denied", str(src))

    monkeypatch.setattr("edgespec.staging.rename_noreplace", rename)
    with pytest.raises(BundleError, match="Permission denied"):
        with staged_bundle_dir(bundle, force=True) as tmp:
            (tmp / MANIFEST).write_text("{}")
    assert sorted(p.name for p in bundle.iterdir()) == before
    assert [p.name for p in bundle.parent.iterdir()] == ["bundle"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_staging_folders_of_dead_exports_are_swept(tmp_path):
    out = tmp_path / "b"
    dead = tmp_path / f".b.{_dead_pid()}.stage-abc123"
    (dead / "target").mkdir(parents=True)
    (dead / "target" / "model.onnx").write_bytes(b"\0" * 1000)
    live = tmp_path / f".b.{os.getppid()}.stage-xyz"  # the test runner's parent: alive
    live.mkdir()
    unrelated = tmp_path / ".b.backup"  # not a staging folder's name: never touched
    unrelated.mkdir()
    assert sweep_stale(out) == [dead]
    assert not dead.exists() and live.exists() and unrelated.exists()


def test_an_old_bundle_moved_aside_by_a_killed_replace_comes_back(bundle):
    aside = bundle.with_name(f".{bundle.name}.{_dead_pid()}.old-q1")
    bundle.rename(aside)
    sweep_stale(bundle)
    assert load_bundle(bundle) and not aside.exists()


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_model("llama", tmp_path_factory.mktemp("src") / "llama")


def _export(source: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "edgespec", "export", "--target", str(source), "-o", str(out),
                             "--draft-precision", AGREEING], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_staging(folder: Path, name: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not list(folder.glob(f".{name}.*.stage-*")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no staging folder appeared"
        time.sleep(0.02)


def test_sigterm_during_export_leaves_nothing(source, tmp_path):
    out = tmp_path / "out"
    proc = _export(source, out)
    _wait_for_staging(tmp_path, "out", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert b"Traceback" not in err, err
    assert sorted(tmp_path.iterdir()) == []


def test_sigkill_leftovers_are_swept_by_the_next_export(source, tmp_path):
    out = tmp_path / "out"
    proc = _export(source, out)
    _wait_for_staging(tmp_path, "out", proc)
    proc.kill()
    proc.wait()
    assert list(tmp_path.glob(".out.*"))  # what a kill -9 leaves
    done = cli("export", "--target", str(source), "-o", str(out), "--draft-precision", AGREEING)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and load_bundle(out)


def test_cli_force_on_user_files_is_one_line(source, tmp_path):
    out = _user_files(tmp_path / "docs")
    one_line_error(cli("export", "--target", str(source), "-o", str(out), "--force"),
                   "--force replaces only an edgespec bundle")
    assert (out / "thesis.tex").read_text() == "years of work"


def test_unwritable_cache_folder_is_one_line(source, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder should be")
    # an output folder under it cannot be made (works as root too); without -o a --target's bundle goes to
    # the working directory, and a .gguf run with such a cache is tests/test_gguf_run.py's
    one_line_error(cli("export", "--target", str(source), "-o", str(blocker / "cache" / "bundle")),
                   "cannot write the bundle")
