"""The onnxruntime runtime's KV holders (runtimes/onnxruntime/kv.py): `plan_kv` picks one from a graph's
inputs and outputs without a model; the fixed buffers write each forward's new rows right after
the held prefix (a fake session that records positions, no onnxruntime); on a tiny model the old
growing layout and the fixed buffers compute the same logits through rollbacks."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from edgespec.errors import BackendError, ContextFullError
from edgespec.runtimes.onnxruntime.kv import DEFAULT_KV_CAPACITY, FixedBufferKV, GrowingKV, KVLayout, plan_kv


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


def test_an_old_present_layout_gets_the_growing_cache_which_never_pads():
    # heads and head_dim on other axes than the append layout's: (1, kvh, P, hd)
    plan = plan_kv(*graph(2, 1, 16, append=False), pad_rows=True)
    assert plan.kind is GrowingKV and plan.layout == KVLayout(2, 1, 16)
    assert plan.pad == 0 and plan.capacity is None  # no limit unless one is given
    assert plan_kv(*graph(2, 1, 16, append=False), capacity=64).capacity == 64
    assert FixedBufferKV.fixed and FixedBufferKV.pads and not GrowingKV.fixed and not GrowingKV.pads


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


# ---------------------------------------------------------------- both layouts on a tiny model


def test_the_growing_layout_computes_the_fixed_buffers_logits_through_rollbacks(zoo, tmp_path):
    pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    from edgespec.exporters.onnx.graph import GraphOptions, build_decoder
    from edgespec.exporters.spec import spec_from_hf
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    model = zoo.hf_model("llama")
    spec, weights = spec_from_hf(model), {k: v.detach().numpy() for k, v in model.state_dict().items()}
    paths = {}
    for layout in ("append", "present"):
        paths[layout] = tmp_path / f"{layout}.onnx"
        onnx.save_model(build_decoder(spec, weights, GraphOptions(kv_layout=layout)), str(paths[layout]))
    ids = [int(t) for t in np.random.default_rng(3).integers(3, spec.vocab_size, 24)]
    with OnnxRuntime(paths["append"], kv_capacity=32) as new, OnnxRuntime(paths["present"], kv_capacity=32) as old:
        assert isinstance(new.kv, FixedBufferKV) and isinstance(old.kv, GrowingKV)
        assert new.capabilities.fixed_kv and not old.capabilities.fixed_kv and old.kv_buffers() == []
        assert old.kv_bytes_per_token == new.kv_bytes_per_token and old.kv_capacity == new.kv_capacity == 32
        # a prefill, a verify, two rollbacks (one to nothing) and decodes after them
        for lo, hi, n in [(0, 10, 2), (10, 15, 5), (11, 12, 1), (12, 13, 1), (0, 6, 1), (6, 7, 1)]:
            for rt in (new, old):
                rt.trim(lo)
            a, b = np.array(new.forward(ids[lo:hi], n_logits=n)), old.forward(ids[lo:hi], n_logits=n)
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"{lo}:{hi}")
            assert new.n_past == old.n_past == hi
        assert old.memory_bytes()["kv"] == 7 * old.kv_bytes_per_token
        with pytest.raises(ContextFullError):
            old.forward(ids + ids[:2])  # 7 + 26 positions
        assert old.n_past == 7
