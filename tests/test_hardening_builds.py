"""Bundles that cannot change under the user, builds atomic against their neighbours, and long
steps that say what they do (issue 51, items 1, 3, 4 and the file kinds of item 7).

- a bundle owns its weights: `export --format gguf` clones or copies the user's GGUF (a write to
  the source in place leaves the bundle as it was); the direct-GGUF cache shares it by a hard
  link, recorded, and a load refuses it in one line once the shared file was overwritten;
- two exports to one folder without --force: one succeeds, the other is one line; SIGTERM (or
  SIGHUP) during the first-run build of `generate`, `chat` or `serve` leaves no staging folder;
  a failed build leaves no lock file;
- progress on stderr: announced first-run builds and VocabTrim's calibration counted (the
  progress lines themselves: test_hardening_progress.py);
- a FIFO, a character device, a symlink loop or a broken symlink is named as what it is."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edgespec.bundle import MANIFEST, load_bundle
from edgespec.errors import BundleError, ConfigError, ExportError
from edgespec.files import build_lock, clone_file, path_problem, rename_noreplace
from edgespec.progress import reporting
from edgespec.staging import built_once, staged_bundle_dir
from tests.test_hardening import cli, one_line_error
from tests.test_hardening_progress import Recorder, own_cache  # noqa: F401 - each test its own cache
from tests.zoo import AGREEING

pytest.importorskip("gguf")


def tiny_gguf(zoo, dest: Path, name: str = "llama") -> Path:
    """A tiny fp32 GGUF of the zoo's `name` variant, copied to `dest` (a file of the user's own)."""
    bundle = zoo.bundle(name, None, formats=("gguf",), target_precision="fp32")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(bundle / load_bundle(bundle).manifest.target.formats["gguf"].file, dest)
    return dest


def overwrite_in_place(path: Path, other: Path) -> None:
    """What `cp other path` or `curl -o path` does: the same inode, truncated and rewritten."""
    ino = path.stat().st_ino
    with open(path, "r+b") as fh:
        fh.truncate(0)
        fh.write(other.read_bytes())
    assert path.stat().st_ino == ino


def sha256(path: Path) -> str:
    from edgespec.models.catalog import file_sha256

    return file_sha256(path)


# -- item 1: a bundle owns its weights ----------------------------------------------------------

@pytest.fixture(scope="module")
def sources(zoo, tmp_path_factory) -> tuple[Path, Path]:
    """Two tiny GGUFs of different weights: the user's model, and what later overwrites it."""
    root = tmp_path_factory.mktemp("user")
    return tiny_gguf(zoo, root / "model.gguf"), tiny_gguf(zoo, root / "other.gguf", "qwen2")


def test_an_exported_gguf_bundle_keeps_its_weights_when_the_source_is_overwritten(sources, tmp_path):
    pytest.importorskip("llama_cpp")
    src = tmp_path / "model.gguf"
    shutil.copyfile(sources[0], src)
    out = tmp_path / "model.bundle"
    done = cli("export", "--target", str(src), "--format", "gguf", "--draft", "none", "-o", str(out))
    assert done.returncode == 0, done.stderr
    target = out / "target" / "model.gguf"
    assert target.stat().st_ino != src.stat().st_ino  # its own file, not a link to the user's
    before = cli("generate", str(out), "the cat", "--max-tokens", "6", "--temperature", "0", "--backend", "llamacpp")
    assert before.returncode == 0, before.stderr

    overwrite_in_place(src, sources[1])
    assert sha256(target) == sha256(sources[0])  # the weights it was made from
    after = cli("generate", str(out), "the cat", "--max-tokens", "6", "--temperature", "0", "--backend", "llamacpp")
    assert after.returncode == 0 and after.stdout == before.stdout, after.stderr


def test_the_copy_is_a_clone_where_the_file_system_has_them(sources, tmp_path, monkeypatch):
    from edgespec.exporters.gguf import passthrough

    tried = []

    def fake_clone(a, b):  # a file system with clones: the clone is the whole placement
        tried.append((a, b))
        shutil.copyfile(a, b)
        return True

    monkeypatch.setattr(passthrough, "clone_file", fake_clone)
    assert passthrough.copy_file(sources[0], tmp_path / "a.gguf") is None and len(tried) == 1
    monkeypatch.setattr(passthrough, "clone_file", lambda a, b: False)  # ext4, tmpfs: a copy, mtime kept
    assert passthrough.copy_file(sources[0], tmp_path / "b.gguf") is None
    assert (tmp_path / "b.gguf").stat().st_mtime_ns == sources[0].stat().st_mtime_ns
    assert (tmp_path / "b.gguf").read_bytes() == sources[0].read_bytes()


def test_clone_file_leaves_nothing_where_it_cannot_clone(tmp_path):
    a = tmp_path / "a"
    a.write_bytes(b"x" * 10000)
    cloned = clone_file(a, tmp_path / "b")
    assert cloned == (tmp_path / "b").exists()  # this file system decides; either way no stray file
    if cloned:
        assert (tmp_path / "b").read_bytes() == a.read_bytes()
    with pytest.raises(FileExistsError):  # never over an existing file
        clone_file(a, a)


@pytest.fixture(scope="module")
def trimmed(sources, tmp_path_factory):
    """A GGUF bundle of the user's GGUF with a VocabTrim self-draft (calibrated on llama.cpp), and
    what its export reported."""
    pytest.importorskip("llama_cpp")
    from edgespec.exporters.export import ExportConfig, export_bundle

    rec = Recorder()
    with reporting(rec):
        out = export_bundle(ExportConfig(output=tmp_path_factory.mktemp("trimmed") / "b", target=sources[0],
                                         formats=("gguf",), draft_vocab=64))
    return out, rec


def test_a_trimmed_drafts_twin_is_the_bundles_own_copy(sources, trimmed):
    out, _ = trimmed
    target, twin = out / "target" / "model.gguf", out / "draft" / "model.full.gguf"
    assert target.stat().st_ino == twin.stat().st_ino != sources[0].stat().st_ino  # one copy, owned


def test_the_direct_gguf_cache_shares_the_file_and_refuses_it_once_overwritten(sources, tmp_path):
    from edgespec.exporters.gguf.bundles import bundle_for_gguf

    src = tmp_path / "model.gguf"
    shutil.copyfile(sources[0], src)
    old = bundle_for_gguf(src, "gguf")
    m = load_bundle(old).manifest
    target = old / m.target.formats["gguf"].file
    assert target.stat().st_ino == src.stat().st_ino and m.target.formats["gguf"].shared  # no second copy

    os.utime(src, ns=(1, 1))  # a touch: the content is the same, the bundle still loads
    assert load_bundle(old)
    overwrite_in_place(src, sources[1])
    with pytest.raises(BundleError, match="was overwritten since; run the GGUF again") as e:
        load_bundle(old)
    assert "\n" not in str(e.value)
    new = bundle_for_gguf(src, "gguf")  # run again: the new content gets its own bundle
    assert new != old and load_bundle(new).manifest.target.formats["gguf"].shared["sha256"] == sha256(sources[1])


# -- item 3: builds atomic against their neighbours -------------------------------------------

@pytest.mark.parametrize("fallback", [False, True])
def test_rename_noreplace_never_replaces(tmp_path, monkeypatch, fallback):
    import edgespec.files as files

    if fallback:  # a kernel or file system without renameat2's flag: the name is claimed first
        monkeypatch.setattr(files, "_renameat2", lambda: None)
    src, dst = tmp_path / "new", tmp_path / "taken"
    src.mkdir()
    (src / "f").write_text("new")
    dst.mkdir()  # even an empty folder, which os.rename would replace
    with pytest.raises(FileExistsError):
        rename_noreplace(src, dst)
    assert (src / "f").exists() and not any(dst.iterdir())
    dst.rmdir()
    rename_noreplace(src, dst)
    assert (dst / "f").read_text() == "new" and not src.exists()
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(FileExistsError):
        rename_noreplace(f, dst / "f")
    assert (dst / "f").read_text() == "new" and f.exists()


def test_of_two_exports_staged_at_once_the_second_fails_and_the_first_stays(tmp_path):
    out = tmp_path / "out"
    first, second = staged_bundle_dir(out), staged_bundle_dir(out)
    a, b = first.__enter__(), second.__enter__()  # both found the name free
    (a / MANIFEST).write_text("first")
    (b / MANIFEST).write_text("second")
    first.__exit__(None, None, None)
    with pytest.raises(BundleError, match=r"another export wrote it meanwhile\); pass --force") as e:
        second.__exit__(None, None, None)
    assert "\n" not in str(e.value)
    assert (out / MANIFEST).read_text() == "first" and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_two_export_commands_to_one_folder_do_not_both_succeed(sources, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "edgespec", "export", "--target", str(sources[0]), "--format", "gguf",
           "--draft", "none", "-o", str(out)]
    procs = []
    for _ in range(2):
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        time.sleep(0.5)
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], results
    err = next(e.decode() for code, _, e in results if code == 2)
    assert "output path exists" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert load_bundle(out) and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_failed_gguf_bundle_build_leaves_no_lock(sources, tmp_path, monkeypatch):
    from edgespec.exporters import export
    from edgespec.exporters.gguf.bundles import bundle_for_gguf
    from edgespec.models.catalog import gguf_bundles_dir

    def fail(cfg):
        raise ExportError("the build failed")

    monkeypatch.setattr(export, "export_bundle", fail)
    with pytest.raises(ExportError):
        bundle_for_gguf(sources[0], "gguf")
    assert list(gguf_bundles_dir().iterdir()) == []


def test_a_build_lock_makes_the_second_wait_and_leaves_no_file(tmp_path):
    lock = tmp_path / ".b.lock"
    order, waited = [], threading.Event()

    def second():
        with build_lock(lock, on_wait=waited.set):
            order.append("second")

    with build_lock(lock):
        t = threading.Thread(target=second)
        t.start()
        assert waited.wait(10)  # it found the lock taken
        order.append("first")
    t.join(10)
    assert order == ["first", "second"] and not lock.exists()


def test_built_once_takes_the_bundle_another_process_built(tmp_path):
    """The loser of a first-run race waits for the winner's lock and then finds its bundle."""
    out = tmp_path / "bundle"
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time\nfrom pathlib import Path\nfrom edgespec.staging import built_once\n"
                               f"out = Path({str(out)!r})\n"
                               "with built_once(out):\n    print('held', flush=True)\n    time.sleep(1.5)\n"
                               "    out.mkdir()\n"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with built_once(out):
        assert out.is_dir()  # built meanwhile: nothing to build here
    holder.wait(30)
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]


def _first_run(verb: str, gguf: Path, tmp_path: Path) -> subprocess.Popen:
    args = {"generate": ["generate", str(gguf), "the cat"], "chat": ["chat", str(gguf)],
            "serve": ["serve", str(gguf), "--port", "0"]}[verb]
    return subprocess.Popen([sys.executable, "-m", "edgespec", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "EDGESPEC_CACHE": str(tmp_path / "c")})


def _wait_for(pattern: str, root: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not list(root.rglob(pattern)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no {pattern} appeared"
        time.sleep(0.02)


@pytest.mark.parametrize("verb, sig", [("generate", signal.SIGTERM), ("chat", signal.SIGTERM),
                                       ("serve", signal.SIGTERM), ("generate", signal.SIGHUP)])
def test_a_signal_during_a_first_run_build_leaves_nothing(sources, tmp_path, verb, sig):
    proc = _first_run(verb, sources[0], tmp_path)
    _wait_for(".*.stage-*", tmp_path / "c", proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    assert b"Traceback" not in err, err
    leftovers = [p for p in (tmp_path / "c").rglob("*") if ".stage-" in p.name or p.name.endswith(".lock")]
    assert leftovers == []


@pytest.mark.slow
@pytest.mark.parametrize("verb", ["generate", "chat", "serve"])
def test_sigterm_during_the_default_bundles_first_build_leaves_nothing(default_cache, tmp_path, verb):
    """The real first run: the default model's weights are in the cache (linked from the session's),
    its bundle is not; SIGTERM once the build stages."""
    models = tmp_path / "c" / "models"
    models.mkdir(parents=True)
    for f in (default_cache / "models").iterdir():
        os.link(f, models / f.name)
    args = {"generate": ["generate", "hello"], "chat": ["chat"], "serve": ["serve", "--port", "0"]}[verb]
    proc = subprocess.Popen([sys.executable, "-m", "edgespec", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "EDGESPEC_CACHE": str(tmp_path / "c"),
                                                         "EDGESPEC_PROGRESS": "1"})
    _wait_for(".*.stage-*", tmp_path / "c", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and b"Traceback" not in err, err
    assert b"building the default bundle" in err  # it said what it was doing
    assert [p for p in (tmp_path / "c").rglob("*") if ".stage-" in p.name or p.name.endswith(".lock")] == []


def test_a_chat_ended_by_sigterm_exits_instead_of_stopping_the_reply(zoo, tmp_path):
    """Ctrl-C stops a reply and the chat goes on; SIGTERM ends the process, whatever it was doing."""
    proc = subprocess.Popen([sys.executable, "-m", "edgespec", "chat", str(zoo.bundle("llama"))], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(5)  # loaded (or still loading): either way SIGTERM must end it
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and b"Traceback" not in err, err


# -- item 4: progress on stderr -------------------------------------------------------------

def test_an_export_counts_its_steps_and_its_calibration_on_llama_cpp(trimmed):
    from edgespec.exporters.vocabtrim import builtin_prompts

    _, rec = trimmed
    cal = rec.find("VocabTrim")
    assert cal["total"] == len(builtin_prompts()) == cal["done"] and cal["ok"]  # counted on llama.cpp
    exp = rec.find("export")
    assert exp["done"] == exp["total"] and "loading model.gguf" in exp["notes"]


def test_a_first_run_build_speaks_on_a_pipe(sources, tmp_path):
    """`edgespec generate X.gguf` with stdin and stderr piped: the build says what it does at once."""
    proc = subprocess.run([sys.executable, "-m", "edgespec", "generate", str(sources[0]), "the cat", "--max-tokens",
                           "2"], input=b"", capture_output=True, timeout=300,
                          env={**os.environ, "EDGESPEC_CACHE": str(tmp_path / "c"), "EDGESPEC_PROGRESS": "1"})
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    lines = err.splitlines()
    assert lines[0].startswith("edgespec: building a bundle for model.gguf (one time"), err
    assert any(ln.startswith("edgespec: building a bundle for model.gguf") and ": done in " in ln for ln in lines), err
    assert all(ln.startswith("edgespec: ") for ln in lines), err  # progress lines only, no log-style WARNING


# -- item 7: what a path is --------------------------------------------------------------------

def test_path_problem_names_what_a_path_is(tmp_path):
    (tmp_path / "loop.gguf").symlink_to("loop.gguf")
    (tmp_path / "dangling").symlink_to("nowhere")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_text("x")
    assert path_problem(tmp_path / "loop.gguf") == "a symlink loop"
    assert path_problem(tmp_path / "dangling").startswith("a broken symlink")
    assert path_problem(tmp_path / "fifo") == "a named pipe (FIFO)"
    assert path_problem("/dev/zero") == "a character device"
    assert path_problem(tmp_path / "missing") == "missing"
    assert path_problem(tmp_path / "file" / "below") == "missing"
    assert path_problem(tmp_path / "file") is None and path_problem(tmp_path) is None


def test_a_symlink_loop_named_x_gguf_is_one_line(tmp_path):
    (tmp_path / "x.gguf").symlink_to("x.gguf")
    one_line_error(cli("generate", str(tmp_path / "x.gguf"), "hi"), "is a symlink loop")
    one_line_error(cli("export", "--target", str(tmp_path / "x.gguf"), "-o", str(tmp_path / "o")), "is a symlink loop")
    with pytest.raises(BundleError, match="is a symlink loop"):
        load_bundle(tmp_path / "x.gguf")


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "socket", "broken symlink"])
def test_export_from_something_that_is_no_model_is_one_line(tmp_path, kind):
    import socket

    path = tmp_path / "model"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
    elif kind == "broken symlink":
        path.symlink_to(tmp_path / "gone")
    else:
        path = Path(kind)
    needle = {"fifo": "a named pipe (FIFO)", "/dev/zero": "a character device", "socket": "a socket",
              "broken symlink": "a broken symlink"}[kind]
    one_line_error(cli("export", "--target", str(path), "-o", str(tmp_path / "out")), needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("calibration", ["/dev/zero", "fifo"])
def test_a_calibration_file_that_is_no_file_is_refused_before_any_work(zoo, tmp_path, calibration):
    path = Path(calibration)
    if calibration == "fifo":
        path = tmp_path / "prompts"
        os.mkfifo(path)
    with pytest.raises(ConfigError, match="is a (character device|named pipe)"):
        from edgespec.exporters.export import ExportConfig, export_bundle

        export_bundle(ExportConfig(output=tmp_path / "b", target=zoo.source("llama"), draft_vocab=64, calibration=path))
    assert not (tmp_path / "b").exists()


def test_distill_finds_a_bundle_it_cannot_write_before_any_work(zoo, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from edgespec.training import distill

    bundle = Path(shutil.copytree(zoo.bundle("gemma3", AGREEING), tmp_path / "b"))
    worked = []
    monkeypatch.setattr(distill, "collect", lambda *a, **k: worked.append(1))

    real_mkdir = Path.mkdir

    def read_only(self, *a, **k):  # a read-only mount: what root meets too
        if self.parent == bundle:
            raise OSError(30, "Read-only file system", str(self))
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(ConfigError, match=r"cannot write to the bundle .* \(Read-only file system\)"):
        distill.distill_bundle(distill.DistillConfig(bundle, train_minutes=0.01))
    assert worked == []
    if os.geteuid() != 0:  # permissions stop everyone but root
        monkeypatch.undo()
        bundle.chmod(0o555)
        try:
            one_line_error(cli("distill", str(bundle), "--train-minutes", "0.01"), "cannot write to the bundle")
        finally:
            bundle.chmod(0o755)


def test_sigterm_during_distill_leaves_the_bundle_as_it_was(zoo, tmp_path):
    pytest.importorskip("torch")
    bundle = Path(shutil.copytree(zoo.bundle("gemma3", AGREEING), tmp_path / "b"))
    before = sorted(p.name for p in bundle.iterdir())
    manifest = (bundle / MANIFEST).read_bytes()
    proc = subprocess.Popen([sys.executable, "-m", "edgespec", "distill", str(bundle), "--train-minutes", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for(".draft_head.*.stage-*", bundle, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and b"Traceback" not in err, err
    assert sorted(p.name for p in bundle.iterdir()) == before and (bundle / MANIFEST).read_bytes() == manifest


def test_a_draft_gguf_whose_embedding_scale_is_not_a_number_is_refused(trimmed, tmp_path):
    from edgespec.errors import BackendError
    from edgespec.runtimes.llamacpp.runtime import EMBD_KEYS, LlamaCppRuntime
    from tests.test_hardening_gguf import rewrite

    draft = Path(shutil.copytree(trimmed[0] / "draft", tmp_path / "draft")) / "model.gguf"
    from gguf import GGUFValueType

    bad = draft.with_name("bad.gguf")  # beside its input embedding, which it names
    for value in (float("nan"), float("inf"), 0.0, -8.0):
        rewrite(draft, bad, {EMBD_KEYS["scale"]: (value, GGUFValueType.FLOAT32, None)})
        with pytest.raises(BackendError, match=r"input_embedding.scale' must be a finite number > 0"):
            LlamaCppRuntime(bad)
    with LlamaCppRuntime(draft) as rt:  # the bundle's own scale is fine
        assert np.isfinite(rt.forward([1, 2], 1)).all()
