"""Loading a bundle: every way a bundle can be broken is one BundleError with a one-line message."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from edgespec.bundle import MANIFEST, SCHEMA_VERSION, Bundle, load_bundle
from edgespec.errors import BundleError


@pytest.fixture
def bundle(zoo, tmp_path) -> Path:
    """A private copy of a real bundle (target + int8 draft) to break."""
    return Path(shutil.copytree(zoo.bundle("llama"), tmp_path / "bundle"))


def edit_manifest(path: Path, change: Callable[[dict], None]) -> None:
    data = json.loads((path / MANIFEST).read_text())
    change(data)
    (path / MANIFEST).write_text(json.dumps(data))


def load_error(path: Path) -> str:
    with pytest.raises(BundleError) as info:
        load_bundle(path)
    msg = str(info.value)
    assert msg and "\n" not in msg, f"not one line: {msg!r}"
    return msg


def test_a_good_bundle_loads(bundle):
    b = load_bundle(bundle)
    assert isinstance(b, Bundle) and b.path == bundle
    assert b.manifest.schema_version == SCHEMA_VERSION
    assert b.formats() == ["onnx"] and b.manifest.draft is not None
    assert b.file(b.manifest.target.formats["onnx"].file).is_file()


def test_missing_path(tmp_path):
    assert "not found" in load_error(tmp_path / "nope")


def test_a_file_instead_of_a_folder(tmp_path):
    f = tmp_path / "model.onnx"
    f.write_bytes(b"\x08\x01")
    assert "not a bundle folder" in load_error(f)


def test_folder_without_manifest(tmp_path):
    assert MANIFEST in load_error(tmp_path)


@pytest.mark.parametrize("text", ["{not json", "", "\xff\xfe", "[1, 2]", "null"])
def test_manifest_that_is_not_a_json_object(bundle, text):
    (bundle / MANIFEST).write_bytes(text.encode("latin-1"))
    assert "broken manifest" in load_error(bundle)


@pytest.mark.parametrize("version", [SCHEMA_VERSION + 1, 0, "1", None])
def test_wrong_schema_version(bundle, version):
    edit_manifest(bundle, lambda d: d.update(schema_version=version))
    assert "schema version" in load_error(bundle)


def _del(*keys: str) -> Callable[[dict], None]:
    def change(d: dict) -> None:
        for k in keys[:-1]:
            d = d[k]
        del d[keys[-1]]

    return change


@pytest.mark.parametrize("keys", [
    ("schema_version",),
    ("family",),
    ("tokenizer",),
    ("target",),
    ("tokenizer", "stop_token_ids"),
    ("target", "n_layers"),
    ("target", "formats", "onnx", "precision"),
    ("draft", "formats", "onnx", "file"),
])
def test_manifest_missing_a_field(bundle, keys):
    edit_manifest(bundle, _del(*keys))
    load_error(bundle)


def test_manifest_with_an_unknown_field(bundle):
    edit_manifest(bundle, lambda d: d["target"].update(colour="blue"))
    assert "colour" in load_error(bundle)


@pytest.mark.parametrize("change", [
    lambda d: d.update(target=None),
    lambda d: d.update(target="target/model.onnx"),
    lambda d: d["target"].update(formats=None),
    lambda d: d["target"].update(formats=["onnx"]),
    lambda d: d["target"]["formats"].update(onnx="target/model.onnx"),
    lambda d: d.update(tokenizer=[]),
], ids=["target-null", "target-string", "formats-null", "formats-list", "artifact-string", "tokenizer-list"])
def test_manifest_with_a_field_of_the_wrong_type(bundle, change):
    edit_manifest(bundle, change)
    load_error(bundle)


@pytest.mark.parametrize("rel", ["target/model.onnx", "draft/model.onnx", "tokenizer.json"])
def test_a_referenced_file_deleted(bundle, rel):
    (bundle / rel).unlink()
    msg = load_error(bundle)
    assert "incomplete" in msg and rel in msg
