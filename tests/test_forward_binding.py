"""What a forward pays in Python to reach the engine (issue 22, item 3), and that it computes the same.

onnxruntime: `RawBinding` binds through the C objects behind onnxruntime's IOBinding where they
are there and through the public wrapper elsewhere; both give the same logits bit for bit, and a
forward binds again only what moved. OpenVINO: a buffer the KV holder keeps is wrapped in a
Tensor once and only reshaped per forward (one KV head; more heads copy their prefixes), also
across the buffer's growth, with the logits of a single forward over the whole sequence."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.runtimes.onnxruntime import kv as ort_kv
from edgespec.runtimes.onnxruntime.kv import FixedBufferKV, RawBinding, plan_kv
from tests.test_ort_kv import PositionSession, graph
from tests.tiny import VOCAB

# ---------------------------------------------------------------- onnxruntime


class _CountingSession(PositionSession):
    """PositionSession whose bindings count the binds of each name."""

    def io_binding(self):
        binding = super().io_binding()
        binding.count = {}
        bind_in, bind_out = binding.bind_input, binding.bind_output

        def counted(bind):
            def call(name, *args):
                binding.count[name] = binding.count.get(name, 0) + 1
                bind(name, *args)
            return call

        binding.bind_input, binding.bind_output = counted(bind_in), counted(bind_out)
        self.binding = binding
        return binding


def test_a_forward_binds_again_only_what_moved():
    plan = plan_kv(*graph(2, 1, 4, append=True), capacity=16, pad_rows=False)
    sess = _CountingSession()
    kv = FixedBufferKV(plan, sess, None, "logits", 6)
    assert not kv._binding.fast  # a fake session has no C objects: the public wrapper's calls
    count = sess.binding.count
    assert count == {"n_logits": 1}  # bound once: its buffer never moves
    kv.forward([1, 2, 3], 1)
    kv.forward([4], 1)
    kv.forward([5], 1)  # the same shape as the last: ids and logits stay bound
    assert count["n_logits"] == 1 and count["input_ids"] == 2 and count["logits"] == 2
    assert count["past_key_0"] == count["new_value_1"] == 3  # the KV prefix grows every forward
    assert kv.forward([6, 7], 2)[:, 0].tolist() == [6, 7] and count["input_ids"] == 3


def _tiny_append_graph(zoo, tmp_path):
    onnx = pytest.importorskip("onnx")
    from edgespec.exporters.onnx.graph import GraphOptions, build_decoder
    from edgespec.exporters.spec import spec_from_hf

    model = zoo.hf_model("gemma3")
    spec, weights = spec_from_hf(model), {k: v.detach().numpy() for k, v in model.state_dict().items()}
    path = tmp_path / "append.onnx"
    onnx.save_model(build_decoder(spec, weights, GraphOptions(kv_layout="append")), str(path))
    return path


@pytest.mark.parametrize("pad_rows", [False, True], ids=["default", "padded"])
def test_the_c_binding_and_the_public_wrapper_compute_the_same_bits(zoo, tmp_path, monkeypatch, pad_rows):
    pytest.importorskip("onnxruntime")
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    path = _tiny_append_graph(zoo, tmp_path)
    fast = OnnxRuntime(path, kv_capacity=64, pad_rows=pad_rows)
    with monkeypatch.context() as mp:  # an onnxruntime without the C objects behind its wrappers
        mp.setattr(ort_kv, "_c_objects", lambda sess, binding: (None, None, None))
        public = OnnxRuntime(path, kv_capacity=64, pad_rows=pad_rows)
    assert fast.kv._binding.fast and not public.kv._binding.fast
    ids = [int(t) for t in np.random.default_rng(5).integers(3, VOCAB, 40)]
    # a prefill, verifies, rollbacks (one to nothing) and decodes after them
    for lo, hi, n in [(0, 12, 3), (12, 17, 5), (13, 14, 1), (14, 15, 1), (0, 6, 1), (6, 7, 1), (7, 11, 4)]:
        for rt in (fast, public):
            rt.trim(lo)
        a, b = np.array(fast.forward(ids[lo:hi], n_logits=n)), public.forward(ids[lo:hi], n_logits=n)
        assert np.array_equal(a, b), f"{lo}:{hi}"
        assert fast.n_past == public.n_past == hi
    for rt in (fast, public):
        rt.close()


def test_raw_binding_public_mode_uses_the_wrapper_on_a_real_session(zoo, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    path = _tiny_append_graph(zoo, tmp_path)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert RawBinding(sess).fast and not RawBinding(sess, public=True).fast


# ---------------------------------------------------------------- OpenVINO


@pytest.mark.parametrize("name", ["gemma3", "llama"])  # one KV head (fed in place), two (copied)
def test_openvino_binds_kept_buffers_once_and_rebinds_after_growth(zoo, name):
    pytest.importorskip("openvino")
    from tests.test_openvino import ov_target

    rt = ov_target(zoo, name, kv_capacity=400)
    one_head = rt.kv.layout.kv_heads == 1
    ids = [int(t) for t in np.random.default_rng(2).integers(10, VOCAB, size=300)]
    rt.forward(ids[:200])
    tensors = {i: t for i, (_, t) in rt._bound.items()}
    names = {n: i for n, i in rt._in.items()}
    kv_inputs = {names[f"past_{k}_0"] for k in ("key", "value")}
    assert (kv_inputs <= set(tensors)) is one_head  # more heads: prefixes copied, not kept
    assert names["input_ids"] in tensors  # the token inputs' buffers are kept either way
    for t in range(200, 210):  # decodes and a rollback: the same Tensors, reshaped
        rt.forward(ids[t:t + 1])
    rt.trim(205)
    rt.forward(ids[205:210])
    assert all(rt._bound[i][1] is tensors[i] for i in tensors if i in rt._bound)
    rt.forward(ids[210:300])  # past the buffer's first size (256): it grows, the KV Tensors are new
    if one_head:
        assert all(rt._bound[i][1] is not tensors[i] for i in kv_inputs)
    rt.trim(290)
    got = np.array(rt.forward(ids[290:300], n_logits=10))
    ref = ov_target(zoo, name, kv_capacity=400)
    want = ref.forward(ids[:300], n_logits=10)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()
