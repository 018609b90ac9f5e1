"""docs/adding-a-family.md, followed step by step on a tiny random model: the page's own code
(transformers' classes under a new model type, the row, the tiny model) is run as written, the
model exported to ONNX and GGUF, and each field of the row checked where the page says it is read.
A step of the page that stops working fails here."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from edgespec.bundle import load_bundle
from edgespec.errors import ExportError
from edgespec.models.families import FAMILIES, GGUF_ARCHS, ArchFacts, Family, family_for, register, unregister

pytest.importorskip("torch")
pytest.importorskip("gguf")

DOC = Path(__file__).resolve().parents[1] / "docs" / "adding-a-family.md"
MODEL_TYPE = "edgespec_demo"  # the page's example: a Llama-like family under a new name


def doc_steps() -> list[str]:
    """The page's Python blocks, in order: transformers' classes, the row, the tiny model."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    assert len(blocks) == 3, "the page's three code steps changed: update this test with it"
    return blocks


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """(row, source folder, bundle) of the page's family; the row is removed after the module."""
    from edgespec.exporters.export import ExportConfig, export_bundle

    classes, row_step, tiny_step = doc_steps()
    exec(classes, {})  # step 1
    assert MODEL_TYPE not in FAMILIES
    exec(row_step, {})  # step 2
    row = FAMILIES[MODEL_TYPE]
    try:
        root = tmp_path_factory.mktemp("demo-family")
        scope = {"folder": root / "src"}
        exec(tiny_step, scope)  # step 3
        src = scope["source"]
        bundle = export_bundle(ExportConfig(output=root / "demo.bundle", target=src, formats=("onnx", "gguf"),
                                            draft=None))
        yield row, src, bundle
    finally:
        unregister(row)
    assert MODEL_TYPE not in FAMILIES


def test_the_row_is_served_by_model_type_only(demo):
    row = demo[0]
    assert family_for(MODEL_TYPE) is row and row.model_type == MODEL_TYPE and not row.gguf.reads
    assert GGUF_ARCHS[row.gguf.arch] is not row  # reads=False: a llama GGUF still reads as Llama
    with pytest.raises(ValueError, match="already served"):
        register(Family("again", model_types=(MODEL_TYPE,)))


def test_the_exporter_honours_the_row(demo):
    row, src, path = demo
    b = load_bundle(path)
    m = b.manifest
    assert (m.model_type, m.family) == (MODEL_TYPE, row.name)
    config = json.loads((src / "config.json").read_text())
    assert {k: config[k] for k in row.tiny} == dict(row.tiny)  # `tiny`
    vocab = json.loads(b.file(m.tokenizer.file).read_text())["model"]["vocab"]
    assert row.stop_tokens and {vocab[t] for t in row.stop_tokens} <= set(m.tokenizer.stop_token_ids)
    assert (m.tokenizer.chat_template, m.tokenizer.chat_template_source) == (row.fallback_chat_template, "family")


def test_onnx_logits_equal_transformers(demo):
    import torch
    from transformers import AutoModelForCausalLM

    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    _, src, path = demo
    b = load_bundle(path)
    ids = [1, 40, 41, 42, 43, 44, 45, 46]
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    rt = OnnxRuntime(b.file(b.manifest.target.formats["onnx"].file))
    np.testing.assert_allclose(rt.forward(ids, n_logits=len(ids)), ref, atol=1e-4, rtol=1e-4)


def test_gguf_is_written_as_the_rows_architecture(demo):
    """`gguf.arch`/`writes` name the file's architecture; `permute_qk` reorders q/k rows as llama.cpp's
    llama reads them: read back (which undoes llama.cpp's order), every weight is the source's."""
    from safetensors.numpy import load_file

    from edgespec.exporters.gguf.reader import field, open_gguf
    from edgespec.exporters.gguf.source import read_gguf

    row, src, path = demo
    b = load_bundle(path)
    gguf_file = b.file(b.manifest.target.formats["gguf"].file)
    assert row.gguf.writes
    assert field(open_gguf(gguf_file), "general.architecture") == row.gguf.arch == "llama"
    back = read_gguf(gguf_file).dequantized()
    weights = load_file(src / "model.safetensors")
    assert set(back) == set(weights)
    for name, w in weights.items():
        np.testing.assert_array_equal(back[name], w, err_msg=name)


def test_a_family_without_a_gguf_writer_is_refused_by_name(tmp_path):
    """`writes=False` (or no `gguf`): the GGUF writer refuses the family in one line."""
    from edgespec.exporters.gguf.export import _arch

    row = Family("plain", gguf=ArchFacts("llama", reads=False))
    job = type("Job", (), {"spec": type("Spec", (), {"family": row})()})()
    with pytest.raises(ExportError, match="the plain family cannot be written as GGUF yet"):
        _arch(job)
