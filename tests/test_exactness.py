"""The exactness probe (runtimes/exactness.py) and what the decoder and engine do with its verdict:
verify only at widths that round like one-token forwards on this machine, or refuse to draft."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from edgespec.decoding import SamplingParams, SpeculativeDecoder
from edgespec.decoding.limits import DecoderLimits
from edgespec.engine.engine import load
from edgespec.errors import ConfigError
from edgespec.runtimes import exactness
from edgespec.runtimes.exactness import Exactness, probe, probe_cached
from tests.tiny import PROMPTS
from tests.toy import ToyRuntime, naive_greedy
from tests.zoo import AGREEING


class WideRounding(ToyRuntime):
    """A toy whose forwards of `from_width`+ tokens round differently: each returned row is off by
    `delta` (a large delta flips argmaxes, as llama.cpp's did), and with `kv=True` only the cache
    rows they write are off, so the returned rows match and the next forward does not."""

    def __init__(self, *args, from_width: int = 2, delta: float = 1e-4, kv: bool = False, **kw) -> None:
        super().__init__(*args, **kw)
        self.from_width, self.delta, self.kv = from_width, delta, kv
        self.widths: list[int] = []
        self._off: set[int] = set()  # positions written by a wide forward (kv=True)

    def forward(self, token_ids, n_logits=1):
        self.widths.append(len(token_ids))
        start = self.n_past
        out = super().forward(token_ids, n_logits)
        wide = len(token_ids) >= self.from_width
        if wide and self.kv:
            self._off |= set(range(start, self.n_past))
            return out
        if wide or any(p < self.n_past - len(token_ids) for p in self._off):
            out = out + np.float32(self.delta) * (np.arange(out.shape[-1]) % 3 == 0)
        return out

    def trim(self, n_past):
        super().trim(n_past)
        self._off = {p for p in self._off if p < n_past}


def test_a_batch_invariant_runtime_is_exact_at_every_width():
    verdict = probe(ToyRuntime(vocab=40), 9)
    assert verdict.exact == tuple(range(2, 10)) and verdict.exact_width == 9 and verdict.fully_exact
    assert verdict.worst_diff == 0.0 and verdict.probe_ms > 0
    assert verdict.describe() == "exact verify widths on this machine: 2-9"


def test_the_probe_finds_where_widths_stop_being_exact():
    verdict = probe(WideRounding(vocab=40, from_width=5, delta=3e-4), 8)
    assert verdict.exact == (2, 3, 4) and verdict.exact_width == 4 and not verdict.fully_exact
    assert verdict.worst_diff == pytest.approx(3e-4, rel=1e-2)
    assert verdict.describe().startswith("exact verify widths on this machine: 2-4 (not 5+")


def test_the_probe_reads_the_cache_rows_a_wide_forward_wrote():
    """Rows returned right, K/V written wrong: only the forward after the verify shows it."""
    verdict = probe(WideRounding(vocab=40, from_width=3, kv=True), 6)
    assert verdict.exact == (2,) and verdict.exact_width == 2


class KeySplitRounding(ToyRuntime):
    """A toy whose wide forwards round apart only when their keys go past `keys` (onnxruntime's
    SGEMM summed Gemma 3's 256-deep scores in one pass up to 128 keys, in halves beyond): a row
    computed beside more keys than `keys` while its own position is within them."""

    def __init__(self, *args, keys: int = 128, **kw) -> None:
        super().__init__(*args, **kw)
        self.keys = keys

    def forward(self, token_ids, n_logits=1):
        start = self.n_past
        out = super().forward(token_ids, n_logits)
        if len(token_ids) > 1 and start < self.keys < self.n_past:
            out = out + np.float32(1e-6) * (np.arange(out.shape[-1]) % 2 == 0)
        return out


def test_the_probe_looks_where_long_contexts_change_a_kernels_split():
    """The short prefixes alone would call this runtime exact at every width; a verify at 128 keys
    then parts from plain decoding mid-answer, as onnxruntime's did on Gemma 3 (round 14)."""
    assert probe(KeySplitRounding(vocab=40), 8, starts=(5, 14)).fully_exact
    verdict = probe(KeySplitRounding(vocab=40), 8)
    assert verdict.exact == (2, 3, 4) and verdict.exact_width == 4  # 124 + 5 keys cross 128
    assert probe(KeySplitRounding(vocab=40, keys=64), 8).exact_width == 4  # from 60


@pytest.mark.parametrize("body", [WideRounding(vocab=40, from_width=3), KeySplitRounding(vocab=40)],
                         ids=["wide", "key-split"])
def test_the_probe_sees_a_shared_bodys_wide_forwards(body):
    """A shared body keeps rows by token ids: the probe must make it run each wide forward, not
    hand back the reference rows it already holds (which would call every width exact)."""
    from edgespec.runtimes.shared_body import shared_pair
    from tests.test_shared_body import MatrixHead

    target, _ = shared_pair(body, MatrixHead(np.eye(40)), MatrixHead(np.eye(40)[:, :30]))
    expected = probe(body, 8).exact_width
    assert expected < 8 and probe(target, 8).exact_width == expected and target.n_past == 0


def test_no_exact_width_is_said_plainly():
    verdict = probe(WideRounding(vocab=40, from_width=2), 5)
    assert verdict.exact == () and verdict.exact_width == 1
    assert verdict.describe().startswith("not exact on this machine")
    assert Exactness.from_dict(verdict.to_dict()) == verdict  # the cache round-trips it


def test_the_probe_leaves_the_cache_empty_and_fits_a_small_capacity():
    rt = ToyRuntime(vocab=40)
    rt.kv_capacity = 12
    verdict = probe(rt, 16)
    assert rt.n_past == 0 and verdict.max_width == 10  # capacity 12 leaves room for widths 2..10


def test_a_verdict_is_cached_per_runtime_options_and_retune_probes_again(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    model = tmp_path / "model.bin"
    model.write_bytes(b"weights")
    rt = ToyRuntime(vocab=40)
    kw = dict(backend="toy", version="1", model_files=[model], options={"threads": 2})
    first = probe_cached(rt, 6, **kw)
    calls = rt.calls
    again = probe_cached(rt, 6, **kw)
    assert rt.calls == calls and again.cached and not first.cached and again.exact == first.exact
    probe_cached(rt, 6, **{**kw, "options": {"threads": 1}})  # other kernels: probed anew
    assert rt.calls > calls
    calls = rt.calls
    assert not probe_cached(rt, 6, **kw, retune=True).cached and rt.calls > calls
    model.write_bytes(b"re-exported")  # a new model file: probed anew
    calls = rt.calls
    assert not probe_cached(rt, 6, **kw).cached and rt.calls > calls


def test_the_machine_fingerprint_names_the_cpu_architecture():
    import platform

    assert exactness.machine_fingerprint().startswith(platform.machine())


def test_the_machine_fingerprint_names_the_usable_cpus(monkeypatch):
    """Kernels split their sums by thread count: a verdict from another CPU set is not this one's."""
    import os

    here = exactness.machine_fingerprint()
    assert f"cpus={','.join(map(str, sorted(os.sched_getaffinity(0))))}" in here
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert exactness.machine_fingerprint() != here or sorted(os.sched_getaffinity(0)) == [0]


def _cached_entry(tmp_path, monkeypatch):
    """A toy runtime's verdict cached for real; (runtime, probe kwargs, the cache file)."""
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    model = tmp_path / "model.bin"
    model.write_bytes(b"weights")
    rt = ToyRuntime(vocab=40)
    kw = dict(backend="toy", version="1", model_files=[model], options={"threads": 2})
    probe_cached(rt, 6, **kw)
    (path,) = (tmp_path / "exactness").glob("*.json")
    return rt, kw, path


@pytest.mark.parametrize("poison", [
    pytest.param(lambda d: d["verdict"].update(exact=list(range(2, 34)), max_width=33), id="claims-every-width"),
    pytest.param(lambda d: d["verdict"].update(max_width=1e400), id="max-width-infinite"),
    pytest.param(lambda d: d["verdict"].update(worst_diff="nan"), id="worst-diff-text"),
    pytest.param(lambda d: d["key"].update(machine="another CPU|cpus=0,1,2,3"), id="another-machine"),
    pytest.param(lambda d: d.update(bogus=1), id="unknown-field"),
    pytest.param(lambda d: d.clear(), id="empty"),
])
def test_a_poisoned_or_foreign_verdict_is_probed_again(tmp_path, monkeypatch, caplog, poison):
    import json

    rt, kw, path = _cached_entry(tmp_path, monkeypatch)
    data = json.loads(path.read_text())
    poison(data)
    if "checksum" in data and "verdict" in data:  # also a forger who recomputes the checksum
        data["checksum"] = exactness._checksum({"verdict": data["verdict"], "key": data["key"]})
    path.write_text(json.dumps(data))
    calls = rt.calls
    with caplog.at_level("WARNING"):
        verdict = probe_cached(rt, 6, **kw)
    assert not verdict.cached and rt.calls > calls and verdict.max_width == 6
    assert "discarding the cached exactness verdict" in caplog.text
    assert probe_cached(rt, 6, **kw).cached  # the re-probe replaced the entry


def test_an_edited_verdict_fails_its_checksum(tmp_path, monkeypatch, caplog):
    import json

    rt, kw, path = _cached_entry(tmp_path, monkeypatch)
    data = json.loads(path.read_text())
    data["verdict"]["exact"] = data["verdict"]["exact"][:1]  # a narrower claim, still well formed
    data["verdict"]["exact_width"] = 2
    path.write_text(json.dumps(data))
    with caplog.at_level("WARNING"):
        assert not probe_cached(rt, 6, **kw).cached
    assert "checksum does not match" in caplog.text


def test_a_remembered_mode_the_backend_lacks_is_settled_again(tmp_path, monkeypatch, caplog):
    import json

    from edgespec.runtimes import exact_mode_memory

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    model = tmp_path / "model.onnx"
    model.write_bytes(b"weights")
    recall, remember = exact_mode_memory("onnxruntime", [model], {"threads": 1})
    assert recall() is None
    remember({"pad_rows": True})
    assert recall() == {"pad_rows": True}
    (path,) = (tmp_path / "exactness").glob("*.json")
    for bogus in ({"bogus": 1}, {"pad_rows": [1]}, [1, 2], "x"):
        path.write_text(json.dumps(bogus))
        with caplog.at_level("WARNING"):
            assert recall() is None
    assert "discarding" in caplog.text


# -- the decoder keeps to the exact widths ---------------------------------------------------

def _greedy(decoder: SpeculativeDecoder, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in decoder.stream(tokens, SamplingParams(), n):
        pass
    return tokens[len(prompt):]


def test_verifies_stay_within_the_exact_widths_and_output_equals_plain():
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = naive_greedy(ToyRuntime(vocab=40), prompt, 40)
    # wide forwards flip argmaxes: unbounded, speculative output leaves plain's
    loose = WideRounding(vocab=40, from_width=4, delta=50.0)
    assert _greedy(SpeculativeDecoder(loose, ToyRuntime(vocab=40), drafter="model"), prompt, 40) != plain
    capped = WideRounding(vocab=40, from_width=4, delta=50.0)
    draft = ToyRuntime(vocab=40)
    dec = SpeculativeDecoder(capped, draft, drafter="model", limits=DecoderLimits(verify_width=3))
    assert _greedy(dec, prompt, 40) == plain
    verifies = capped.widths[1:]  # after the prefill
    assert max(verifies) == 3  # the default k=4 would verify 5 at a time


def test_a_draft_on_the_target_body_keeps_its_lookahead_within_the_width():
    from edgespec.decoding.drafters import ModelDrafter

    draft = WideRounding(vocab=40, from_width=99)  # records widths only
    drafter = ModelDrafter(draft, 40, guess=lambda tokens, drafts: [7, 8, 9, 10], max_width=3)
    drafter.propose([1, 2, 3, 4, 5], 4, type("P", (), {"next_k": lambda self, s: 4, "uses_confidence": False})(),
                    SamplingParams(), np.random.default_rng(0))
    assert max(draft.widths[1:]) <= 3


def test_widths_are_checked():
    with pytest.raises(ConfigError, match="verify_width"):
        DecoderLimits(verify_width=0)
    for name, least in (("context_limit", 2), ("max_draft", 0), ("draft_width", 1), ("max_batch", 2)):
        with pytest.raises(ConfigError, match=f"{name} must be an integer >= {least}"):
            DecoderLimits(**{name: least - 1})
        with pytest.raises(ConfigError, match=name):
            DecoderLimits(**{name: True})  # a bool is no width
        assert getattr(DecoderLimits(**{name: least}), name) == least
    with pytest.raises(ConfigError, match="limits must be a DecoderLimits"):
        SpeculativeDecoder(ToyRuntime(), ToyRuntime(), limits={"verify_width": 3})


# -- the engine: probed at load, refused under require_exact -----------------------------------

def _wide_forwards_round_off(monkeypatch):
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    forward = OnnxRuntime.forward

    def rounded(self, token_ids, n_logits=1):
        out = forward(self, token_ids, n_logits)
        return out + np.float32(1e-3) if len(token_ids) > 1 else out

    monkeypatch.setattr(OnnxRuntime, "forward", rounded)


def test_the_engine_probes_the_target_and_caps_its_verifies(zoo):
    with load(zoo.bundle("llama", AGREEING), k=3, policy="cost", drafter="model") as e:
        verdict = e.exactness
        assert verdict is not None and verdict.max_width == 13  # 4k+1: adaptive drafts plus lookup tails
        assert e.decoder.limits.verify_width == (verdict.exact_width if verdict.exact_width >= 2 else None)
    with load(zoo.bundle("llama", AGREEING), k=3, policy="cost", drafter="model") as e:
        assert e.exactness.cached and e.exactness.exact == verdict.exact
    with load(zoo.bundle("llama", AGREEING), k=3, policy="fixed", drafter="model") as e:
        assert e.exactness.max_width == 4  # a fixed k verifies k+1 at most
    with load(zoo.bundle("llama", AGREEING), use_draft=False) as e:
        assert e.exactness is None  # plain decoding verifies nothing


def test_no_exact_width_means_no_drafting_under_require_exact(zoo, monkeypatch, caplog):
    _wide_forwards_round_off(monkeypatch)
    bundle = zoo.bundle("llama", AGREEING)
    with caplog.at_level(logging.WARNING), load(bundle, k=3, drafter="model", require_exact=True, retune=True) as e:
        assert e.exactness.exact == () and e.drafter_name is None and e.draft is None
        e.generate(PROMPTS[0], max_tokens=12)
        assert e.last_stats.drafted == 0 and e.last_stats.new_tokens == 12
    assert "drafting is off (require_exact)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING), load(bundle, k=3, drafter="model") as e:
        assert e.exactness.cached and e.drafter_name == "model" and e.decoder.limits.verify_width is None
        e.generate(PROMPTS[0], max_tokens=12)
        assert e.last_stats.drafted > 0  # drafting still runs, with a warning
    assert "may differ from plain decoding" in caplog.text


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
        assert e.target.capabilities.extra["pad_rows"] == (e.exactness.exact_width > 1)
        spec = e.generate(PROMPTS[1], max_tokens=16)
        assert e.last_stats.drafted > 0 or e.exactness.exact_width < 2
    with load(bundle, use_draft=False) as plain:
        assert plain.generate(PROMPTS[1], max_tokens=16) == spec
    opened = []
    init = OnnxRuntime.__init__

    def counting(self, *args, **kw):
        opened.append(kw.get("pad_rows", False))
        init(self, *args, **kw)

    monkeypatch.setattr(OnnxRuntime, "__init__", counting)
    with load(bundle, k=3, drafter="model") as e:  # the mode settled on is remembered: opened directly
        assert e.exactness.cached and opened[0] == e.target.capabilities.extra["pad_rows"]
        assert len(opened) == 2  # the target once, and the draft
