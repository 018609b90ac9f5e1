"""Window-only attention on sliding layers (GraphOptions.window_keys; the runtime binds those layers'
pasts from an aligned start, runtimes/onnxruntime/kv.window_start): a sliding layer of the append
graph reads only the keys its window can see. Its logits equal the whole-context graph's, and a
verify of several rows rounds bit for bit like the same positions decoded one at a time, across the
window's edge and the aligned start's steps."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.cpus import usable_cpu_count
from edgespec.errors import BundleError
from edgespec.exporters.onnx.graph import GraphOptions, build_decoder
from edgespec.exporters.onnx.masks import window_align
from edgespec.runtimes.onnxruntime.kv import FixedBufferKV, KVWindow, plan_kv, sliding_kv_of, window_start

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

WINDOW = 200  # wider than a 128-deep slice of P @ V, so a window's real keys span several slices
ALIGN = 256  # window_align(256): Gemma 3's head size


def _gemma3(window: int = WINDOW, head_dim: int = 256):
    """A 3-layer random Gemma 3 (sliding, sliding, full) with Gemma 3's head size and one KV head."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=head_dim, sliding_window=window,
                           query_pre_attn_scalar=head_dim, max_position_embeddings=2048,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.2)
    return model


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """{windowed: path} of the tiny Gemma 3's append graph with and without window-only keys."""
    from edgespec.exporters.spec import spec_from_hf

    model = _gemma3()
    spec, weights = spec_from_hf(model), {k: v.detach().numpy() for k, v in model.state_dict().items()}
    out = {}
    for windowed in (False, True):
        path = tmp_path_factory.mktemp("window") / f"model_{int(windowed)}.onnx"
        onnx.save_model(build_decoder(spec, weights, GraphOptions(window_keys=windowed)), str(path))
        out[windowed] = path
    return out


def _ids(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 96, n)]


def test_the_default_alignment_covers_the_heads_depth_slices():
    assert window_align(256) == ALIGN and window_align(128) == 512 and window_align(64) == 1024
    assert window_align(16) == 1024  # capped: the deepest slice MLAS takes


def test_window_keys_is_the_append_chain_graphs_default_and_refused_elsewhere():
    assert GraphOptions().windowed and not GraphOptions(window_keys=False).windowed
    assert not GraphOptions(kv_layout="buffer", fused_ops=False).windowed
    assert not GraphOptions(tree=True).windowed
    with pytest.raises(ValueError, match="window_keys"):
        GraphOptions(kv_layout="buffer", fused_ops=False, window_keys=True)
    with pytest.raises(ValueError, match="window_keys"):
        GraphOptions(tree=True, window_keys=True)
    with pytest.raises(ValueError, match="window_align"):
        GraphOptions(window_align=0)


def test_the_window_start_is_aligned_and_reaches_back_to_the_first_visible_key():
    got = [window_start(p, 200, 256) for p in (0, 199, 200, 454, 455, 456, 710, 711)]
    assert got == [0, 0, 0, 0, 256, 256, 256, 512]
    for p in range(0, 2000, 7):  # never later than the first key position p's query sees
        assert window_start(p, 200, 256) <= max(0, p - 199) < window_start(p, 200, 256) + 256


def test_the_graph_records_its_window_and_copies_no_past(graphs):
    full, windowed = (onnx.load(str(graphs[w])) for w in (False, True))
    assert [i.name for i in full.graph.input] == [i.name for i in windowed.graph.input]  # the same interface
    meta = {p.key: p.value for p in windowed.metadata_props}
    assert (meta["edgespec.window"], meta["edgespec.window_align"], meta["edgespec.window_layers"]) == (
        str(WINDOW), str(ALIGN), "0,1")  # the two sliding layers, not the full one
    assert "edgespec.window" not in {p.key for p in full.metadata_props}
    # nothing slices a past in the graph: the runtime binds the part a window sees
    readers = {n.op_type for n in windowed.graph.node if any(i.startswith("past_") for i in n.input)}
    assert readers <= {"Concat", "Shape"}, readers


def test_a_model_whose_kept_layers_all_slide_binds_every_past_whole():
    """P comes from a full-attention layer's past: a layer-cut draft of sliding layers only has none."""
    from edgespec.exporters.spec import spec_from_hf

    model = _gemma3()
    spec, weights = spec_from_hf(model), {k: v.detach().numpy() for k, v in model.state_dict().items()}
    meta = {p.key for p in build_decoder(spec, weights, GraphOptions(layers=(0, 1))).metadata_props}
    assert "edgespec.window" not in meta
    meta = {p.key: p.value for p in build_decoder(spec, weights, GraphOptions(layers=(1, 2))).metadata_props}
    assert meta["edgespec.window_layers"] == "0"


def test_plan_kv_reads_the_window_from_the_metadata():
    inputs = [("input_ids", [1, "S"]), ("n_logits", [1]), ("past_key_0", [1, "P", 1, 256])]
    meta = {"edgespec.window": "512", "edgespec.window_align": "256", "edgespec.window_layers": "0,1,3"}
    plan = plan_kv(inputs, ["logits", "new_key_0"], meta=meta)
    assert plan.kind is FixedBufferKV and plan.window == KVWindow(512, 256, frozenset({0, 1, 3}))
    assert plan_kv(inputs, ["logits", "new_key_0"]).window is None  # no record: every past bound whole
    with pytest.raises(BundleError, match="sliding window"):
        plan_kv(inputs, ["logits", "new_key_0"], meta={**meta, "edgespec.window_layers": "a"})


def test_windowed_logits_equal_the_whole_context_graphs_past_the_window(graphs):
    """A prefill, then verifies and decodes at positions where the window has moved past several
    aligned starts: the same logits as the graph that masks the whole context."""
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    ids = _ids(900)
    logits = {}
    for windowed, path in graphs.items():
        with OnnxRuntime(path, kv_capacity=1024, threads=1) as rt:
            out = [rt.forward(ids[:300], n_logits=4).copy()]
            for start in range(300, 860, 40):  # a 5-row verify, a rollback of 3, then one decode
                out.append(rt.forward(ids[start:start + 5], n_logits=5).copy())
                rt.trim(start + 2)
                out.append(rt.forward([ids[start + 2]]).copy())
                rt.trim(start + 40)
                rt.forward(ids[start + 3:start + 40], n_logits=1)
            logits[windowed] = out
    for i, (a, b) in enumerate(zip(logits[True], logits[False])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"forward {i}")


def test_the_runtime_binds_sliding_pasts_from_the_aligned_start_as_views_of_the_cache(graphs):
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    with OnnxRuntime(graphs[True], kv_capacity=1024, threads=1) as rt:
        rt.forward(_ids(600), n_logits=1)
        bound, b = {}, rt.kv._binding
        real = b.bind_input
        b.bind_input = lambda name, dev, et, shape, ptr: (bound.__setitem__(name, (list(shape), ptr)),  # noqa: E731
                                                          real(name, dev, et, shape, ptr))
        rt.forward([5])
        row = 256 * 4  # one KV head of 256 floats a position
        start = window_start(600, WINDOW, ALIGN)
        assert start == 256
        bufs = rt.kv.buffers()  # K, V of layer 0, then layer 1, then layer 2
        for j, name in enumerate(("past_key_0", "past_value_0", "past_key_1", "past_value_1")):
            assert bound[name] == ([1, 600 - start, 1, 256], bufs[j].ctypes.data + start * row), name
        assert bound["past_key_2"] == ([1, 600, 1, 256], bufs[4].ctypes.data)  # the full layer: whole


def _drive(rt, ids: list[int]) -> list[np.ndarray]:
    """A 1000-token prefill (run in pieces), then 5-row verifies with rollbacks of 3 and decodes
    past several moves of a window-sized buffer's live rows: the logits of every forward."""
    out = [rt.forward(ids[:1000], n_logits=4).copy()]
    for start in range(1000, 1700, 23):
        out.append(rt.forward(ids[start:start + 5], n_logits=5).copy())
        rt.trim(start + 2)
        out.append(rt.forward([ids[start + 2]]).copy())
        rt.forward(ids[start + 3:start + 23], n_logits=1)
    return out


def test_window_sized_buffers_compute_the_whole_buffers_logits_bit_for_bit(graphs, monkeypatch):
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    ids = _ids(1800, seed=5)
    with OnnxRuntime(graphs[True], kv_capacity=2048, threads=1) as rt:
        rows = rt.kv.plan.sliding_rows
        assert rows == 64 + WINDOW + ALIGN + 256 and rt.kv_sliding == (2 / 3, rows)
        assert [len(b) for b in rt.kv_buffers()] == [rows] * 4 + [2048] * 2
        assert sliding_kv_of(graphs[True]) == rt.kv_sliding and sliding_kv_of(graphs[False]) == (0.0, 0)
        small = _drive(rt, ids)
        assert rt.kv._base > 1000  # the live rows moved to the front several times
    monkeypatch.setattr(KVWindow, "rows", lambda self, pad: 10**6)  # whole buffers for every layer
    with OnnxRuntime(graphs[True], kv_capacity=2048, threads=1) as whole:
        assert whole.kv.plan.sliding_rows is None and whole.kv_sliding == (0.0, 0)
        ref = _drive(whole, ids)
    assert len(small) == len(ref)
    for i, (a, b) in enumerate(zip(small, ref)):
        assert np.array_equal(a, b), f"forward {i}"


def test_a_rollback_past_the_window_is_fed_again_and_gives_a_fresh_runs_logits(graphs):
    """TrackedCache learns from n_past that the runtime kept nothing and feeds the prefix again."""
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    ids = _ids(1400, seed=6)
    with OnnxRuntime(graphs[True], kv_capacity=2048, threads=1) as rt, \
            OnnxRuntime(graphs[True], kv_capacity=2048, threads=1) as fresh:
        got, want = _rollbacks_against_a_fresh_run(rt, fresh, ids, check=lambda when: None)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # decode vs prefill rows: close, not equal


def _rollbacks_against_a_fresh_run(rt, fresh, ids: list[int], check) -> tuple[np.ndarray, np.ndarray]:
    """Through a TrackedCache on `rt`: a rollback far past the window (to the first 300 positions)
    leaves n_past 0 and is fed again, equal to `fresh`'s run; then a short rollback near the end of
    `ids` stays without feeding again. Returns (rt's, fresh's) logits after the short one, for the
    caller's own tolerance; `check(when)` looks at the runtime once `ids` are fed ("fed") and
    after the far rollback ("far")."""
    from edgespec.decoding.cache import TrackedCache

    cache = TrackedCache(rt, max_batch=128)
    cache.feed(ids, n_logits=1)
    check("fed")
    cache.align(ids[:301])  # a later request sharing only the first 300 positions
    assert rt.n_past == 0 and cache.ids == [] and cache.pending(ids[:301]) == ids[:301]
    check("far")
    got = np.array(cache.feed(cache.pending(ids[:301]), n_logits=3))
    want = TrackedCache(fresh, max_batch=128).feed(ids[:301], n_logits=3)
    assert np.array_equal(got, want) and rt.n_past == 301
    cache.feed(ids[301:], n_logits=1)
    n = len(ids) - 10
    cache.align(ids[:n])  # a short rollback stays exact without feeding again
    assert rt.n_past == n - 1
    got = np.array(cache.feed(cache.pending(ids[:n]), n_logits=1))
    fresh.reset()
    return got, np.array(TrackedCache(fresh, max_batch=128).feed(ids[:n], n_logits=1))


def _verify_matches_decodes(rt, ids: list[int], prefix: int, widths) -> list[tuple]:
    """(prefix, width, row) where a verify of `width` rows after `prefix` positions differs in any
    bit from the same positions decoded one at a time, or a decode after the verify differs."""
    rt.trim(0)
    rt.forward(ids[:prefix], n_logits=1)
    ref = [rt.forward([t]).copy() for t in ids[prefix:prefix + max(widths) + 1]]
    bad = []
    for w in widths:
        rt.trim(prefix)
        got = rt.forward(ids[prefix:prefix + w], n_logits=w).copy()
        bad += [(prefix, w, r) for r in range(w) if not np.array_equal(got[r], ref[r][0])]
        if not np.array_equal(rt.forward([ids[prefix + w]]), ref[w]):  # the K/V rows the verify wrote
            bad.append((prefix, w, "next"))
    return bad


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_verifies_round_like_one_token_decodes_across_the_window_edge_and_aligned_starts(graphs, threads):
    """Prefixes where a verify's first row needs keys from an earlier aligned block than its last
    rows (P - WINDOW + 1 just below a multiple of ALIGN), where the window first leaves position 0,
    and past the 128- and 256-key depth slices."""
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    ids = _ids(800, seed=threads)
    edges = [WINDOW - 3, WINDOW - 1, ALIGN + WINDOW - 4, ALIGN + WINDOW - 2, 2 * ALIGN + WINDOW - 5, 2 * ALIGN + 60]
    with OnnxRuntime(graphs[True], kv_capacity=1024, threads=threads) as rt:
        assert rt.kv.plan.window == KVWindow(WINDOW, ALIGN, frozenset({0, 1}))
        bad = [b for p in edges for b in _verify_matches_decodes(rt, ids, p, (2, 3, 5, 9))]
    assert not bad, bad


@pytest.mark.slow
def test_the_default_targets_verifies_round_like_decodes_across_its_window_edge(default_cache):
    """The real Gemma 3 270M (window 512): prefixes where the window first leaves position 0 and
    where a verify's rows start their windows in two aligned blocks, at the thread count in use."""
    from edgespec.engine.engine import default_bundle
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    ids = [int(t) for t in np.random.default_rng(0).integers(1000, 200000, 1400)]
    with OnnxRuntime(default_bundle() / "target" / "model.onnx", kv_capacity=1500, threads=usable_cpu_count()) as rt:
        win = rt.kv.plan.window
        assert win is not None and len(win.layers) == 15
        edges = [win.size - 3, win.size + win.align - 3, win.size + win.align - 2, win.size + 3 * win.align - 3]
        bad = [b for p in edges for b in _verify_matches_decodes(rt, ids, p, (2, 5, 9))]
    assert not bad, bad
