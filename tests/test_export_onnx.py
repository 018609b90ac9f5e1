"""Export to ONNX: logits equal transformers', speculative greedy equals plain greedy equals
transformers' greedy token for token, the manifest records what was written, writing is atomic."""
from __future__ import annotations

import gc
import json
import re

import numpy as np
import onnx
import pytest

from edgespec.bundle import MANIFEST, SCHEMA_VERSION, load_bundle
from edgespec.decoding import SamplingParams
from edgespec.engine.engine import load
from edgespec.errors import BundleError, ConfigError
from edgespec.exporters.export import ExportConfig, export_bundle
from edgespec.models.families import GEMMA_CHAT_TEMPLATE
from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime
from tests.tiny import CHATML, LONG_PROMPT, PROMPTS, VOCAB
from tests.zoo import AGREEING, DISAGREEING, FAMILIES, OTHER_SEED, VARIANTS

N_NEW = 40
SLIDING_WINDOW = 16  # tests/tiny.py's Gemma 3


def hf_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' own greedy decoding, without stopping at EOS (pure argmax, n tokens)."""
    import torch

    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, eos_token_id=None)
    return out[0, len(ids):].tolist()


def decode(engine, prompt: list[int], n: int) -> tuple[list[int], int, int]:
    """Greedy through the engine's decoder with no stop ids, so every run gives exactly n tokens.

    Returns (new tokens, drafted, accepted)."""
    tokens, drafted, accepted = list(prompt), 0, 0
    for step in engine.decoder.stream(tokens, SamplingParams(), n):
        drafted += step.drafted
        accepted += step.accepted
    return tokens[len(prompt):], drafted, accepted


def verify_matches_decodes(rt, ids: list[int], start: int, width: int) -> bool:
    """After ids[:start], is one forward of the next `width` tokens bit for bit `width` one-token
    forwards? (The backends whose verify must round like plain decoding ask it, in the tiny and
    the slow tier.)"""
    rt.reset()
    rt.forward(ids[:start])
    batch = np.array(rt.forward(ids[start:start + width], n_logits=width))  # a view may be reused
    rt.trim(start)
    singles = np.concatenate([np.array(rt.forward([t])) for t in ids[start:start + width]])
    return np.array_equal(batch, singles)


def target_runtime(bundle_path) -> OnnxRuntime:
    b = load_bundle(bundle_path)
    return OnnxRuntime(b.file(b.manifest.target.formats["onnx"].file))


def initializer_shapes(path) -> list[tuple[int, ...]]:
    model = onnx.load(str(path), load_external_data=False)
    return [tuple(t.dims) for t in model.graph.initializer]


# -- numerics ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers_in_chunks_and_after_trim(zoo, name):
    hf = zoo.hf_model(name)
    ids = zoo.hf_tokenizer(name)(LONG_PROMPT).input_ids
    assert len(ids) > 2 * SLIDING_WINDOW
    ref = hf_logits(hf, ids)
    rt = target_runtime(zoo.bundle(name))
    split = 7  # the second chunk attends to a past and crosses the sliding window
    a = rt.forward(ids[:split], n_logits=split)
    b = rt.forward(ids[split:], n_logits=len(ids) - split)
    assert rt.n_past == len(ids)
    np.testing.assert_allclose(np.concatenate([a, b]), ref, atol=1e-4, rtol=1e-4)

    cut = 20
    rt.trim(cut)
    assert rt.n_past == cut
    again = rt.forward(ids[cut:], n_logits=len(ids) - cut)
    np.testing.assert_allclose(again, ref[cut:], atol=1e-4, rtol=1e-4)

    # a different continuation after a trim sees none of the dropped positions
    rt.trim(cut)
    other = [int(t) for t in np.random.default_rng(0).integers(10, VOCAB, size=12)]
    got = rt.forward(other, n_logits=len(other))
    np.testing.assert_allclose(got, hf_logits(hf, ids[:cut] + other)[cut:], atol=1e-4, rtol=1e-4)

    # trims back to back, with no forward between them, then memory churn: the kept prefix must
    # not point into a buffer that was freed (one KV head makes the slice a contiguous view)
    rt.trim(cut + 5)
    rt.trim(cut)
    gc.collect()
    churn = [np.full((1, 4, 64, 32), 7.0, dtype=np.float32) for _ in range(32)]  # noqa: F841
    np.testing.assert_allclose(rt.forward(ids[cut:], n_logits=len(ids) - cut), ref[cut:], atol=1e-4, rtol=1e-4)

    rt.reset()
    last = rt.forward(ids, n_logits=1)
    assert last.shape == (1, VOCAB)
    np.testing.assert_allclose(last[0], ref[-1], atol=1e-4, rtol=1e-4)


def plain_references(zoo, bundle_of, **load_kw):
    """name -> [(prompt ids, transformers greedy, the backend's plain greedy)] per prompt, built
    once per name; `bundle_of(name)` gives the bundle, `load_kw` picks the backend."""
    cache: dict[str, list[tuple[list[int], list[int], list[int]]]] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = []
            with load(bundle_of(name), use_draft=False, **load_kw) as engine:
                for prompt in PROMPTS:
                    ids = engine.tokenizer.encode(prompt)
                    plain, drafted, _ = decode(engine, ids, N_NEW)
                    assert drafted == 0
                    cache[name].append((ids, hf_greedy(zoo.hf_model(name), ids, N_NEW), plain))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def references(zoo):
    """name -> [(prompt ids, transformers greedy, plain greedy of the ONNX target)] per prompt."""
    return plain_references(zoo, zoo.bundle)


@pytest.mark.parametrize("name", FAMILIES)
def test_plain_greedy_equals_transformers(references, name):
    for _, hf_out, plain in references(name):
        assert len(set(plain)) > 5, "degenerate model output makes this test vacuous"
        assert plain == hf_out


def speculative_matches(zoo, references, name: str, draft: str, **engine_kw) -> tuple[int, int]:
    """Assert speculative greedy == plain greedy == transformers on every prompt; (drafted, accepted).
    The drafting mechanism is what these tests check: it drafts even where the probe, at the thread
    count the session runs with, finds a width rounding apart (exact-or-plain is test_exactness's)."""
    drafted = accepted = 0
    with load(zoo.bundle(name, draft), **{"allow_inexact": True, **engine_kw}) as engine:
        for ids, hf_out, plain in references(name):
            out, d, a = decode(engine, ids, N_NEW)
            assert out == plain == hf_out
            drafted, accepted = drafted + d, accepted + a
    return drafted, accepted


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("draft", [AGREEING, DISAGREEING])
@pytest.mark.parametrize("name", FAMILIES)
def test_speculative_greedy_is_exact(zoo, references, name, draft, k):
    drafted, accepted = speculative_matches(zoo, references, name, draft, k=k, drafter="model")
    assert drafted > 0
    if draft == AGREEING:
        assert accepted > 0
    else:  # the draft must have been wrong sometimes, or rollback went untested
        assert accepted < drafted, f"{draft} draft accepted every token; pick a draft that disagrees"


def test_speculative_greedy_with_a_different_model_as_draft(zoo, references):
    drafted, accepted = speculative_matches(zoo, references, "gemma3", OTHER_SEED, k=4, drafter="model")
    assert drafted > 0 and accepted < drafted


@pytest.mark.parametrize("name", FAMILIES)
def test_speculative_greedy_with_the_default_drafting_is_exact(zoo, references, name):
    drafted, _ = speculative_matches(zoo, references, name, DISAGREEING)
    assert drafted > 0


# -- the manifest --------------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_manifest_records_artifacts_tokenizer_and_source(zoo, name):
    path = zoo.bundle(name, DISAGREEING)
    raw = json.loads((path / MANIFEST).read_text())
    m = load_bundle(path).manifest
    assert raw["schema_version"] == m.schema_version == SCHEMA_VERSION
    assert m.family == VARIANTS[name]["family"]

    tgt = m.target.formats["onnx"]
    assert (tgt.precision, tgt.quantization) == ("fp32", None)
    assert (path / tgt.file).is_file() and (path / (tgt.file + ".data")).is_file()
    assert (m.target.n_layers, m.target.vocab_size) == (2, VOCAB)
    drf = m.draft.formats["onnx"]
    assert drf.precision == "int4" and drf.file != tgt.file
    assert drf.quantization["bits"] == 4 and "MatMulNBits" in drf.quantization["method"]
    ops = {n.op_type for n in onnx.load(str(path / drf.file), load_external_data=False).graph.node}
    assert "MatMulNBits" in ops and "MatMul" in ops  # attention matmuls stay float
    m8 = load_bundle(zoo.bundle(name, AGREEING)).manifest
    assert m8.draft.formats["onnx"].precision == "int8"
    assert m8.draft.formats["onnx"].quantization["bits"] == 8

    src = m.target.source
    assert src["kind"] == "hf" and src["name"] == zoo.source(name).name
    assert re.fullmatch(r"[0-9a-f]{64}", src["sha256"])
    assert m.draft.source == src  # a self-draft comes from the same weights
    if name == "gemma3":
        other = load_bundle(zoo.bundle(name, OTHER_SEED)).manifest.draft.source
        assert other["sha256"] != src["sha256"] and other["name"] == zoo.source(name, seed=1).name

    tok, hf_tok = m.tokenizer, zoo.hf_tokenizer(name)
    assert (path / tok.file).is_file()
    assert tok.bos_token_id == hf_tok.bos_token_id
    assert hf_tok.eos_token_id in tok.stop_token_ids
    with load(path, use_draft=False) as engine:  # the bundle tokenizer reproduces transformers'
        assert engine.tokenizer.encode(LONG_PROMPT) == hf_tok(LONG_PROMPT).input_ids
    expected_template = {"llama": (None, "none"), "qwen2": (CHATML, "model"), "gemma3": (GEMMA_CHAT_TEMPLATE, "family")}
    assert (tok.chat_template, tok.chat_template_source) == expected_template[name]
    assert m.base_model == (name != "qwen2")
    if name == "qwen2":
        assert hf_tok.convert_tokens_to_ids("<|im_end|>") in tok.stop_token_ids
    if name == "gemma3":
        assert hf_tok.convert_tokens_to_ids("<end_of_turn>") in tok.stop_token_ids


@pytest.mark.parametrize("name, tables", [("qwen2", 1), ("gemma3-tied", 1), ("llama", 2)])
def test_tied_embedding_is_stored_once_in_the_target(zoo, name, tables):
    m = load_bundle(zoo.bundle(name)).manifest
    hidden = 64
    shapes = initializer_shapes(zoo.bundle(name) / m.target.formats["onnx"].file)
    vocab_tables = [s for s in shapes if sorted(s) == sorted((VOCAB, hidden))]
    assert len(vocab_tables) == tables, shapes


# -- fp16 ----------------------------------------------------------------------------------

def test_fp16_target_matches_fp32(zoo, tmp_path):
    name = "llama"
    out = export_bundle(ExportConfig(output=tmp_path / "fp16", target=zoo.source(name), draft=None,
                                     target_precision="fp16"))
    m = load_bundle(out).manifest
    assert m.draft is None and m.target.formats["onnx"].precision == "fp16"
    f16_file, f32_file = out / m.target.formats["onnx"].file, zoo.bundle(name) / "target" / "model.onnx"
    model = onnx.load(str(f16_file), load_external_data=False)
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in model.graph.initializer)
    size = lambda f: f.with_name(f.name + ".data").stat().st_size  # noqa: E731
    assert size(f16_file) < 0.6 * size(f32_file)

    ids = zoo.hf_tokenizer(name)(LONG_PROMPT).input_ids
    l16 = OnnxRuntime(f16_file).forward(ids, n_logits=len(ids))
    l32 = OnnxRuntime(f32_file).forward(ids, n_logits=len(ids))
    np.testing.assert_allclose(l16, l32, atol=0.05)
    with load(out) as e16, load(zoo.bundle(name), use_draft=False) as e32:
        assert decode(e16, ids, 24)[0] == decode(e32, ids, 24)[0]


# -- atomic writes -------------------------------------------------------------------------

def test_export_refuses_an_existing_path_unless_forced(zoo, tmp_path):
    out = tmp_path / "bundle"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    cfg = dict(output=out, target=zoo.source("qwen2"), draft=None)
    with pytest.raises(BundleError, match="exists.*--force"):
        export_bundle(ExportConfig(**cfg))
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    # --force replaces a bundle, never a folder of the user's files (issue 27)
    with pytest.raises(BundleError):
        export_bundle(ExportConfig(**cfg, force=True))
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    export_bundle(ExportConfig(**cfg, force=True))  # an empty folder may be replaced
    export_bundle(ExportConfig(**cfg, force=True))  # and so may a bundle
    assert load_bundle(out).manifest.draft is None
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]


def _boom(*args, **kwargs):
    raise RuntimeError("tokenizer export failed")


def test_failed_export_leaves_nothing_behind(zoo, tmp_path, monkeypatch):
    monkeypatch.setattr("edgespec.exporters.export.export_tokenizer", _boom)
    with pytest.raises(RuntimeError, match="tokenizer export failed"):
        export_bundle(ExportConfig(output=tmp_path / "bundle", target=zoo.source("llama")))
    assert list(tmp_path.iterdir()) == []


def test_failed_forced_export_keeps_the_old_bundle(zoo, tmp_path, monkeypatch):
    out = export_bundle(ExportConfig(output=tmp_path / "bundle", target=zoo.source("llama"), draft=None))
    before = (out / MANIFEST).read_text()
    monkeypatch.setattr("edgespec.exporters.export.export_tokenizer", _boom)
    with pytest.raises(RuntimeError):
        export_bundle(ExportConfig(output=out, target=zoo.source("llama"), force=True))
    assert (out / MANIFEST).read_text() == before and load_bundle(out)
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]


@pytest.mark.parametrize("kw, match", [
    (dict(target_precision="int3"), "target-precision"),
    (dict(draft_precision="fp16"), "draft-precision"),
    (dict(formats=("tflite",)), "format"),
    (dict(draft="self", draft_precision="fp32"), "draft"),
    (dict(draft_vocab=0), "^--draft-vocab must be an integer >= 1, got 0$"),
    (dict(draft_vocab=True), "^--draft-vocab must be an integer >= 1, got True$"),
    (dict(draft_vocab="half"), "--draft-vocab takes a number, 'auto' or 'full'"),
    (dict(draft_head="trained", train_minutes=float("inf")), "^--train-minutes must be a finite number > 0"),
    (dict(tree=True, formats=("gguf",)), "--tree .* add --format onnx"),
])
def test_export_config_rejects_bad_options(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        ExportConfig(output=tmp_path / "b", **kw)
