"""GGUF blocks → MatMulNBits: every block type dequantizes to what gguf-py's dequantizer gives,
block by block (exactly, or within float32 rounding of the K-quant min decomposition), in numpy
and in onnxruntime's own MatMulNBits and in the graph's embedding gather."""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from edgespec.errors import ExportError  # noqa: E402
from edgespec.exporters.gguf.transcode import TRANSCODABLE, BlockWeight, fold_mins, transcode  # noqa: E402

N, K = 12, 512  # two K-quant super-blocks per row
# integer zero points (and 8-bit mins kept apart): the same float32 products as gguf-py's
EXACT = ("Q4_0", "Q5_0", "Q5_1", "Q8_0", "Q5_K", "Q6_K")
AFFINE = ("Q4_1", "Q4_K")  # 4-bit float zero points -offset / scale, rounded once
_RAW_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q3_K": 110, "Q2_K": 84, "IQ4_XS": 136, "IQ4_NL": 18}
# where each of those keeps its fp16 scale d and its fp16 min scale dmin (None: it has none)
_F16_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, None), "Q3_K": (108, None), "Q2_K": (80, 82),
           "IQ4_XS": (0, None), "IQ4_NL": (0, None)}


def _f16(rng, n, lo=-0.05, hi=0.05) -> np.ndarray:
    return rng.uniform(lo, hi, n).astype(np.float16).view(np.uint8).reshape(n, 2)


def _raw_k_blocks(name: str, rng: np.random.Generator, n: int = N, k: int = K) -> np.ndarray:
    """Random K-quant and IQ4 blocks built by bytes (gguf-py cannot quantize these): random codes,
    sub-block scales and mins, finite fp16 scales; a block with d = 0 and, where the type has one,
    one with dmin = 0."""
    n_blocks = n * k // (32 if name == "IQ4_NL" else 256)
    blocks = rng.integers(0, 256, size=(n_blocks, _RAW_BYTES[name]), dtype=np.uint8)
    d, dmin = _F16_AT[name]
    blocks[:, d:d + 2] = _f16(rng, n_blocks)
    if dmin is not None:
        blocks[:, dmin:dmin + 2] = _f16(rng, n_blocks, 0.0, 0.05)
        blocks[1, dmin:dmin + 2] = 0  # dmin = 0: no offset
    blocks[0, d:d + 2] = 0  # d = 0: every sub-block is 0, or the constant -dmin * m
    return blocks.reshape(n, -1)


def raw_blocks(name: str, rng: np.random.Generator, n: int = N, k: int = K) -> np.ndarray:
    """(n, row bytes) raw GGUF data of type `name` (k a multiple of 256 for K-quants and IQ4_XS)."""
    if name in _RAW_BYTES:
        return _raw_k_blocks(name, rng, n, k)
    data = rng.normal(0, 0.1, (n, k)).astype(np.float32)
    data[0, :32] = 0.25  # a constant block: Q4_1's d = 0
    return quantize(data, T[name])


def block_tolerance(w: BlockWeight) -> np.ndarray:
    """Per-element bound: a few float32 ulps of the block's largest term |scale| * max code + |offset|."""
    n, k = w.shape
    zp = np.zeros_like(w.scales) if w.zero_points is None else w.zero_points.astype(np.float32)
    mins = np.zeros_like(w.scales) if w.mins is None else np.abs(w.mins)
    mag = np.abs(w.scales) * ((1 << w.bits) - 1) + np.abs(w.scales * zp) + mins
    return np.repeat(mag, w.block_size, axis=1).reshape(n, k) * 8 * np.finfo(np.float32).eps


@pytest.mark.parametrize("name", EXACT + AFFINE)
def test_every_block_dequantizes_like_gguf(name):
    rng = np.random.default_rng(0)
    raw = raw_blocks(name, rng)
    w = transcode(raw, T[name], (N, K), f"blk.0.{name}.weight")
    assert isinstance(w, BlockWeight) and w.shape == (N, K) and w.source_type == name
    ref = dequantize(raw, T[name]).reshape(N, K)
    got = w.dequantize()
    assert np.isfinite(ref).all()
    if name in EXACT:
        np.testing.assert_array_equal(got, ref)
    else:
        bad = np.abs(got - ref) > block_tolerance(w)
        assert not bad.any(), f"{bad.sum()} elements off, first at {np.argwhere(bad)[0]}"



@pytest.mark.parametrize("name", ["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_codes_are_the_gguf_codes(name):
    """No requantization: the codes' bit width and block size follow the GGUF type."""
    w = transcode(raw_blocks(name, np.random.default_rng(1)), T[name], (N, K), "t")
    bits, block = {"Q4_0": (4, 32), "Q5_0": (8, 32), "Q8_0": (8, 32), "Q4_K": (4, 32), "Q5_K": (8, 32),
                   "Q6_K": (8, 16)}[name]
    assert (w.bits, w.block_size) == (bits, block)
    assert w.codes.shape == (N, K // block, block * bits // 8) and w.codes.dtype == np.uint8
    if name in ("Q5_0", "Q5_K"):
        assert w.unpacked_codes().max() <= 31
    if name == "Q6_K":
        assert w.unpacked_codes().max() <= 63 and (w.zero_points == 32).all()


@pytest.mark.parametrize("name,dtype", [("F32", np.float32), ("F16", np.float16)])
def test_float_tensors_stay_float(name, dtype):
    data = np.random.default_rng(2).normal(size=(N, K)).astype(dtype)
    out = transcode(data, T[name], (N, K), "t")
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    np.testing.assert_array_equal(out, data.astype(np.float32))


def test_bf16_matches_gguf():
    data = np.random.default_rng(3).normal(size=(N, K)).astype(np.float32)
    raw = quantize(data, T.BF16)
    np.testing.assert_array_equal(transcode(raw, T.BF16, (N, K), "t"), dequantize(raw, T.BF16).reshape(N, K))


@pytest.mark.parametrize("name", ["IQ2_XXS", "IQ3_S", "TQ1_0"])
def test_unknown_block_type_is_a_one_line_error(name):
    with pytest.raises(ExportError) as err:
        transcode(np.zeros((N, 64), np.uint8), T[name], (N, K), "blk.3.ffn_up.weight")
    msg = str(err.value)
    assert "\n" not in msg and name in msg and "blk.3.ffn_up.weight" in msg


@pytest.mark.parametrize("name", ["Q5_1", "Q5_K", "Q4_K"])
def test_folded_mins_dequantize_like_gguf(name):
    """fold_mins (OpenVINO's form: float zero points, no mins) keeps the codes and gives the GGUF's
    weights within float32 rounding of min / scale, constant (scale 0) blocks included."""
    raw = raw_blocks(name, np.random.default_rng(7))
    w = transcode(raw, T[name], (N, K), "t")
    f = fold_mins(w)
    assert f.mins is None and f.bits == w.bits and f.block_size == w.block_size
    kept = w.scales != 0  # only constant blocks' codes change
    np.testing.assert_array_equal(f.codes[kept], w.codes[kept])
    ref = dequantize(raw, T[name]).reshape(N, K)
    bad = np.abs(f.dequantize() - ref) > block_tolerance(w)
    assert not bad.any(), f"{bad.sum()} elements off, max {np.abs(f.dequantize() - ref).max()}"


def test_rows_keep_the_blocks():
    w = transcode(raw_blocks("Q4_K", np.random.default_rng(4)), T.Q4_K, (N, K), "t")
    keep = np.array([7, 0, 3])
    np.testing.assert_array_equal(w.rows(keep).dequantize(), w.dequantize()[keep])


# -- onnxruntime ---------------------------------------------------------------------------
def _run_graph(w: BlockWeight, ids: np.ndarray | None = None) -> np.ndarray:
    """Run onnxruntime on x = I_K through MatMulNBits (→ W^T), or gather rows `ids` of W."""
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    from edgespec.exporters.onnx.graph import _G

    n, k = w.shape
    g = _G()
    if ids is None:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [k, k])
        y = g.matmul_nbits("x", w, "w")
        feed = {"x": np.eye(k, dtype=np.float32)}
    else:
        x = helper.make_tensor_value_info("ids", TensorProto.INT64, [1, len(ids)])
        y = g.gather_blocks(w, "w", "ids")
        feed = {"ids": ids[None].astype(np.int64)}
    g.nodes.append(helper.make_node("Identity", [y], ["y"]))
    graph = helper.make_graph(g.nodes, "t", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=g.inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["y"], feed)[0]


@pytest.mark.parametrize("name", EXACT + AFFINE)
def test_onnxruntime_matmulnbits_dequantizes_like_gguf(name):
    raw = raw_blocks(name, np.random.default_rng(5))
    w = transcode(raw, T[name], (N, K), "t")
    ref = dequantize(raw, T[name]).reshape(N, K)
    got = _run_graph(w).T  # I @ W^T
    bad = np.abs(got - ref) > block_tolerance(w) + 1e-30
    assert not bad.any(), f"{name}: {bad.sum()} elements off, max {np.abs(got - ref).max()}"


@pytest.mark.parametrize("name", EXACT + AFFINE)
def test_embedding_gather_dequantizes_like_gguf(name):
    raw = raw_blocks(name, np.random.default_rng(6))
    w = transcode(raw, T[name], (N, K), "t")
    ref = dequantize(raw, T[name]).reshape(N, K)
    ids = np.array([3, 0, 11, 3])
    got = _run_graph(w, ids)[0]
    tol = block_tolerance(w)[ids]
    assert not (np.abs(got - ref[ids]) > tol).any()


def test_transcodable_covers_the_issue_types():
    assert {"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "F32"} <= set(TRANSCODABLE)
