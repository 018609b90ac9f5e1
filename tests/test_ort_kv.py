"""The onnxruntime runtime's KV holders (runtimes/onnxruntime/kv.py): `plan_kv` picks one from a graph's
inputs and outputs without a model; the fixed buffers write each forward's new rows right after
the held prefix (a fake session that records positions, no onnxruntime); on a tiny model the fixed
buffers compute through rollbacks the logits a fresh runtime computes for the same prefix; a graph of
the old growing layout is refused with the fix."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from edgespec.errors import BackendError, BundleError, ContextFullError
from edgespec.runtimes.onnxruntime.kv import (
    DEFAULT_KV_CAPACITY,
    WINDOW_FORWARD,
    WINDOW_ROLLBACK,
    FixedBufferKV,
    KVLayout,
    plan_kv,
    window_start,
)


def graph(layers: int, kvh: int, hd: int, append: bool) -> tuple[list, list]:
    """(inputs, outputs) as an exported decoder graph names and shapes them."""
    past = [1, "P", kvh, hd] if append else [1, kvh, "P", hd]
    inputs = [("input_ids", [1, "S"]), ("n_logits", [1])]
    inputs += [(f"past_{kind}_{j}", past) for j in range(layers) for kind in ("key", "value")]
    new = "new" if append else "present"
    return inputs, ["logits", *(f"{new}_{kind}_{j}" for j in range(layers) for kind in ("key", "value"))]


# ---------------------------------------------------------------- the chooser, without a model


def test_the_append_layout_gets_fixed_buffers_sized_for_the_capacity():
    plan = plan_kv(*graph(3, 2, 8, append=True))
    assert plan.kind is FixedBufferKV and plan.layout == KVLayout(3, 2, 8)
    assert plan.capacity == DEFAULT_KV_CAPACITY and plan.pad == 0
    assert plan.layout.bytes_per_token == 2 * 3 * 2 * 8 * 4
    padded = plan_kv(*graph(3, 2, 8, append=True), capacity=300, pad_rows=True)
    assert (padded.capacity, padded.pad) == (300, 1)


def test_an_old_present_layout_is_refused_with_the_fix():
    """The first exporter's graphs (past/present, the cache grew by concatenation) no longer load:
    one line that names the file and the fix."""
    with pytest.raises(BundleError, match=r"^target/model\.onnx has the old growing KV layout, which edgespec no "
                                          r"longer runs: export the bundle again with `edgespec export`$"):
        plan_kv(*graph(2, 1, 16, append=False), pad_rows=True, name="target/model.onnx")
    assert FixedBufferKV.fixed and FixedBufferKV.pads


def test_a_graph_that_is_not_an_edgespec_decoder_is_a_one_line_error():
    inputs, outputs = graph(1, 1, 4, append=True)
    with pytest.raises(BackendError, match=r"^other\.onnx is not an edgespec decoder graph \(inputs: "
                                           r"n_logits, input_ids, past_key_0, past_value_0\)$"):
        plan_kv([inputs[1], inputs[0], *inputs[2:]], outputs, name="other.onnx")


# ---------------------------------------------------------------- fixed buffers on a fake session


def _view(ctype, shape, ptr) -> np.ndarray:
    return np.ctypeslib.as_array((ctype * int(np.prod(shape))).from_address(ptr)).reshape(shape)


class _Binding:
    def __init__(self) -> None:
        self.inputs: dict = {}
        self.outputs: dict = {}

    def bind_input(self, name, device, index, dtype, shape, ptr) -> None:
        self.inputs[name] = (dtype, list(shape), ptr)

    def bind_output(self, name, device, index, dtype, shape, ptr) -> None:
        self.outputs[name] = (dtype, list(shape), ptr)


class PositionSession:
    """A decoder whose new K/V rows hold their position and whose output rows hold their token."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, int]] = []  # (past rows bound, rows computed)

    def io_binding(self) -> _Binding:
        return _Binding()

    def run_with_iobinding(self, b: _Binding) -> None:
        _, (_, s), ptr = b.inputs["input_ids"]
        ids = _view(ctypes.c_int64, (s,), ptr)
        p = b.inputs["past_key_0"][1][1]
        self.runs.append((p, s))
        for name, (_, shape, ptr) in b.outputs.items():
            out = _view(ctypes.c_float, shape, ptr)
            if name.startswith("new_"):
                out[0] = (p + np.arange(s))[:, None, None]
            else:
                out[0] = ids[s - shape[1]:, None]


def fixed(capacity: int, pad_rows: bool) -> tuple[FixedBufferKV, PositionSession]:
    plan = plan_kv(*graph(2, 1, 4, append=True), capacity=capacity, pad_rows=pad_rows)
    sess = PositionSession()
    return FixedBufferKV(plan, sess, None, "logits", 6), sess


@pytest.mark.parametrize("pad_rows", [False, True], ids=["default", "padded"])
def test_fixed_buffers_write_new_rows_after_the_prefix_and_roll_back_by_a_counter(pad_rows):
    kv, sess = fixed(8, pad_rows)
    out = kv.forward([11, 12, 13], 2)
    assert out[:, 0].tolist() == [12, 13] and kv.n_past == 3
    kv.trim(1)  # a rejected draft: the next forward overwrites slots 1..
    assert kv.forward([21, 22], 1)[:, 0].tolist() == [22] and kv.n_past == 3
    assert sess.runs == [(0, 3 + pad_rows), (1, 2 + pad_rows)]  # the past bound is the kept prefix
    for buf in kv.buffers():
        assert buf.shape == (8 + pad_rows, 1, 4)  # the padding row has room at capacity
        assert buf[:3, 0, 0].tolist() == [0, 1, 2]
    kv.forward([31, 32, 33, 34, 35], 1)  # up to the capacity exactly
    assert kv.n_past == 8 and kv.buffers()[0][:8, 0, 0].tolist() == list(range(8))
    assert kv.memory() == {"kv": 4 * (8 + pad_rows) * 4 * 4, "kv_used": 8 * kv.plan.layout.bytes_per_token,
                           "logits": kv.logits.nbytes}


def test_past_the_capacity_nothing_runs_and_the_cache_is_unchanged():
    kv, sess = fixed(4, False)
    kv.forward([1, 2, 3], 1)
    with pytest.raises(ContextFullError, match="3 \\+ 2 positions exceed the KV capacity of 4"):
        kv.forward([4, 5], 1)
    assert kv.n_past == 3 and len(sess.runs) == 1


def test_a_wider_verify_grows_the_logits_buffer_once_and_a_probe_leaves_the_cache_empty():
    kv, sess = fixed(64, True)
    first = kv.logits
    assert kv.forward(list(range(30)), 20)[:, 0].tolist() == list(range(10, 30))
    assert kv.logits is not first and len(kv.logits) == 21
    grown = kv.logits
    kv.forward([1, 2], 2)
    assert kv.logits is grown  # kept
    assert kv.probe(16, 40) and kv.n_past == 0 and sess.runs[-1] == (24, 17)
    assert not kv.probe(4, 65)  # past the capacity: not run
    assert len(sess.runs) == 3


def windowed(capacity: int, pad_rows: bool) -> tuple[FixedBufferKV, PositionSession]:
    """Three layers, the last two sliding over a window of 8 aligned to 4 (rows: 64 + 8 + 4 + 256 + pad);
    the fake session reads P from layer 0's past, a full one's."""
    meta = {"edgespec.window": "8", "edgespec.window_align": "4", "edgespec.window_layers": "1,2"}
    plan = plan_kv(*graph(3, 1, 4, append=True), capacity=capacity, pad_rows=pad_rows, meta=meta)
    sess = PositionSession()
    return FixedBufferKV(plan, sess, None, "logits", 6), sess


@pytest.mark.parametrize("pad_rows", [False, True], ids=["default", "padded"])
def test_sliding_layers_hold_a_window_sized_buffer_whose_live_rows_move_to_the_front(pad_rows):
    rows = WINDOW_ROLLBACK + 8 + 4 + WINDOW_FORWARD + pad_rows
    kv, sess = windowed(2000, pad_rows)
    assert kv.plan.sliding_rows == rows and kv.plan.sliding_kv() == (2 / 3, rows)
    assert [len(b) for b in kv.buffers()] == [2000 + pad_rows] * 2 + [rows] * 4
    n = 0
    for width in [300, 1, 5, 256, 17, 200, 3]:  # a prefill wider than a sliding buffer takes runs in pieces
        kv.forward(list(range(width)), 1)
        n += width
        assert kv.n_past == n
        # every sliding buffer holds position p at row p - base for the window a forward at n reads
        base, start = kv._base, window_start(n, 8, 4)
        assert base <= start
        for buf in kv.buffers()[2:]:
            assert buf[start - base:n - base, 0, 0].tolist() == list(range(start, n))
        assert kv.buffers()[0][:n, 0, 0].tolist() == list(range(n))  # the full layer: every position
    assert [r[1] - pad_rows for r in sess.runs[:3]] == [256, 44, 1]  # pieces end at multiples of 256
    assert kv.memory()["kv"] == sum(b.nbytes for b in kv.buffers()) < 6 * (2000 + pad_rows) * 16
    assert kv.memory()["kv_used"] == n * 2 * 16 + rows * 4 * 16


def test_a_window_sized_buffer_rolls_back_exactly_within_its_margin_and_to_nothing_past_it():
    kv, sess = windowed(2000, False)
    kv.forward(list(range(700)), 1)
    for _ in range(300):  # decodes past several moves of the live rows
        kv.forward([7], 1)
    n = kv.n_past
    kv.trim(n - WINDOW_ROLLBACK + 4)  # a rejected draft's rollback: within what the buffers keep
    assert kv.n_past == n - WINDOW_ROLLBACK + 4
    kv.forward([7] * 3, 1)
    m = kv.n_past
    start = window_start(m, 8, 4)
    assert kv.buffers()[2][start - kv._base:m - kv._base, 0, 0].tolist() == list(range(start, m))
    kv.trim(300)  # the rows a forward at 300 reads are gone: nothing is held, the caller feeds again
    assert kv.n_past == 0 and kv._base == 0
    kv.forward(list(range(20)), 1)
    assert sess.runs[-1] == (0, 20)


def test_the_window_sized_buffers_are_for_chains_and_small_capacities_keep_whole_buffers():
    meta = {"edgespec.window": "8", "edgespec.window_align": "4", "edgespec.window_layers": "0"}
    inputs, outputs = graph(2, 1, 4, append=True)
    assert plan_kv(inputs, outputs, capacity=300, meta=meta).sliding_rows is None  # whole buffers are smaller
    tree = plan_kv([*inputs, ("tree_path", [1, "S"])], outputs, capacity=2000, meta=meta)
    assert tree.window is not None and tree.sliding_rows is None and tree.sliding_kv() == (0.0, 0)


# ---------------------------------------------------------------- on a tiny model


def test_the_fixed_buffers_compute_a_fresh_runtimes_logits_through_rollbacks(zoo, tmp_path):
    """Rollbacks and verifies on one runtime against a fresh runtime that reads the same prefix in one prefill."""
    pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    from edgespec.exporters.onnx.graph import GraphOptions, build_decoder
    from edgespec.exporters.spec import spec_from_hf
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    model = zoo.hf_model("llama")
    spec, weights = spec_from_hf(model), {k: v.detach().numpy() for k, v in model.state_dict().items()}
    path = tmp_path / "append.onnx"
    onnx.save_model(build_decoder(spec, weights, GraphOptions(kv_layout="append")), str(path))
    ids = [int(t) for t in np.random.default_rng(3).integers(3, spec.vocab_size, 24)]
    with OnnxRuntime(path, kv_capacity=32) as rt, OnnxRuntime(path, kv_capacity=32) as fresh:
        assert isinstance(rt.kv, FixedBufferKV) and rt.capabilities.fixed_kv
        assert len(rt.kv_buffers()) == 2 * spec.n_layers
        assert fresh.kv_bytes_per_token == rt.kv_bytes_per_token and rt.kv_capacity == 32
        # a prefill, a verify, two rollbacks (one to nothing) and decodes after them
        for lo, hi, n in [(0, 10, 2), (10, 15, 5), (11, 12, 1), (12, 13, 1), (0, 6, 1), (6, 7, 1)]:
            rt.trim(lo)
            fresh.reset()
            a, b = np.array(rt.forward(ids[lo:hi], n_logits=n)), fresh.forward(ids[:hi], n_logits=n)
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"{lo}:{hi}")
            assert rt.n_past == fresh.n_past == hi
        assert rt.memory_bytes()["kv_used"] == 7 * rt.kv_bytes_per_token
        with pytest.raises(ContextFullError):
            rt.forward(ids + ids[:2])  # 7 + 26 positions
        assert rt.n_past == 7


def test_an_old_bundle_is_refused_at_load_with_the_fix(zoo, tmp_path):
    """A bundle whose graph returns `present_*` (the first exporter's layout, written here by
    renaming a current graph's outputs) is a one-line BundleError at load, not a crash later."""
    pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    import shutil

    from edgespec.bundle import load_bundle
    from edgespec.engine.engine import load

    bundle = tmp_path / "old"
    shutil.copytree(zoo.bundle("llama", None), bundle)
    path = bundle / load_bundle(bundle).manifest.target.formats["onnx"].file
    model = onnx.load(str(path), load_external_data=False)
    old = {o.name: o.name.replace("new_", "present_") for o in model.graph.output}
    assert sum(n != o for n, o in old.items()) == 2 * load_bundle(bundle).manifest.target.n_layers
    for node in model.graph.node:
        node.input[:] = [old.get(n, n) for n in node.input]
        node.output[:] = [old.get(n, n) for n in node.output]
    for out in model.graph.output:
        out.name = old[out.name]
    onnx.save_model(model, str(path))
    with pytest.raises(BundleError, match=r"^target/model\.onnx has the old growing KV layout, which edgespec no "
                                          r"longer runs: export the bundle again with `edgespec export`$"):
        load(bundle, backend="onnxruntime", use_draft=False)
