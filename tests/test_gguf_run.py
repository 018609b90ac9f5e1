"""A .gguf runs where a bundle goes (`edgespec generate FILE.gguf`, `edgespec.load("FILE.gguf")`):
its bundle is built once in the user cache, keyed by content, and `export --target` without -o
never writes the embedded default's bundle."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")

from edgespec.bundle import MANIFEST, load_bundle  # noqa: E402
from edgespec.cli import main  # noqa: E402
from edgespec.cli.export import default_output  # noqa: E402
from edgespec.exporters.gguf import bundles as gguf_bundles  # noqa: E402
from edgespec.models.catalog import cache_dir, default_bundle_path, gguf_bundles_dir  # noqa: E402

LOGGER = "edgespec.exporters.gguf"  # bundles.py and its hash index (hashes.py)
PROMPT = "the cat and"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> Path:
    """Each test its own edgespec cache, so what it finds there it built."""
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _gguf(zoo, name: str, dest: Path) -> Path:
    """A tiny fp32 GGUF of the zoo's `name` variant, copied to `dest`."""
    bundle = zoo.bundle(name, None, formats=("gguf",), target_precision="fp32")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(bundle / load_bundle(bundle).manifest.target.formats["gguf"].file, dest)
    return dest


def _bundles() -> list[Path]:
    root = gguf_bundles_dir()
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []


def _generate(path: Path, capsys) -> str:
    code = main(["generate", str(path), PROMPT, "--max-tokens", "8", "--temperature", "0"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


def _one_line_error(*args: str) -> str:
    """The CLI in its own process, so that log lines on stderr count against the one line too."""
    proc = subprocess.run([sys.executable, "-m", "edgespec", *args], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("edgespec: error:"), proc.stderr
    return lines[0]


def test_generate_on_a_gguf_builds_its_bundle_once_then_reuses_it(zoo, tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    gguf = _gguf(zoo, "qwen2", tmp_path / "models" / "tiny-qwen.gguf")
    first = _generate(gguf, capsys)
    assert first.strip()
    [bundle] = _bundles()
    assert bundle.name.startswith("tiny-qwen-") and (bundle / MANIFEST).is_file()
    assert "building a bundle for" in caplog.text and "reusing" not in caplog.text

    # the defaults of the embedded default bundle: onnx, a self-draft on the GGUF's own blocks
    m = load_bundle(bundle).manifest
    assert list(m.target.formats) == ["onnx"] and m.target.formats["onnx"].quantization["method"] == "gguf-transcode"
    assert m.draft is not None and m.self_draft
    assert m.target.source["name"] == "tiny-qwen.gguf"

    before = (bundle.stat().st_ino, (bundle / MANIFEST).stat().st_mtime_ns)
    caplog.clear()
    second = _generate(gguf, capsys)
    assert second == first  # greedy: the same bundle gives the same text
    assert "reusing the bundle" in caplog.text
    assert "building" not in caplog.text and "hashing" not in caplog.text  # the index spared the re-hash
    assert _bundles() == [bundle] and (bundle.stat().st_ino, (bundle / MANIFEST).stat().st_mtime_ns) == before

    import edgespec

    with edgespec.load(str(gguf)) as engine:  # the Python API takes the same file
        assert engine.bundle.path == bundle
        assert first.endswith("\n") and engine.generate(PROMPT, max_tokens=8, temperature=0.0) == first[:-1]

    assert main(["info", str(gguf), "--no-probe"]) == 0
    assert f"bundle {bundle}" in capsys.readouterr().out


def test_another_file_or_new_content_gets_its_own_bundle(zoo, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    qwen = _gguf(zoo, "qwen2", tmp_path / "a" / "tiny.gguf")
    llama = _gguf(zoo, "llama", tmp_path / "b" / "tiny.gguf")  # the same name, another folder and content
    qwen_bundle = gguf_bundles.bundle_for_gguf(qwen)
    llama_bundle = gguf_bundles.bundle_for_gguf(llama)
    assert qwen_bundle != llama_bundle
    assert load_bundle(qwen_bundle).manifest.model_type == "qwen2"
    assert load_bundle(llama_bundle).manifest.model_type == "llama"

    caplog.clear()
    shutil.copyfile(llama, qwen)  # the same path, new content: the bundle of that content, not the old one
    assert gguf_bundles.bundle_for_gguf(qwen) == llama_bundle
    assert "hashing" in caplog.text and "building" not in caplog.text  # the index saw the change; no re-export
    assert set(_bundles()) == {qwen_bundle, llama_bundle}


def test_a_gguf_opened_on_llama_cpp_gets_a_gguf_bundle_beside_the_onnx_one(zoo, tmp_path):
    pytest.importorskip("llama_cpp")
    import edgespec

    gguf = _gguf(zoo, "llama", tmp_path / "models" / "tiny.gguf")
    with edgespec.load(str(gguf), use_draft=False) as onnx:
        onnx_text = onnx.generate(PROMPT, max_tokens=6, temperature=0.0)
    with edgespec.load(str(gguf), backend="llamacpp") as native:
        assert native.backend == "llamacpp"
        bundle = native.bundle.path
        native_text = native.generate(PROMPT, max_tokens=6, temperature=0.0)
    assert bundle.name.startswith("tiny-") and "-gguf-" in bundle.name
    assert set(_bundles()) == {bundle, gguf_bundles.bundle_for_gguf(gguf)}  # one per format, the ONNX one reused
    m = load_bundle(bundle).manifest
    assert list(m.target.formats) == ["gguf"] and m.target.formats["gguf"].quantization["passthrough"]
    assert m.draft is not None and list(m.draft.formats) == ["gguf"]
    assert native_text.strip() and onnx_text.strip()


def test_the_hash_index_is_used_and_notices_a_rewrite_that_keeps_size_and_mtime(tmp_path, monkeypatch):
    from edgespec.exporters.gguf import hashes

    calls = []
    real = hashes.file_sha256
    monkeypatch.setattr(hashes, "file_sha256", lambda p: calls.append(p) or real(p))
    f = tmp_path / "w.gguf"
    f.write_bytes(b"GGUF" + bytes(4096))
    a = hashes.content_digest(f)
    assert hashes.content_digest(f) == a and len(calls) == 1  # the second lookup read no content
    assert (cache_dir() / hashes.INDEX_FILE).is_file()

    st = f.stat()
    time.sleep(0.05)  # past the coarse clock file times are stamped with
    f.write_bytes(b"GGUF" + bytes(4095) + b"\x01")  # same size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the old mtime, as `cp -p` would keep it
    b = hashes.content_digest(f)
    assert len(calls) == 2 and b != a and b == real(f)


def test_export_with_a_target_and_no_o_writes_to_the_working_directory_never_the_default(
        zoo, tmp_path, monkeypatch, capsys):
    gguf = _gguf(zoo, "qwen2", tmp_path / "models" / "My.Qwen.gguf")
    default = default_bundle_path()
    default.mkdir(parents=True)
    (default / "sentinel").write_text("the embedded default's bundle")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["export", "--target", str(gguf), "--draft", "none"]) == 0
    assert capsys.readouterr().out.strip() == f"bundle written: {work / 'My.Qwen.bundle'}"
    assert load_bundle(work / "My.Qwen.bundle").manifest.target.source["name"] == "My.Qwen.gguf"
    assert sorted(p.name for p in default.iterdir()) == ["sentinel"]
    assert sorted(p.name for p in default.parent.iterdir()) == [default.name]  # no bundle beside it either


def test_default_output_names_the_target():
    cwd = Path("/somewhere")
    assert default_output(None, cwd) is None  # the embedded default: its cache folder
    assert default_output(Path("/m/qwen2.5-0.5b-q4_k_m.GGUF"), cwd) == cwd / "qwen2.5-0.5b-q4_k_m.bundle"
    assert default_output(Path("/m/Qwen2.5-0.5B"), cwd) == cwd / "Qwen2.5-0.5B.bundle"  # a folder keeps its dots


def _mamba_gguf(path: Path) -> Path:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("case,needle", [
    ("text", "neither a bundle folder nor a GGUF file"),
    ("missing", "no such file"),
    ("mamba", "architecture 'mamba' is not supported"),
])
def test_bad_input_is_exit_2_and_one_line(tmp_path, case, needle):
    if case == "text":
        path = tmp_path / "notes.gguf"
        path.write_text("not a model")
    elif case == "missing":
        path = tmp_path / "nope.gguf"
    else:
        path = _mamba_gguf(tmp_path / "ssm.gguf")
    line = _one_line_error("generate", str(path), "hi")
    assert needle in line and path.name in line
    assert _bundles() == []


def test_a_text_file_without_the_gguf_suffix_is_refused_too(tmp_path, capsys):
    path = tmp_path / "notes.txt"
    path.write_text("not a model")
    assert main(["info", str(path), "--no-probe"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("edgespec: error:") and "neither a bundle folder nor a GGUF file" in err


def test_an_unwritable_cache_is_one_line(zoo, tmp_path, monkeypatch):
    gguf = _gguf(zoo, "qwen2", tmp_path / "tiny.gguf")
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("EDGESPEC_CACHE", str(blocker / "cache"))  # the subprocess inherits it
    assert "cannot write the bundle" in _one_line_error("generate", str(gguf), "hi")
