"""What the engine and onnxruntime do with the exactness probe's verdict, on exported tiny models:
the engine probes its target at load and caps its verifies, decodes plainly where no verify width is
exact unless inexact drafting is allowed, and switches onnxruntime to padded rows where one-row
forwards round apart; the exported attention never multiplies a single query row. The probe itself,
on toy runtimes, is tests/test_exactness.py's."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from edgespec.engine.engine import load
from edgespec.runtimes.exactness import probe
from tests.tiny import PROMPTS
from tests.zoo import AGREEING

# -- the engine: probed at load, plain where nothing is exact unless allow_inexact ---------------

def _wide_forwards_round_off(monkeypatch, cache: Path):
    """Every verify width rounds apart from one-token forwards; the verdicts this fakes are cached
    in `cache`, so later tests probe the shared bundles afresh."""
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    monkeypatch.setenv("EDGESPEC_CACHE", str(cache))

    forward = OnnxRuntime.forward

    def rounded(self, token_ids, n_logits=1):
        out = forward(self, token_ids, n_logits)
        return out + np.float32(1e-3) if len(token_ids) > 1 else out

    monkeypatch.setattr(OnnxRuntime, "forward", rounded)


def test_the_engine_probes_the_target_and_caps_its_verifies(zoo):
    with load(zoo.bundle("llama", AGREEING), k=3, policy="cost", drafter="model") as e:
        verdict = e.opened.exactness
        assert verdict is not None and verdict.max_width == 13  # 4k+1: adaptive drafts plus lookup tails
        assert e.decoder.limits.verify_width == (verdict.exact_width if verdict.exact_width >= 2 else None)
    with load(zoo.bundle("llama", AGREEING), k=3, policy="cost", drafter="model") as e:
        assert e.opened.exactness.cached and e.opened.exactness.exact == verdict.exact
    with load(zoo.bundle("llama", AGREEING), k=3, policy="fixed", drafter="model") as e:
        assert e.opened.exactness.max_width == 4  # a fixed k verifies k+1 at most
    with load(zoo.bundle("llama", AGREEING), use_draft=False) as e:
        assert e.opened.exactness is None  # plain decoding verifies nothing


def test_no_exact_width_means_plain_decoding_unless_inexact_drafting_is_allowed(zoo, monkeypatch, caplog, tmp_path):
    from edgespec.engine.opened import DRAFTING_REFUSED

    _wide_forwards_round_off(monkeypatch, tmp_path / "cache")
    bundle = zoo.bundle("llama", AGREEING)
    with load(bundle, use_draft=False) as e:
        plain = e.generate(PROMPTS[0], max_tokens=12)
    with caplog.at_level(logging.WARNING), load(bundle, k=3, drafter="model", retune=True) as e:
        assert e.opened.exactness.exact == () and e.opened.drafter is None and e.draft is None
        assert e.opened.inexact_refusal == DRAFTING_REFUSED
        assert e.opened.speculation() == {"speculative": False, "reason": DRAFTING_REFUSED}
        assert e.opened.to_dict()["speculation"]["speculative"] is False
        assert e.generate(PROMPTS[0], max_tokens=12) == plain  # the default is the target's own output
        assert e.last_stats.drafted == 0 and e.last_stats.new_tokens == 12
    assert "drafting is off, decoding plainly" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING), load(bundle, k=3, drafter="model", allow_inexact=True) as e:
        assert e.opened.exactness.cached and e.opened.drafter == "model" and e.decoder.limits.verify_width is None
        assert e.opened.inexact_refusal is None and e.opened.speculation()["speculative"] is True
        e.generate(PROMPTS[0], max_tokens=12)
        assert e.last_stats.drafted > 0  # asked for: drafting runs, with a warning
    assert "drafting anyway (--allow-inexact)" in caplog.text


def test_plain_decoding_asked_for_is_not_reported_as_an_inexact_refusal(zoo):
    with load(zoo.bundle("llama", AGREEING), use_draft=False) as e:
        assert e.opened.inexact_refusal is None
        assert e.opened.speculation() == {"speculative": False,
                                          "reason": "plain decoding was asked for (no drafter)"}


# -- onnxruntime: the exported attention never multiplies one query row -----------------------

def _mha_source(root):
    """A tiny Llama with one query head per KV head (rep = 1): the case that stacks its queries twice."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny import VOCAB, make_tokenizer

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    src = root / "mha"
    model.save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    return src, model


def _attention_rows(path, ids: list[int]) -> list[int]:
    """Rows of every attention MatMul's left matrix in a forward of `ids` from an empty cache."""
    onnx = pytest.importorskip("onnx")
    import onnxruntime as ort

    model = onnx.load(str(path))
    scores = [n.output[0] for n in model.graph.node if n.op_type == "MatMul" and not any(
        i.name == n.input[1] for i in model.graph.initializer)]
    model.graph.output.extend(onnx.ValueInfoProto(name=s) for s in scores)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    past = {i.name: np.zeros((1, 0, *i.shape[2:]), np.float32) for i in sess.get_inputs() if i.name.startswith("past_")}
    outs = sess.run(scores, {"input_ids": np.array([ids], np.int64), "n_logits": np.array([1], np.int64), **past})
    return [o.shape[-2] for o in outs]


@pytest.mark.parametrize("name", ["llama", "gemma3", "mha"])
def test_onnx_attention_multiplies_at_least_two_rows_and_stays_right(zoo, tmp_path, name):
    """onnxruntime multiplies a one-row matrix with another kernel than a taller one (1e-7 apart
    on this project's CI CPUs), so the exported attention never gives it one row: a one-token
    decode then rounds like each row of a verify. Numerics stay transformers' (rep = 1 included)."""
    from edgespec.bundle import load_bundle
    from edgespec.exporters.export import ExportConfig, export_bundle
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime
    from tests.test_export_onnx import hf_logits

    if name == "mha":
        src, model = _mha_source(tmp_path)
        path = export_bundle(ExportConfig(output=tmp_path / "mha.bundle", target=src, draft=None))
    else:
        path, model = zoo.bundle(name, None), zoo.hf_model(name)
    onnx_file = load_bundle(path).file(load_bundle(path).manifest.target.formats["onnx"].file)
    rows = _attention_rows(onnx_file, [5])
    assert rows and min(rows) >= 2, rows
    ids = [int(t) for t in np.random.default_rng(3).integers(3, 300, 12)]
    rt = OnnxRuntime(onnx_file)
    np.testing.assert_allclose(rt.forward(ids, n_logits=12), hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    verdict = probe(rt, 6)  # what this machine does with it, stated (not assumed) in the test log
    print(f"{name}: {verdict.describe()}")


# -- onnxruntime's padded-rows mode (what the engine switches to where one row rounds apart) --------

def test_onnx_padded_rows_compute_the_same_model_up_to_capacity(zoo):
    from edgespec.bundle import load_bundle
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    b = load_bundle(zoo.bundle("qwen2", None))
    path = b.file(b.manifest.target.formats["onnx"].file)
    plain, padded = OnnxRuntime(path, kv_capacity=12), OnnxRuntime(path, kv_capacity=12, pad_rows=True)
    assert padded.capabilities.extra["pad_rows"] and not plain.capabilities.extra["pad_rows"]
    ids = [int(t) for t in np.random.default_rng(5).integers(3, 300, 12)]
    np.testing.assert_allclose(padded.forward(ids[:6], n_logits=2), plain.forward(ids[:6], n_logits=2), atol=1e-4)
    for t in ids[6:12]:  # up to the last slot: the padding row has room past it
        np.testing.assert_allclose(padded.forward([t]), plain.forward([t]), atol=1e-4)
    assert padded.n_past == plain.n_past == 12
    padded.trim(4)
    plain.trim(4)
    np.testing.assert_allclose(padded.forward(ids[4:9], n_logits=5), plain.forward(ids[4:9], n_logits=5), atol=1e-4)


def test_the_engine_switches_onnxruntime_to_padded_rows_where_one_row_rounds_apart(zoo, monkeypatch):
    """A CPU whose one-row forwards round unlike wider ones (made here by perturbing wider unpadded
    forwards, as MatMulNBits with int8 activations does by whole logits): the engine reopens the
    target with padded rows, where the probe decides again, and greedy output stays plain's."""
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    forward = OnnxRuntime.forward

    def rounded(self, token_ids, n_logits=1):
        out = forward(self, token_ids, n_logits)
        return out + np.float32(1e-3) if len(token_ids) > 1 and not self.capabilities.extra["pad_rows"] else out

    monkeypatch.setattr(OnnxRuntime, "forward", rounded)
    bundle = zoo.bundle("llama", AGREEING)
    with load(bundle, k=3, drafter="model", retune=True) as e:
        assert e.target.capabilities.extra["pad_rows"] == (e.opened.exactness.exact_width > 1)
        spec = e.generate(PROMPTS[1], max_tokens=16)
        assert e.last_stats.drafted > 0 or e.opened.exactness.exact_width < 2
    with load(bundle, use_draft=False) as plain:
        assert plain.generate(PROMPTS[1], max_tokens=16) == spec
    opened = []
    init = OnnxRuntime.__init__

    def counting(self, *args, **kw):
        opened.append(kw.get("pad_rows", False))
        init(self, *args, **kw)

    monkeypatch.setattr(OnnxRuntime, "__init__", counting)
    with load(bundle, k=3, drafter="model") as e:  # the mode settled on is remembered: opened directly
        assert e.opened.exactness.cached and opened[0] == e.target.capabilities.extra["pad_rows"]
        assert len(opened) == 2  # the target once, and the draft


def test_a_dropped_draft_leaves_no_shared_body_behind(zoo, monkeypatch, tmp_path):
    """The plan put the draft on the target's body; drafting refused, the draft is closed: what
    was opened, and every view of it, says there is no draft body, while the plan keeps what was asked."""
    from edgespec.engine.opened import DRAFTING_REFUSED

    _wide_forwards_round_off(monkeypatch, tmp_path / "cache")
    with load(zoo.bundle("llama", AGREEING), backend="onnxruntime", k=2, drafter="model", draft_body="shared",
              retune=True) as e:
        assert e.plan.shared_body and e.opened.inexact_refusal == DRAFTING_REFUSED and e.draft is None
        assert e.opened.draft_body is None and e.opened.draft_backend is None
        assert e.shared_body is e.opened.shared_body is False
        assert e.describe()["draft_body"] is None
