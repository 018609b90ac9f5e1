"""`--max-context` past the model's trained context (issue 43): a one-line ConfigError naming both
numbers (CLI: exit 2), from the trained context the export records in the manifest; a bundle from
before that records none and is not checked."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from edgespec.bundle import MANIFEST, Manifest, load_bundle
from edgespec.engine.context import check_max_context
from edgespec.errors import BundleError, ConfigError
from edgespec.exporters.context import trained_context

TRAINED = 512  # max_position_embeddings of the tiny models (tests/tiny.py)


def test_a_context_past_the_trained_one_is_one_line_naming_both():
    with pytest.raises(ConfigError) as err:
        check_max_context(40000, 32768)
    assert str(err.value) == ("max_context 40000 is past the model's trained context of 32768 tokens; "
                              "use --max-context 32768 or less")
    check_max_context(32768, 32768)  # the trained context itself is fine
    check_max_context(None, 32768)  # no limit asked for: the backend's default applies
    check_max_context(10 ** 9, None)  # a bundle that records none is not checked


@pytest.mark.parametrize(("config", "expected"), [
    (SimpleNamespace(max_position_embeddings=32768), 32768),
    (SimpleNamespace(text_config=SimpleNamespace(max_position_embeddings=8192), max_position_embeddings=1), 8192),
    (SimpleNamespace(max_position_embeddings=True), None),
    (SimpleNamespace(max_position_embeddings=0), None),
    (SimpleNamespace(max_position_embeddings="32k"), None),
    (SimpleNamespace(), None),
    (None, None),
])
def test_the_trained_context_is_read_from_the_source_config(config, expected):
    assert trained_context(SimpleNamespace(config=config)) == expected


def _manifest(bundle) -> dict:
    return json.loads((bundle / MANIFEST).read_text())


@pytest.mark.parametrize("value", [0, -5, True, "32768", 1.5])
def test_a_bad_recorded_context_is_a_broken_manifest(zoo, value):
    data = _manifest(zoo.bundle("qwen2", None))
    data["target"]["context_length"] = value
    with pytest.raises(BundleError, match="target.context_length") as err:
        Manifest.from_dict(data)
    assert "\n" not in str(err.value)


def test_the_export_records_the_trained_context(zoo):
    assert _manifest(zoo.bundle("qwen2", None))["target"]["context_length"] == TRAINED
    assert load_bundle(zoo.bundle("qwen2", None)).manifest.target.context_length == TRAINED


def test_an_export_from_a_gguf_records_its_context_length(zoo, tmp_path):
    pytest.importorskip("gguf")
    from edgespec.exporters.export import ExportConfig, export_bundle

    gguf_bundle = zoo.bundle("qwen2", None, formats=("gguf",))
    src = gguf_bundle / load_bundle(gguf_bundle).manifest.target.formats["gguf"].file
    out = export_bundle(ExportConfig(output=tmp_path / "b", target=src, draft=None, formats=("gguf",)))
    assert load_bundle(out).manifest.target.context_length == TRAINED  # the GGUF's qwen2.context_length


def test_the_api_refuses_a_context_past_the_trained_one(zoo):
    from edgespec.engine.engine import load

    bundle = zoo.bundle("qwen2", None)
    with pytest.raises(ConfigError) as err:
        load(bundle, max_context=TRAINED + 1)
    assert f"max_context {TRAINED + 1}" in str(err.value) and f"{TRAINED} tokens" in str(err.value)
    with load(bundle, max_context=TRAINED) as e:  # the trained context itself opens
        assert e.generate("the cat", max_tokens=2, wait=True) is not None


def test_an_older_bundle_without_the_record_is_not_checked(zoo, tmp_path):
    from edgespec.engine.engine import load

    old = shutil.copytree(zoo.bundle("qwen2", None), tmp_path / "old")
    data = _manifest(old)
    del data["target"]["context_length"]
    (old / MANIFEST).write_text(json.dumps(data))
    with load(old, max_context=TRAINED + 1) as e:
        assert e.generate("the cat", max_tokens=2, wait=True) is not None


def test_the_cli_exits_2_with_one_line(zoo):
    proc = subprocess.run([sys.executable, "-m", "edgespec", "generate", str(zoo.bundle("qwen2", None)), "the cat",
                           "--max-tokens", "2", "--max-context", "40000"], capture_output=True, timeout=300)
    err = proc.stderr.decode().strip()
    assert proc.returncode == 2, err
    assert "\n" not in err and "Traceback" not in err
    assert "40000" in err and f"trained context of {TRAINED} tokens" in err
