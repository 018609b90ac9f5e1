"""The small-memory GGUF quant types (Q3_K, Q2_K, IQ4_NL, IQ4_XS) transcoded to MatMulNBits and
OpenVINO's compressed constants.

Block by block, each dequantizes to exactly gguf-py's values (numpy, onnxruntime's MatMulNBits and
the embedding gather; OpenVINO's folded Q2_K zero points within float32 rounding). End to end, tiny
random-weight GGUFs quantized by llama.cpp's own quantizer export to ONNX and OpenVINO: the graph
computing in fp32 gives the logits of the fp32 graph of gguf-py's dequantized weights, and the
exported bundle (int8 activations, as llama.cpp computes) llama-cpp-python's logits on the same
file within the bound below; speculative greedy equals plain greedy.
"""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import IQ4_NL, dequantize  # noqa: E402

from edgespec.bundle import load_bundle  # noqa: E402
from edgespec.exporters.export import ExportConfig, export_bundle  # noqa: E402
from edgespec.exporters.gguf.source import read_gguf  # noqa: E402
from edgespec.exporters.gguf.transcode import TRANSCODABLE, BlockWeight, fold_mins, transcode  # noqa: E402
from tests.gguf_reference import llama_cpp_run  # noqa: E402
from tests.gguf_writers import spm_vocab  # noqa: E402
from tests.test_transcode import K, N, _run_graph, block_tolerance, raw_blocks  # noqa: E402

NEW = ("Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS")
# (bits, block size) each keeps: see the transcode module's docstring for why
LAYOUT = {"Q3_K": (4, 16), "Q2_K": (4, 16), "IQ4_NL": (8, 32), "IQ4_XS": (8, 32)}
# llama.cpp file types (llama_ftype) whose quantizer writes each type into the tiny model's matrices
FTYPES = {"Q2_K": 10, "Q3_K": 11, "IQ4_NL": 25, "IQ4_XS": 30}  # Q3_K: Q3_K_S
# Next-token logits of the exported bundle against llama-cpp-python's on the same file: both round
# activations to 8 bits before their integer dot products (onnxruntime per block of the weight,
# llama.cpp per 32 or 256), so they differ by that rounding, not by the weights. Measured on the
# model below: 0.13-0.25 at logits up to ~14, for Q8_0, Q4_K_M and Q6_K as for these types, while
# a transcoding with two IQ4_NL codebook entries swapped is 2.0 off and Q2_K mins 2% off 1.3. The
# bound is half of what test_gguf_source allows the level-4 logits against the fp32 graph.
REL_ATOL = 0.05
N_IDS = 64
GREEDY = 8


# -- blocks ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NEW)
def test_every_block_dequantizes_exactly_like_gguf(name):
    raw = raw_blocks(name, np.random.default_rng(0))
    w = transcode(raw, T[name], (N, K), f"blk.0.{name}.weight")
    assert isinstance(w, BlockWeight) and w.shape == (N, K) and w.source_type == name
    ref = dequantize(raw, T[name]).reshape(N, K)
    assert np.isfinite(ref).all() and (ref != 0).mean() > 0.5
    np.testing.assert_array_equal(w.dequantize(), ref)


@pytest.mark.parametrize("name", NEW)
def test_codes_keep_the_gguf_values(name):
    """No requantization: 4-bit K-quant codes are the GGUF's own shifted by the op's default zero
    point; IQ4 codes are the codebook's int8 values around 128; one float32 scale per sub-block."""
    raw = raw_blocks(name, np.random.default_rng(1))
    w = transcode(raw, T[name], (N, K), "t")
    bits, block = LAYOUT[name]
    assert (w.bits, w.block_size) == (bits, block) and w.zero_points is None
    assert w.codes.shape == (N, K // block, block * bits // 8) and w.codes.dtype == np.uint8
    assert w.scales.shape == (N, K // block) and w.scales.dtype == np.float32
    codes = w.unpacked_codes()
    if name.startswith("IQ4"):
        book = np.array(IQ4_NL.kvalues) + 128
        assert set(np.unique(codes)) == set(book.tolist())  # every entry, nothing else
    else:
        lo = {"Q3_K": 4, "Q2_K": 8}[name]  # Q3_K's q in -4..3, Q2_K's in 0..3, plus 8
        assert codes.min() == lo and codes.max() == 11
    assert (w.mins is not None) == (name == "Q2_K")


def test_q3_k_high_bit_and_scale_layout():
    """One hand-built Q3_K super-block: q = low 2 bits - 4 where the hmask bit is clear, and the
    6-bit scales split over low nibbles and high bit pairs, as llama.cpp's dequantize_row_q3_K."""
    block = np.zeros(110, np.uint8)
    block[32 + 5] = 0b11_10_01_00  # byte 5 of the first half: elements 5, 37, 69, 101 get 0, 1, 2, 3
    block[0 + 5] = 0b0000_0101  # hmask byte 5: bits 0 and 2 -> elements 5 and 69 have no -4
    block[96] = 0x21  # scale 0 low nibble 1, scale 8 low nibble 2
    block[96 + 8] = 0b00_00_10_11  # high pairs: scale 0 gets 3, scale 4 gets 2
    block[108:110] = np.array([0.5], np.float16).view(np.uint8)
    scales = np.full(16, -32.0, np.float32)
    scales[0], scales[8], scales[4] = (3 << 4 | 1) - 32, 2 - 32, (2 << 4) - 32
    q = np.full(256, -4.0, np.float32)
    q[[5, 37, 69, 101]] = [0, 1 - 4, 2, 3 - 4]
    want = 0.5 * np.repeat(scales, 16) * q
    raw = block[None]
    np.testing.assert_array_equal(dequantize(raw, T.Q3_K).reshape(-1), want)  # the reading above is gguf's
    np.testing.assert_array_equal(transcode(raw, T.Q3_K, (1, 256), "t").dequantize().reshape(-1), want)


def test_folded_q2_k_mins_dequantize_like_gguf():
    """fold_mins (OpenVINO's form) on a 4-bit weight with the op's default zero point and block
    mins: zero points 8 + min / scale, within float32 rounding of min / scale."""
    raw = raw_blocks("Q2_K", np.random.default_rng(7))
    w = transcode(raw, T.Q2_K, (N, K), "t")
    f = fold_mins(w)
    assert f.mins is None and f.zero_points.dtype == np.float32 and (f.bits, f.block_size) == (4, 16)
    ref = dequantize(raw, T.Q2_K).reshape(N, K)
    err = np.abs(f.dequantize() - ref)
    assert not (err > block_tolerance(w)).any(), f"max {err.max()}"
    assert (w.scales == 0).any()  # constant sub-blocks (d = 0) were folded too


@pytest.mark.parametrize("name", NEW)
def test_onnxruntime_matmulnbits_and_gather_dequantize_like_gguf(name):
    raw = raw_blocks(name, np.random.default_rng(5))
    w = transcode(raw, T[name], (N, K), "t")
    ref = dequantize(raw, T[name]).reshape(N, K)
    tol = block_tolerance(w) + 1e-30
    got = _run_graph(w).T  # I @ W^T
    assert not (np.abs(got - ref) > tol).any(), f"{name}: max {np.abs(got - ref).max()}"
    ids = np.array([3, 0, 11, 3])
    rows = _run_graph(w, ids)[0]
    assert not (np.abs(rows - ref[ids]) > tol[ids]).any()


def test_the_new_types_are_transcodable():
    assert set(NEW) <= set(TRANSCODABLE)


# OpenVINO's conversion depends on the layout only: 4-bit block 16 with the default zero point
# (Q3_K), the same with folded mins (Q2_K), 8-bit block 32 (both IQ4 types, as Q8_0)
@pytest.mark.parametrize("name", ["Q3_K", "Q2_K", "IQ4_XS"])
def test_every_openvino_weight_dequantizes_like_gguf(tmp_path, name):
    """Each matrix of the converted IR (and the tied embedding's gathered rows) is gguf-py's
    dequantization: exactly, or within float32 rounding where Q2_K's mins are folded."""
    pytest.importorskip("openvino")
    from edgespec.exporters.onnx.graph import GraphOptions
    from edgespec.exporters.openvino.export import convert_graph, source_weights
    from tests.test_openvino_gguf import HIDDEN, MATRICES, VOCAB, _embedding_rows, _weights_of, tiny_gguf

    raws = tiny_gguf(tmp_path / "m.gguf", name)
    model = read_gguf(tmp_path / "m.gguf")
    ir = convert_graph(model.spec, source_weights(model.tensors), GraphOptions(kv_layout="buffer"), tmp_path)
    got = _weights_of(ir)
    assert sorted(got) == sorted(MATRICES)
    etype = "<Type: 'uint4_t'>" if LAYOUT[name][0] == 4 else "<Type: 'uint8_t'>"
    for gname, (w, et) in got.items():
        assert et == etype, (gname, et)
        n, k = MATRICES[gname]
        ref = dequantize(raws[gname], T[name]).reshape(n, k)
        if name == "Q2_K":
            bad = np.abs(w - ref) > block_tolerance(transcode(raws[gname], T[name], (n, k), gname))
            assert not bad.any(), f"{gname}: {bad.sum()} elements off, max {np.abs(w - ref).max()}"
        else:
            np.testing.assert_array_equal(w, ref, err_msg=gname)
    ids = np.array([5, 0, 63, 5])
    emb = dequantize(raws["token_embd.weight"], T[name]).reshape(VOCAB, HIDDEN)[ids]
    tol = block_tolerance(transcode(raws["token_embd.weight"], T[name], (VOCAB, HIDDEN), "e"))[ids]
    assert not (np.abs(_embedding_rows(ir, ids) - emb) > tol).any()


# -- llama.cpp-quantized tiny models -------------------------------------------------------------
def write_f32_gguf(path, *, hidden: int = 256, heads: int = 4, kv: int = 2, head_dim: int = 64, ffn: int = 512,
                   layers: int = 2, std: float = 0.05, seed: int = 0) -> int:
    """A llama-architecture GGUF of random float32 weights whose every matrix row is a multiple of
    256 (else llama.cpp's quantizer falls back to IQ4_NL, Q5_0, ... for that tensor), an untied
    head (so the embedding keeps the file's type; a head gets Q6_K) and a SentencePiece vocabulary.
    Weights of std 0.05 keep activations moderate, where llama.cpp's and onnxruntime's 8-bit
    activation rounding stays small next to the logits. Returns the vocabulary size."""
    from gguf import GGUFWriter

    rng = np.random.default_rng(seed)
    tokens, scores, types = spm_vocab()
    w = GGUFWriter(str(path), "llama")
    for add, value in ((w.add_context_length, 1024), (w.add_embedding_length, hidden), (w.add_block_count, layers),
                       (w.add_feed_forward_length, ffn), (w.add_head_count, heads), (w.add_head_count_kv, kv),
                       (w.add_key_length, head_dim), (w.add_value_length, head_dim),
                       (w.add_rope_dimension_count, head_dim), (w.add_rope_freq_base, 1e4),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_file_type, 0), (w.add_tokenizer_model, "llama"),
                       (w.add_token_list, tokens), (w.add_token_scores, scores), (w.add_token_types, types),
                       (w.add_bos_token_id, 1), (w.add_eos_token_id, 2), (w.add_unk_token_id, 0)):
        add(value)

    def mat(*shape, scale=std):
        return rng.normal(0.0, scale, size=shape).astype(np.float32)

    def norm(n):
        return (1.0 + rng.normal(0.0, 0.1, size=n)).astype(np.float32)

    w.add_tensor("token_embd.weight", mat(len(tokens), hidden, scale=1.0))
    w.add_tensor("output_norm.weight", norm(hidden))
    w.add_tensor("output.weight", mat(len(tokens), hidden, scale=4 * std))
    for i in range(layers):
        p = f"blk.{i}."
        for name, shape in (("attn_q", (heads * head_dim, hidden)), ("attn_k", (kv * head_dim, hidden)),
                            ("attn_v", (kv * head_dim, hidden)), ("attn_output", (hidden, heads * head_dim)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))):
            w.add_tensor(f"{p}{name}.weight", mat(*shape))
        w.add_tensor(p + "attn_norm.weight", norm(hidden))
        w.add_tensor(p + "ffn_norm.weight", norm(hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return len(tokens)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """name -> (the tiny model quantized by llama.cpp to that type, its vocabulary size), made once."""
    pytest.importorskip("llama_cpp", reason="quantizing a GGUF needs llama-cpp-python")
    from edgespec.exporters.gguf.export import quantize

    root = tmp_path_factory.mktemp("quants")
    vocab = write_f32_gguf(root / "f32.gguf")
    made: dict = {}

    def get(name: str):
        if name not in made:
            quantize(root / "f32.gguf", root / f"{name}.gguf", FTYPES[name])
            made[name] = (root / f"{name}.gguf", vocab)
        return made[name]

    return get


def _ids(vocab: int) -> list[int]:
    rng = np.random.default_rng(1)
    return [1] + [int(t) for t in rng.integers(3, vocab, size=N_IDS - 1)]


def _greedy(rt, ids: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    """Logits at every position of `ids`, then n greedy ids, one forward each."""
    logits = np.array(rt.forward(ids, len(ids)))
    out = [int(np.argmax(logits[-1]))]
    while len(out) < n:
        out.append(int(np.argmax(rt.forward(out[-1:], 1)[-1])))
    return logits, out


def _assert_like_llama_cpp(src, ids: list[int], logits: np.ndarray, greedy: list[int]) -> None:
    """Logits within REL_ATOL of llama.cpp's largest, the same argmax at nearly every position, and
    each greedy id within that bound of llama.cpp's best at its position (llama.cpp fed the same ids:
    a near-tie may flip, a wrong weight would not stay within the bound)."""
    ref, _ = llama_cpp_run(src, ids + greedy[:-1], 1)
    atol = REL_ATOL * np.abs(ref).max()
    np.testing.assert_allclose(logits, ref[: len(ids)], atol=atol, rtol=0)
    assert (logits.argmax(-1) == ref[: len(ids)].argmax(-1)).mean() >= 0.9
    tail = ref[len(ids) - 1:]
    picked = tail[np.arange(len(greedy)), greedy]
    assert (picked >= tail.max(-1) - atol).all(), (picked, tail.max(-1))


@pytest.mark.parametrize("name", NEW)
def test_llama_cpp_quantized_gguf_exports_to_onnx(quantized, tmp_path, name):
    """Export to ONNX: MatMulNBits on the file's own blocks; computing in fp32 (accuracy level 0) it
    gives the fp32 graph of gguf-py's dequantized weights; exported (level 4) llama.cpp's logits and
    greedy ids on the same file; speculative greedy equals plain greedy."""
    pytest.importorskip("onnxruntime")
    import onnx

    from edgespec.decoding import SamplingParams
    from edgespec.engine.engine import load
    from edgespec.exporters.onnx.graph import GraphOptions, build_decoder
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    src, vocab = quantized(name)
    model = read_gguf(src)
    assert model.block_types.get(name, 0) >= 6, model.block_types  # the type is most of the matrices
    out = export_bundle(ExportConfig(output=tmp_path / "b", target=src))
    m = load_bundle(out).manifest
    art = m.target.formats["onnx"]
    assert art.quantization["method"] == "gguf-transcode" and art.quantization["gguf_block_types"][name] >= 6
    ids = _ids(vocab)

    def save(weights, tag, **opts):
        path = tmp_path / tag / "model.onnx"
        path.parent.mkdir()
        onnx.save_model(build_decoder(model.spec, weights, GraphOptions(kv_layout="append", **opts)), str(path))
        return path

    ref, exact = save(model.dequantized(), "ref"), save(model.tensors, "exact", nbits_accuracy=0)
    with OnnxRuntime(ref) as r, OnnxRuntime(exact) as e:
        np.testing.assert_allclose(e.forward(ids, len(ids)), r.forward(ids, len(ids)), atol=1e-4, rtol=1e-4)
    with OnnxRuntime(out / art.file) as rt:
        logits, greedy = _greedy(rt, ids, GREEDY)
    _assert_like_llama_cpp(src, ids, logits, greedy)

    outs = []
    with load(out, use_draft=False) as plain, load(out) as spec:
        for engine in (plain, spec):
            tokens = list(ids)
            for _ in engine.stream_ids(tokens, SamplingParams(), 16):
                pass
            outs.append(tokens[len(ids):])
        assert spec.last_stats.drafted > 0
    assert outs[0] == outs[1] and len(outs[0]) > 0
    k = min(GREEDY, len(outs[0]))
    assert outs[0][:k] == greedy[:k]  # the engine decodes what the runtime's argmax gives


@pytest.mark.parametrize("name", ["Q2_K", "IQ4_XS"])
def test_llama_cpp_quantized_gguf_on_openvino(quantized, tmp_path, name):
    """Export to OpenVINO (the file's codes as u4/u8 compressed constants): llama.cpp's logits and
    greedy ids on the same file, within the same bound."""
    pytest.importorskip("openvino")
    from edgespec.runtimes.openvino.runtime import OpenVinoRuntime

    src, vocab = quantized(name)
    out = export_bundle(ExportConfig(output=tmp_path / "b", target=src, draft=None, formats=("openvino",)))
    art = load_bundle(out).manifest.target.formats["openvino"]
    assert art.quantization["method"] == "gguf-transcode" and art.quantization["gguf_block_types"][name] >= 6
    ids = _ids(vocab)
    with OpenVinoRuntime(out / art.file, precision="f32") as rt:
        logits, greedy = _greedy(rt, ids, GREEDY)
    _assert_like_llama_cpp(src, ids, logits, greedy)
