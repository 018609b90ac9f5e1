"""Window-only attention on OpenVINO's sliding layers (openvino/graph.window_keys, bound by
openvino/kv.DynamicBufferKV from an aligned start): a sliding layer of the buffer-layout IR reads
only the keys its window can see. Its logits equal the whole-context IR's to f32 rounding, a verify
of several rows rounds bit for bit like the same positions decoded one at a time across the window
edge and the aligned start's steps, and a rollback after a rejected draft restores exactly."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("openvino", reason="the OpenVINO backend needs openvino (pip install 'edgespec[openvino]')")
pytest.importorskip("onnx")

from edgespec.errors import BackendError, ContextFullError  # noqa: E402
from edgespec.exporters.openvino.export import convert_graph, set_window_info, window_info  # noqa: E402
from edgespec.runtimes.openvino.kv import KVWindow, StaticKV, window_of, window_pieces  # noqa: E402
from edgespec.runtimes.openvino.runtime import OpenVinoRuntime  # noqa: E402
from tests.test_window_attention import _gemma3, _ids, _rollbacks_against_a_fresh_run, _verify_matches_decodes  # noqa: E402

WINDOW = 200  # as tests/test_window_attention.py: wider than one 64-key block of the padded attention
ALIGN = 256  # masks.window_align(256): Gemma 3's head size
# where a verify's first row needs keys from an earlier aligned block than its last rows, where the
# window first leaves position 0, and past several aligned starts
EDGES = [WINDOW - 3, WINDOW - 1, ALIGN + WINDOW - 4, ALIGN + WINDOW - 2, 2 * ALIGN + WINDOW - 5, 2 * ALIGN + 60]
WIDTHS = (2, 3, 5, 9)
GEMMA_WINDOW = 512
# the same points for a window of 512 (Gemma 3 270M's): its window edge and two moves of its start
# (not where a verify's keys cross 1024 columns: test_a_verify_over_1024_keys_rounds_apart_in_both_modes)
GEMMA_EDGES = [GEMMA_WINDOW - 3, GEMMA_WINDOW + ALIGN - 3, GEMMA_WINDOW + ALIGN - 2, GEMMA_WINDOW + 3 * ALIGN - 3,
               GEMMA_WINDOW + 3 * ALIGN - 2]


def _build(folder, window: int, windowed: bool):
    import openvino as ov

    from edgespec.exporters.onnx.graph import GraphOptions
    from edgespec.exporters.spec import spec_from_hf

    model = _gemma3(window)
    spec, weights = spec_from_hf(model), {k: v.detach().numpy() for k, v in model.state_dict().items()}
    ir = convert_graph(spec, weights, GraphOptions(kv_layout="buffer", fused_ops=False), folder)
    ir.set_rt_info("f32", ["runtime_options", "INFERENCE_PRECISION_HINT"])
    if windowed:
        set_window_info(ir, window_info(spec, None))
    ov.save_model(ir, str(folder / "model.xml"))
    return folder / "model.xml"


@pytest.fixture(scope="module")
def irs(tmp_path_factory):
    """{windowed: path}: the tiny Gemma 3 (sliding, sliding, full) as one OpenVINO IR saved with
    its window record and once without (an IR as written before the record: every past whole)."""
    return {w: _build(tmp_path_factory.mktemp("ov_window"), WINDOW, w) for w in (False, True)}


@pytest.fixture(scope="module")
def wide_window_ir(tmp_path_factory):
    """The same model with Gemma 3's window of 512: a sliding layer's keys span more than one of
    the CPU MatMul's blocks, where a moved start rounds rows apart unless the forward is cut."""
    return _build(tmp_path_factory.mktemp("ov_window512"), GEMMA_WINDOW, True)


def _read(path):
    import openvino as ov

    return ov.Core().read_model(str(path))


def test_the_export_records_the_sliding_layers_and_the_runtime_reads_them(irs):
    from edgespec.exporters.spec import spec_from_hf

    spec = spec_from_hf(_gemma3())
    assert window_info(spec, None) == {"window": str(WINDOW), "window_align": str(ALIGN), "window_layers": "0,1"}
    assert window_info(spec, (1, 2)) == {"window": str(WINDOW), "window_align": str(ALIGN), "window_layers": "0"}
    assert window_info(spec, (0, 1)) == {}  # no full layer kept: nothing says where the context ends
    assert window_info(spec, None, align=64)["window_align"] == "64"
    assert window_of(_read(irs[True])) == KVWindow(WINDOW, ALIGN, frozenset({0, 1}))
    assert window_of(_read(irs[False])) is None
    with OpenVinoRuntime(irs[True], kv_capacity=64, threads=1) as rt:
        assert rt.kv.plan.window == KVWindow(WINDOW, ALIGN, frozenset({0, 1}))
        assert rt.capabilities.extra["window"] == WINDOW
    with OpenVinoRuntime(irs[False], kv_capacity=64, threads=1) as rt:
        assert rt.kv.plan.window is None and rt.capabilities.extra["window"] is None


def test_a_damaged_window_record_is_a_one_line_error(irs):
    model = _read(irs[True])
    model.set_rt_info("0,x", ["edgespec", "window_layers"])
    with pytest.raises(BackendError, match="sliding window record is not valid") as e:
        window_of(model)
    assert "\n" not in str(e.value)


def _drive(rt, ids: list[int]) -> list[np.ndarray]:
    """A prefill inside the first window, then 5-row verifies, rollbacks of 3 and decodes while the
    window moves past several aligned starts: every forward's logits."""
    out = [rt.forward(ids[:300], n_logits=4).copy()]
    for start in range(300, 860, 40):
        out.append(rt.forward(ids[start:start + 5], n_logits=5).copy())
        rt.trim(start + 2)
        out.append(rt.forward([ids[start + 2]]).copy())
        rt.trim(start + 40)
        out.append(rt.forward(ids[start + 3:start + 40], n_logits=2).copy())
    return out


def test_windowed_logits_equal_the_whole_context_irs_across_the_window_edge(irs):
    """Tolerance 1e-5, f32 rounding (docs/long-context.md has what it measured): leaving the
    masked leading keys out changes how many columns the Softmax and the probabilities @ V sum,
    so f32 rounds them in another order; the masked columns themselves add exact zeros."""
    ids = _ids(900)
    logits = {}
    for windowed, path in irs.items():
        with OpenVinoRuntime(path, kv_capacity=1024, threads=1) as rt:
            logits[windowed] = _drive(rt, ids)
    assert len(logits[True]) == len(logits[False]) == 43
    for i, (a, b) in enumerate(zip(logits[True], logits[False])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"forward {i}")
    # inside the first aligned block nothing is cut: the same IR, the same bits
    assert np.array_equal(logits[True][0], logits[False][0])


def test_sliding_pasts_are_bound_from_the_aligned_start_as_views_of_the_buffers(irs):
    with OpenVinoRuntime(irs[True], kv_capacity=1024, threads=1) as rt:
        rt.forward(_ids(600), n_logits=1)
        feed = rt.kv.feed([5], 1)
        start = rt.kv.plan.window.start(600)
        assert start == 256
        row = 256 * 4  # one KV head of 256 floats a position
        bufs = rt.kv._buf  # K, V of layer 0, then layer 1, then layer 2
        for j, name in enumerate(("past_key_0", "past_value_0", "past_key_1", "past_value_1")):
            view, shape = feed[name]
            assert shape == (1, 1, 600 - start, 256) and view.ctypes.data == bufs[j].ctypes.data + start * row, name
        view, shape = feed["past_key_2"]  # the full layer: whole
        assert shape == (1, 1, 600, 256) and view is bufs[4]
        again = rt.kv.feed([5], 1)  # the same start: the same view objects (their Tensors are only reshaped)
        assert again["past_key_0"][0] is feed["past_key_0"][0]


@pytest.mark.parametrize("threads,wide", [(1, False), (2, False), (2, True)])
def test_verifies_round_like_one_token_decodes_across_the_window_edge(irs, wide_window_ir, threads, wide):
    ids = _ids(1400, seed=threads)
    bad = []
    for path, edges in ((irs[True], EDGES), (wide_window_ir, GEMMA_EDGES)):
        with OpenVinoRuntime(path, kv_capacity=1500, threads=threads, wide=wide) as rt:
            bad += [b for p in edges for b in _verify_matches_decodes(rt, ids, p, WIDTHS)]
    assert not bad, bad


def test_a_verify_over_1024_keys_rounds_apart_in_both_modes(wide_window_ir, monkeypatch):
    """What OpenVINO gives where a verify's padded keys pass 1024 columns and its rows' decodes do
    not (the full-attention layer's whole cache): some rows round apart over the whole cache, as
    before, and the windowed IR differs in no row where the whole-context one agrees."""
    import edgespec.runtimes.openvino.runtime as ov_runtime

    ids, edges = _ids(1100, seed=2), [1019, 1020, 1021]
    bad = {}
    for windowed in (True, False):
        if not windowed:
            monkeypatch.setattr(ov_runtime, "window_of", lambda model: None)
        with OpenVinoRuntime(wide_window_ir, kv_capacity=1100, threads=2) as rt:
            assert (rt.kv.plan.window is not None) == windowed
            bad[windowed] = {b for p in edges for b in _verify_matches_decodes(rt, ids, p, WIDTHS)}
    assert bad[False] and bad[True] <= bad[False], bad


def test_the_window_pieces_cut_wherever_the_start_moves():
    win = KVWindow(GEMMA_WINDOW, ALIGN, frozenset({0}))
    assert window_pieces(765, 5, win) == [2, 3]  # 767 starts its window at 256, 766 at 0
    assert window_pieces(767, 9, win) == [9] and window_pieces(0, 1, win) == [1]
    assert window_pieces(0, 2000, win) == [767, 256, 256, 256, 256, 209]
    rng = np.random.default_rng(0)
    for p, n in zip(rng.integers(0, 3000, 300), rng.integers(1, 600, 300)):
        sizes, first = window_pieces(int(p), int(n), win), int(p)
        assert sum(sizes) == n and min(sizes) > 0
        for size in sizes:  # one start per piece, and another in the next
            assert len({win.start(q) for q in range(first, first + size)}) == 1
            assert first + size == p + n or win.start(first + size) != win.start(first)
            first += size


def test_without_the_cut_a_verify_straddling_a_moved_start_rounds_apart(wide_window_ir, monkeypatch):
    """The check above can fail: a verify whose later rows would start their windows an aligned
    block later, run as one forward from the earlier start, rounds those rows unlike their decodes."""
    ids = _ids(1400, seed=2)
    with OpenVinoRuntime(wide_window_ir, kv_capacity=1500, threads=2) as rt:
        monkeypatch.setattr(type(rt.kv), "pieces", lambda self, n: [n])
        bad = [b for p in GEMMA_EDGES[1:3] for b in _verify_matches_decodes(rt, ids, p, WIDTHS)]
    assert bad


def test_a_forward_cut_in_pieces_returns_its_rows_as_the_pieces_do(wide_window_ir):
    ids = _ids(1500, seed=4)
    with OpenVinoRuntime(wide_window_ir, kv_capacity=1400, threads=1) as whole, \
            OpenVinoRuntime(wide_window_ir, kv_capacity=1400, threads=1) as by_hand:
        got = whole.forward(ids[:1100], n_logits=400)
        sizes = window_pieces(0, 1100, whole.kv.plan.window)
        assert sizes == [767, 256, 77]
        want, start = [], 0
        for size in sizes:
            want.append(by_hand.forward(ids[start:start + size], n_logits=size).copy())
            start += size
        assert got.shape == (400, 96) and np.array_equal(got, np.concatenate(want)[-400:])
        with pytest.raises(ContextFullError):  # past the capacity: refused before any piece runs
            whole.forward(ids[1100:1450], n_logits=1)  # two pieces, the second past it
        assert whole.n_past == 1100


def test_a_rollback_after_a_rejected_draft_restores_exactly(wide_window_ir):
    """A 9-token draft whose later rows move the aligned start (at GEMMA_WINDOW + ALIGN - 1),
    rejected after 2: the decodes that follow, across the move, equal a run that verified only
    those 2, bit for bit."""
    ids, draft = _ids(800, seed=7), _ids(9, seed=8)
    P = GEMMA_WINDOW + ALIGN - 5
    runs = []
    for rejected in (True, False):
        with OpenVinoRuntime(wide_window_ir, kv_capacity=1024, threads=2) as rt:
            rt.forward(ids[:P], n_logits=1)
            _two_kept(rt, P, draft, rejected)
            runs.append([rt.forward([t]).copy() for t in ids[P:P + 12]])
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


def _two_kept(rt, P: int, draft: list[int], rejected: bool) -> None:
    """Two of `draft` kept after position P: the whole draft verified and rejected after 2
    (trimmed back), or only those 2 verified."""
    if rejected:
        rt.forward(draft, n_logits=len(draft))
        rt.trim(P + 2)
    else:
        rt.forward(draft[:2], n_logits=2)
    assert rt.n_past == P + 2


def test_static_shapes_keep_every_past_whole(irs):
    """The static-shape (NPU) mode binds one fixed size for every layer: no window, the same model."""
    ids = _ids(40, seed=9)
    with OpenVinoRuntime(irs[True], kv_capacity=64, threads=1, static=True, width=4) as st, \
            OpenVinoRuntime(irs[True], kv_capacity=64, threads=1) as dyn:
        assert st.kv.plan.kind is StaticKV and st.kv.plan.window is None
        a = [st.forward(ids[i:i + 4], n_logits=4).copy() for i in range(0, 40, 4)]
        b = [dyn.forward(ids[i:i + 4], n_logits=4).copy() for i in range(0, 40, 4)]
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


# a sliding layer's buffer rows with the tiny model's window (KVWindow.rows): rollback, window, align, forward
ROWS = 64 + WINDOW + ALIGN + 256
ROW_BYTES = 256 * 4  # one KV head of 256 floats a position


def _drive_moves(rt, ids: list[int], end: int) -> list[np.ndarray]:
    """A prefill wider than WINDOW_FORWARD, then 5-row verifies, rollbacks of 3, decodes and
    20-token chunks up to `end` positions: the window-sized buffers' live rows move several times."""
    out = [rt.forward(ids[:300], n_logits=3).copy()]
    for start in range(300, end - 30, 23):
        out.append(rt.forward(ids[start:start + 5], n_logits=5).copy())
        rt.trim(start + 2)
        out.append(rt.forward([ids[start + 2]]).copy())
        out.append(rt.forward(ids[start + 3:start + 23], n_logits=2).copy())
    return out


def test_the_plan_sizes_sliding_buffers_by_the_window_where_that_is_smaller():
    from edgespec.runtimes.openvino.kv import cut_every, plan_kv

    win = KVWindow(WINDOW, ALIGN, frozenset({0, 1}))
    plan = plan_kv("CPU", "f32", capacity=4096, window=win)
    assert plan.sliding_rows == ROWS and plan.sliding_kv(3) == (2 / 3, ROWS)
    assert plan_kv("CPU", "f32", capacity=4096, window=win, pad_rows=True).sliding_rows == ROWS + 1
    small = plan_kv("CPU", "f32", capacity=ROWS, window=win)  # whole buffers are no larger
    assert small.sliding_rows is None and small.sliding_kv(3) == (0.0, 0)
    assert plan_kv("CPU", "f32", capacity=4096).sliding_rows is None  # no window record
    static = plan_kv("CPU", "f32", static=True, capacity=4096, window=win)
    assert static.window is None and static.sliding_rows is None
    assert cut_every(250, [10, 300], 256) == [6, 4, 252, 48]
    assert cut_every(0, [767, 256, 77], 256) == [256, 256, 255, 1, 255, 1, 76]


@pytest.mark.parametrize("threads", [1, 2])
def test_window_sized_buffers_compute_the_whole_buffers_logits_bit_for_bit(irs, threads, monkeypatch):
    ids = _ids(1800, seed=10 + threads)
    with OpenVinoRuntime(irs[True], kv_capacity=2048, threads=threads) as rt:
        assert rt.kv.plan.sliding_rows == ROWS and rt.kv_sliding == (2 / 3, ROWS)
        small = _drive_moves(rt, ids, 1800)
        assert [b.shape[2] for b in rt.kv._buf] == [ROWS] * 4 + [2048] * 2
        assert rt.kv._base >= 1024  # the live rows moved to the front several times
    monkeypatch.setattr(KVWindow, "rows", lambda self, pad: 10**6)  # whole buffers for every layer
    with OpenVinoRuntime(irs[True], kv_capacity=2048, threads=threads) as whole:
        assert whole.kv.plan.sliding_rows is None and whole.kv_sliding == (0.0, 0)
        ref = _drive_moves(whole, ids, 1800)
        assert [b.shape[2] for b in whole.kv._buf] == [2048] * 6
    assert len(small) == len(ref) == 1 + 3 * len(range(300, 1770, 23))
    bad = [i for i, (a, b) in enumerate(zip(small, ref)) if not np.array_equal(a, b)]
    assert not bad, bad


def test_window_sized_buffers_verify_like_decodes_after_moves(irs):
    ids = _ids(1800, seed=12)
    with OpenVinoRuntime(irs[True], kv_capacity=2048, threads=2, pad_rows=True) as rt:
        assert rt.kv.plan.sliding_rows == ROWS + 1
        # past the live rows' first moves, below 1024 keys on the full layer (where verifies round apart)
        edges = (3 * ALIGN + WINDOW - 4, 3 * ALIGN + WINDOW - 2, 1000)
        bad = [b for p in edges for b in _verify_matches_decodes(rt, ids, p, WIDTHS)]
        assert rt.kv._base > 0
    assert not bad, bad


def test_a_rollback_across_a_move_of_the_live_rows_restores_exactly(irs):
    """A 9-token draft whose verify moves the window-sized buffers' live rows to the front,
    rejected after 2: the decodes that follow equal a run that verified only those 2 (and moved
    later), bit for bit."""
    ids, draft = _ids(1200, seed=13), _ids(9, seed=14)
    runs, bases = [], []
    for rejected in (True, False):
        with OpenVinoRuntime(irs[True], kv_capacity=2048, threads=2) as rt:
            rt.forward(ids[:256], n_logits=1)
            P = 256
            while P + 9 <= rt.kv._base + ROWS:  # decode up to where a 9-row forward passes the end
                rt.forward([ids[P]])
                P += 1
            before = rt.kv._base
            _two_kept(rt, P, draft, rejected)
            bases.append((before, rt.kv._base))
            runs.append([rt.forward([t]).copy() for t in ids[P:P + 12]])
    assert bases[0][1] > bases[0][0] and bases[1][1] == bases[1][0], bases  # only the rejected draft moved
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


def test_a_trim_past_the_window_sized_buffers_is_fed_again_and_gives_a_fresh_runs_logits(irs, monkeypatch):
    """TrackedCache learns from n_past that the runtime kept nothing and feeds the prefix again;
    the fresh run holds whole buffers."""
    ids = _ids(1000, seed=15)
    with monkeypatch.context() as m:
        m.setattr(KVWindow, "rows", lambda self, pad: 10**6)
        fresh = OpenVinoRuntime(irs[True], kv_capacity=2048, threads=1)
    with OpenVinoRuntime(irs[True], kv_capacity=2048, threads=1) as rt, fresh:
        assert rt.kv.plan.sliding_rows == ROWS and fresh.kv.plan.sliding_rows is None

        def check(when):  # the live rows moved; the far rollback starts the buffers over
            assert (rt.kv._base > 0) if when == "fed" else (rt.kv._base == 0)

        got, want = _rollbacks_against_a_fresh_run(rt, fresh, ids, check)
        assert rt.kv._base > 0
    assert np.array_equal(got, want)


def test_a_sliding_layers_memory_stays_window_sized_at_a_long_context(irs):
    from edgespec.memory.footprint import ModelMemory
    from edgespec.memory.loading import _windowed, measured_memory
    from edgespec.runtimes.openvino.runtime import sliding_kv_of

    ids = _ids(3000, seed=16)
    with OpenVinoRuntime(irs[True], kv_capacity=4096, threads=1) as rt:
        rt.forward(ids, n_logits=1)
        assert rt.n_past == 3000
        sizes = [b.nbytes for b in rt.kv._buf]
        assert sizes[:4] == [ROWS * ROW_BYTES] * 4  # the sliding layers' K and V: R rows each
        assert sizes[4:] == [3000 * ROW_BYTES] * 2  # the full layer grew to hold the 3000 positions
        assert rt.memory_bytes()["kv"] == sum(sizes) == (4 * ROWS + 2 * 3000) * ROW_BYTES
        assert rt.kv_sliding == (2 / 3, ROWS) == sliding_kv_of(irs[True])  # the planner's estimate before loading
        assert sliding_kv_of(irs[False]) == (0.0, 0)
        bare = ModelMemory("target", 0, {"float32": rt.kv_bytes_per_token}, 96)
        assert _windowed(bare, irs[True], "openvino").sliding == (2 / 3, ROWS)
        mem = measured_memory("target", rt, 0)
        per = rt.kv_bytes_per_token
        assert mem.sliding == (2 / 3, ROWS)
        # the memory model counts what the runtime holds: the full layer per position, the sliding ones R rows
        assert mem.kv("float32", 3000) == rt.memory_bytes()["kv"] < per * 3000 * 0.55
