"""GGUF export and the llama.cpp backend, on tiny models made in-process.

Exactness: llama.cpp speculative greedy == llama.cpp plain greedy == transformers, token for
token (fp32 GGUF targets); VocabTrim and layer-cut drafts fed input embeddings; rollback;
passthrough of GGUF sources; one-line errors for broken files."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'edgespec[llamacpp]')")
pytest.importorskip("gguf")

from edgespec.bundle import load_bundle  # noqa: E402
from edgespec.engine.engine import load  # noqa: E402
from edgespec.errors import BackendError, ContextFullError  # noqa: E402
from edgespec.exporters.export import ExportConfig, export_bundle  # noqa: E402
from edgespec.runtimes.llamacpp.runtime import LlamaCppRuntime, _chunks, available_devices  # noqa: E402
from tests.test_export_onnx import N_NEW, decode, hf_logits, plain_references, verify_matches_decodes  # noqa: E402
from tests.tiny import LONG_PROMPT, VOCAB  # noqa: E402
from tests.zoo import AGREEING, DISAGREEING, FAMILIES  # noqa: E402

GGUF = ("gguf",)
ATOL = 2e-3  # llama.cpp sums in another order than torch (fp32 model, fp32 cache)


def runtime(bundle_path, role="target", **kw) -> LlamaCppRuntime:
    b = load_bundle(bundle_path)
    entry = b.manifest.target if role == "target" else b.manifest.draft
    return LlamaCppRuntime(b.file(entry.formats["gguf"].file), threads=1, **kw)


def test_chunks_keep_all_logits_in_the_last_call():
    assert _chunks(5, 512, 2) == [(0, 5)]
    assert _chunks(1030, 512, 3) == [(0, 512), (512, 1024), (1024, 1030)]
    assert _chunks(1025, 512, 4) == [(0, 512), (512, 1021), (1021, 1025)]


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3", "gemma3-tied"])
def test_logits_match_transformers_and_rollback(zoo, name):
    hf = zoo.hf_model(name)
    ids = zoo.hf_tokenizer(name)(LONG_PROMPT).input_ids
    assert len(ids) > 32  # crosses the tiny Gemma's 16-token sliding window
    ref = hf_logits(hf, ids)
    with runtime(zoo.bundle(name, None, formats=GGUF)) as rt:
        assert rt.vocab_size == VOCAB
        split = 7
        a = rt.forward(ids[:split], n_logits=split)
        b = rt.forward(ids[split:], n_logits=len(ids) - split)
        assert rt.n_past == len(ids)
        np.testing.assert_allclose(np.concatenate([a, b]), ref, atol=ATOL, rtol=1e-3)
        # roll back past the sliding window and continue differently: no stale positions seen
        cut = 9
        rt.trim(cut)
        assert rt.n_past == cut
        other = [int(t) for t in np.random.default_rng(0).integers(10, VOCAB, size=30)]
        got = rt.forward(other, n_logits=len(other))
        np.testing.assert_allclose(got, hf_logits(hf, ids[:cut] + other)[cut:], atol=ATOL, rtol=1e-3)
        rt.reset()
        last = rt.forward(ids, n_logits=1)
        assert last.shape == (1, VOCAB)
        np.testing.assert_allclose(last[0], ref[-1], atol=ATOL, rtol=1e-3)
        mem = rt.memory_bytes()
        assert mem["weights"] > 0 and mem["kv"] >= mem["kv_used"] > 0


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_verify_pass_rounds_exactly_like_one_token_decodes(zoo, precision):
    """What exact speculative decoding on a quantized model rests on: the logits of a k-token
    verify pass are bit-identical to k one-token decodes. It needs a llama.cpp built without
    llamafile's sgemm (README) and no repacked weights."""
    ids = zoo.hf_tokenizer("llama")(LONG_PROMPT).input_ids
    with runtime(zoo.bundle("llama", None, formats=GGUF, target_precision=precision)) as rt:
        assert_verify_equals_one_token_decodes(rt, ids, start=20, width=6)


def assert_verify_equals_one_token_decodes(rt: LlamaCppRuntime, ids: list[int], start: int, width: int) -> None:
    """After ids[:start], one forward of the next `width` tokens gives bit for bit the logits of
    `width` one-token forwards, up to the widest the exactness probe finds exact on this CPU (on
    an AVX2 EPYC llama.cpp's quantized matmuls round apart from 8 rows on: the engine verifies no
    wider there), and the probe's verdict agrees with the direct check (the slow tier checks the
    real default model with it too)."""
    from edgespec.runtimes.exactness import PROBE_STARTS, probe

    assert rt.capabilities.batch_variance is None, rt.capabilities.batch_variance
    verdict = probe(rt, width + 1)
    assert verdict.exact_width >= 2, verdict.describe()  # ggml's small-batch matmuls work row by row
    assert verify_matches_decodes(rt, ids, start, min(width, verdict.exact_width)), start
    if verdict.exact_width <= width:  # the first inexact width is seen by a direct check too, from
        # one of the probe's own starts that `ids` reach (those past 64 and 128 keys on a long prompt)
        starts = [s for s in PROBE_STARTS if s + verdict.exact_width + 1 <= len(ids)]
        assert not all(verify_matches_decodes(rt, ids, s, verdict.exact_width + 1) for s in starts), verdict


def test_batch_variance_is_reported_and_warned_once(monkeypatch, caplog):
    import edgespec.runtimes.llamacpp.runtime as lc
    from edgespec.decoding import speculative

    monkeypatch.setattr(lc, "system_info", lambda: "CPU : AVX2 = 1 | LLAMAFILE = 1 | REPACK = 1 |")
    reason = lc.batch_variance(extra_bufts=True)
    assert "llamafile" in reason and lc.EXTRA_BUFTS_ENV in reason and "GGML_LLAMAFILE=OFF" in reason
    monkeypatch.setattr(lc, "system_info", lambda: "CPU : AVX2 = 1 | LLAMAFILE = 0 |")
    assert lc.batch_variance(extra_bufts=False) is None
    monkeypatch.setattr(speculative, "_warned", set())
    target = type("T", (), {"capabilities": lc.Capabilities("llamacpp", batch_variance=reason)})()
    drafter = type("D", (), {"runtimes": (), "trees": False})()  # a Drafter declares both
    with caplog.at_level("WARNING", logger="edgespec.decoding.speculative"):
        speculative._check_target(target, drafter, None)
        speculative._check_target(target, drafter, None)
    assert len(caplog.records) == 1 and "near-ties" in caplog.records[0].getMessage()


@pytest.fixture(scope="module")
def references(zoo):
    """name -> [(prompt ids, transformers greedy, plain greedy on llama.cpp)] per prompt."""
    return plain_references(zoo, lambda name: zoo.bundle(name, None, formats=GGUF), backend="llamacpp")


@pytest.mark.parametrize("name", FAMILIES)
def test_plain_greedy_equals_transformers(references, name):
    for _, hf_out, plain in references(name):
        assert len(set(plain)) > 5, "degenerate output makes this test vacuous"
        assert plain == hf_out


@pytest.mark.parametrize("draft", [AGREEING, DISAGREEING])
@pytest.mark.parametrize("name", FAMILIES)
def test_speculative_greedy_equals_plain_and_transformers(zoo, references, name, draft):
    drafted = accepted = 0
    with load(zoo.bundle(name, draft, formats=GGUF), backend="llamacpp", k=4, drafter="model") as engine:
        assert engine.draft is not None and engine.draft_backend == "llamacpp"
        for ids, hf_out, plain in references(name):
            out, d, a = decode(engine, ids, N_NEW)
            assert out == plain == hf_out
            drafted, accepted = drafted + d, accepted + a
    assert drafted > 0
    if draft == DISAGREEING:
        assert accepted < drafted  # rejections happened, so rollback was exercised


def test_manifest_records_llamacpp_quantization(zoo):
    m = load_bundle(zoo.bundle("llama", DISAGREEING, formats=GGUF)).manifest
    assert m.target.formats["gguf"].precision == "fp32"
    q = m.draft.formats["gguf"].quantization
    assert m.draft.formats["gguf"].precision == "int4" and q == {"method": "llama.cpp", "type": "Q4_K_M"}


@pytest.mark.parametrize("name", ["gemma3", "llama"])
def test_trimmed_draft_is_fed_embeddings_and_matches_the_target_head(zoo, name):
    """An fp32 VocabTrim draft with every layer is the target restricted to K tokens: its K
    logits must equal the target's at the kept ids (checks the embd path and Gemma's scale)."""
    path = zoo.bundle(name, "fp32", formats=GGUF, draft_vocab=64)
    b = load_bundle(path)
    keep = b.id_map()
    assert b.manifest.draft.vocab_size == 64 and len(keep) == 64
    assert (path / "draft" / "model.embd.gguf").is_file()
    ids = zoo.hf_tokenizer(name)(LONG_PROMPT).input_ids
    with runtime(path) as target, runtime(path, "draft") as draft:
        assert draft.vocab_size == 64 and draft.capabilities.extra["input_embeddings"]
        full = target.forward(ids, n_logits=len(ids))
        trimmed = draft.forward(ids, n_logits=len(ids))
        np.testing.assert_allclose(trimmed, full[:, keep], atol=ATOL, rtol=1e-3)
        draft.trim(10)
        np.testing.assert_allclose(draft.forward(ids[10:], n_logits=3), full[-3:, keep], atol=ATOL, rtol=1e-3)
        assert "input_embedding" in draft.memory_bytes()


@pytest.mark.parametrize("name", ["gemma3", "qwen2"])
def test_trimmed_layer_cut_int8_draft_stays_exact(zoo, references, name):
    path = zoo.bundle(name, AGREEING, formats=GGUF, draft_vocab=96, draft_layers=1)
    m = load_bundle(path).manifest
    assert m.draft.n_layers == 1 and m.draft.vocab_size == 96
    assert m.draft.formats["gguf"].quantization["type"] == "Q8_0"
    drafted = 0
    with load(path, backend="llamacpp", k=3, drafter="model") as engine:
        for ids, hf_out, plain in references(name):
            out, d, _ = decode(engine, ids, N_NEW)
            assert out == plain == hf_out
            drafted += d
    assert drafted > 0


def test_gguf_source_passes_through_and_round_trips(zoo, tmp_path):
    """A GGUF written from HF reloads in transformers with the same logits (names, permuted
    q/k, tokenizer), and exporting it again to GGUF copies it byte for byte."""
    import torch
    from transformers import AutoModelForCausalLM

    name = "llama"
    src = zoo.bundle(name, None, formats=GGUF) / "target" / "model.gguf"
    ids = zoo.hf_tokenizer(name)(LONG_PROMPT).input_ids
    back = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32).eval()
    np.testing.assert_allclose(hf_logits(back, ids), hf_logits(zoo.hf_model(name), ids), atol=1e-4, rtol=1e-4)

    out = export_bundle(ExportConfig(output=tmp_path / "b", target=src, formats=GGUF, draft=None))
    art = load_bundle(out).manifest.target.formats["gguf"]
    assert art.quantization["passthrough"] is True and art.precision == "fp32"
    assert (out / art.file).read_bytes() == src.read_bytes()
    with load(out, backend="llamacpp") as engine:
        assert engine.tokenizer.encode(LONG_PROMPT) == ids


def test_truncated_gguf_is_a_one_line_error(zoo, tmp_path):
    src = zoo.bundle("qwen2", None, formats=GGUF)
    bad = tmp_path / "bundle"
    import shutil

    shutil.copytree(src, bad)
    f = bad / "target" / "model.gguf"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(BackendError, match="cannot load model.gguf"):
        LlamaCppRuntime(f)
    proc = subprocess.run([sys.executable, "-m", "edgespec", "generate", str(bad), "hello", "--max-tokens", "2"],
                          capture_output=True, text=True, env=dict(os.environ), timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot load model.gguf" in lines[0], proc.stderr


def test_bad_device_and_capacity_are_one_line_errors(zoo):
    path = zoo.bundle("qwen2", None, formats=GGUF)
    if "GPU" not in available_devices():
        with pytest.raises(BackendError, match="device 'GPU' is not available"):
            runtime(path, device="GPU")
    with pytest.raises(BackendError, match="device 'NPU'"):
        runtime(path, device="NPU")
    with runtime(path, kv_capacity=16) as rt:
        rt.forward(list(range(10, 26)))
        with pytest.raises(ContextFullError, match="context is full"):  # issue 27: not a bare BackendError
            rt.forward([5])
        assert rt.n_past == 16


def test_cli_export_gguf_and_generate(zoo, tmp_path):
    out = tmp_path / "cli.bundle"
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-m", "edgespec", "export", "--target", str(zoo.source("qwen2")),
                           "--format", "onnx,gguf", "--draft-precision", "int8", "-o", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "edgespec.json").read_text())
    assert set(manifest["target"]["formats"]) == {"onnx", "gguf"}
    runs = []
    for backend in ("onnxruntime", "llamacpp"):
        proc = subprocess.run([sys.executable, "-m", "edgespec", "generate", str(out), LONG_PROMPT,
                               "--max-tokens", "12", "--backend", backend],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        runs.append(proc.stdout)
    assert runs[0] == runs[1] and runs[0].strip()
