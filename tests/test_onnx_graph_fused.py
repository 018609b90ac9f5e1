"""The decoder graph with onnxruntime's fused kernels (exporters/onnx/fused.py, GraphOptions.fused_ops):
the same logits as the plain graph through a prefill, verifies and decodes on every family, fewer
kernels, and one MatMulNBits over concatenated GGUF blocks that computes what the separate ones did."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from edgespec.exporters.gguf.transcode import BlockWeight
from edgespec.exporters.onnx.fused import concat_rows
from edgespec.exporters.onnx.graph import GraphOptions, build_decoder

onnx = pytest.importorskip("onnx")


def _ops(model) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def _decode_logits(path, ids: list[int]) -> list[np.ndarray]:
    """Logits of a prefill, a 3-row verify, a rollback and one-token decodes after it."""
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    with OnnxRuntime(path, kv_capacity=64) as rt:
        out = [rt.forward(ids[:8], n_logits=8), rt.forward(ids[8:11], n_logits=3)]
        rt.trim(9)
        out += [rt.forward([t]) for t in ids[9:14]]
    return [np.asarray(o) for o in out]


def _save(model, path):
    onnx.save_model(model, str(path))
    return path


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3", "gemma3-tied"])
def test_fused_graph_computes_the_plain_graphs_logits_with_fewer_kernels(zoo, tmp_path, name):
    pytest.importorskip("onnxruntime")
    from edgespec.exporters.spec import spec_from_hf

    model = zoo.hf_model(name)
    spec, weights = spec_from_hf(model), {k: v.detach().numpy() for k, v in model.state_dict().items()}
    graphs = {f: build_decoder(spec, weights, GraphOptions(kv_layout="append", fused_ops=f)) for f in (False, True)}
    plain, fused = _ops(graphs[False]), _ops(graphs[True])
    assert fused["SimplifiedLayerNormalization"] > 0 and fused["RotaryEmbedding"] == 2 * spec.n_layers
    assert fused["SkipSimplifiedLayerNormalization"] == 2 * spec.n_layers  # every residual add
    assert "ReduceMean" not in fused and "Cos" in fused and plain["Cos"] == fused["Cos"]  # cos/sin once per forward
    assert sum(fused.values()) < sum(plain.values())
    ids = [int(t) for t in np.random.default_rng(5).integers(3, spec.vocab_size, 14)]
    want = _decode_logits(_save(graphs[False], tmp_path / "plain.onnx"), ids)
    got = _decode_logits(_save(graphs[True], tmp_path / "fused.onnx"), ids)
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=f"forward {i}")


def test_the_append_layout_fuses_by_default_and_openvinos_graph_never_does():
    assert GraphOptions().kv_layout == "append" and GraphOptions().fused and GraphOptions(kv_layout="append").fused
    assert not GraphOptions(kv_layout="append", fused_ops=False).fused
    assert GraphOptions(fused_ops=True).fused
    assert not GraphOptions(kv_layout="buffer").fused
    with pytest.raises(ValueError, match=r"kv_layout must be one of \('append', 'buffer'\), got 'present'"):
        GraphOptions(kv_layout="present")  # the first layout (past/present) is no longer written
    with pytest.raises(ValueError, match="fused_ops"):
        GraphOptions(kv_layout="buffer", fused_ops=True)
    with pytest.raises(ValueError, match="fused_ops"):
        GraphOptions(kv_layout="append", nbits_float_zero_points=True)


def _block(rng, n: int, bits: int, zp: str, mins: bool, k: int = 64, block: int = 32) -> BlockWeight:
    codes = rng.integers(0, 256, (n, k // block, block * bits // 8), dtype=np.uint8)
    scales = rng.random((n, k // block), dtype=np.float32)
    zero = {"none": None, "uint8": rng.integers(0, 1 << bits, scales.shape, dtype=np.uint8),
            "float": rng.random(scales.shape, dtype=np.float32) * 15}[zp]
    return BlockWeight(codes, scales, zero, bits, block, f"T{bits}{zp}",
                       rng.random(scales.shape, dtype=np.float32) if mins else None)


@pytest.mark.parametrize("kinds", [
    [(8, "uint8", False), (8, "uint8", False), (8, "none", False)],  # Q5_0 q/k with a Q8_0 v
    [(4, "float", True), (4, "float", True)],  # Q4_K gate/up: symmetric codes, the offset in the mins
    [(8, "none", True), (8, "none", False)],  # one with block mins, one without
    [(4, "none", False), (4, "none", False)],
])
def test_concatenated_blocks_dequantize_to_the_stacked_weights(kinds):
    from edgespec.exporters.onnx.blocks import kernel_form

    rng = np.random.default_rng(len(kinds))
    ws = [_block(rng, 8 * (i + 1), *kind) for i, kind in enumerate(kinds)]
    joined = concat_rows(ws)
    assert joined is not None and joined.shape == (sum(w.shape[0] for w in ws), ws[0].shape[1])
    want = np.concatenate([kernel_form(w).dequantize() for w in ws])
    np.testing.assert_array_equal(joined.dequantize(), want)  # the same blocks: nothing rounds anew
    np.testing.assert_allclose(joined.dequantize(), np.concatenate([w.dequantize() for w in ws]), atol=1e-5)


@pytest.mark.parametrize("kinds", [[(8, "none", False), (4, "none", False)], [(4, "none", False), (4, "uint8", False)]])
def test_blocks_of_different_formats_are_not_concatenated(kinds):
    rng = np.random.default_rng(0)
    assert concat_rows([_block(rng, 8, *kind) for kind in kinds]) is None


def test_a_gguf_graph_multiplies_qkv_and_gate_up_once_each_and_keeps_its_logits(zoo, tmp_path):
    """A Q8_0 GGUF: q/k/v and gate/up read one MatMulNBits each; in fp32 (accuracy level 0) the
    fused graph gives the plain graph's logits."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("llama_cpp", reason="quantizing a GGUF needs llama-cpp-python")
    from edgespec.bundle import load_bundle
    from edgespec.exporters.gguf.source import read_gguf

    bundle = zoo.bundle("gemma3", None, formats=("gguf",), target_precision="int8")
    model = read_gguf(bundle / load_bundle(bundle).manifest.target.formats["gguf"].file)
    graphs = {f: build_decoder(model.spec, model.tensors, GraphOptions(kv_layout="append", fused_ops=f))
              for f in (False, True)}
    n = model.spec.n_layers
    assert _ops(graphs[False])["MatMulNBits"] - _ops(graphs[True])["MatMulNBits"] == 3 * n
    ids = [int(t) for t in np.random.default_rng(7).integers(3, model.spec.vocab_size, 14)]
    want = _decode_logits(_save(graphs[False], tmp_path / "plain.onnx"), ids)
    got = _decode_logits(_save(graphs[True], tmp_path / "fused.onnx"), ids)
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=f"forward {i}")


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_block_weights_with_mins_and_mixed_formats_keep_their_logits(zoo, tmp_path, name):
    """Every projection a random BlockWeight (K-quant mins, 8-bit zero points or none, 4 bits):
    the fused graph's concatenated products and four-kernel min corrections compute the plain
    graph's logits (accuracy level 0: fp32)."""
    pytest.importorskip("onnxruntime")
    from edgespec.exporters.spec import spec_from_hf

    model = zoo.hf_model(name)
    spec, weights = spec_from_hf(model), {k: v.detach().numpy() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(11)
    kinds = [(4, "float", True), (8, "uint8", False), (8, "none", False), (8, "none", True)]
    for i, key in enumerate(k for k in weights if k.endswith("_proj.weight")):
        n, k = weights[key].shape
        w = _block(rng, n, *kinds[i % len(kinds)] if "mlp" in key else kinds[(i // 7) % 2], k=k)
        weights[key] = BlockWeight(w.codes, w.scales * 0.05, w.zero_points, w.bits, w.block_size, w.source_type,
                                   None if w.mins is None else w.mins * 0.05)
    graphs = {f: build_decoder(spec, weights, GraphOptions(kv_layout="append", fused_ops=f)) for f in (False, True)}
    assert _ops(graphs[True])["MatMulNBits"] < _ops(graphs[False])["MatMulNBits"]
    ids = [int(t) for t in np.random.default_rng(2).integers(3, spec.vocab_size, 14)]
    want = _decode_logits(_save(graphs[False], tmp_path / "plain.onnx"), ids)
    got = _decode_logits(_save(graphs[True], tmp_path / "fused.onnx"), ids)
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max(), err_msg=f"forward {i}")


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_attention_scores_round_alike_beside_any_number_of_keys(threads):
    """Plain decoding computes a score row beside T keys, a verify beside T + 1 or more (its later
    rows' keys, masked): the row's bits must not depend on how many keys stand beside it.
    onnxruntime's SGEMM sums a 256-deep product (Gemma 3's head_dim) in one pass or in two
    depending on how many columns each thread takes (on a 2-vCPU EPYC at T = 128 -> 129 and
    144 -> 145), so the graph adds up products of depth 128, which it always sums in one pass."""
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    from edgespec.exporters.onnx.graph import _G, OPSET, _scores

    g = _G()
    out = _scores(g, "q", "k", 256)
    graph = helper.make_graph(g.nodes, "scores",
                              [helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, 1, "R", 256]),
                               helper.make_tensor_value_info("k", TensorProto.FLOAT, [1, 1, "T", 256])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], g.inits)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
                                .SerializeToString(), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 12, 256), dtype=np.float32)
    k = rng.standard_normal((1, 1, 300, 256), dtype=np.float32)
    for t in range(3, 296):
        alone = sess.run(None, {"q": q[:, :, :8], "k": k[:, :, :t]})[0]
        for rows, more in ((8, 1), (12, 1), (12, 4)):
            beside = sess.run(None, {"q": q[:, :, :rows], "k": k[:, :, :t + more]})[0]
            assert np.array_equal(beside[:, :, :8, :t], alone), (t, rows, more)
