"""GGUF blocks → OpenVINO compressed constants (issue 21 item 1): every matrix of the IR, evaluated
by OpenVINO, is gguf-py's dequantization of the GGUF tensor block by block (exactly, or within
float32 rounding of the folded zero points), its codes stay u4/u8, the tied embedding is one
table, and an exported bundle computes what the GGUF's weights compute."""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
ov = pytest.importorskip("openvino")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from edgespec.bundle import load_bundle  # noqa: E402
from edgespec.exporters.export import ExportConfig, export_bundle  # noqa: E402
from edgespec.exporters.gguf.source import open_gguf, read_gguf  # noqa: E402
from edgespec.exporters.gguf.tokenizer import GGUFTokenizer  # noqa: E402
from edgespec.exporters.gguf.transcode import transcode  # noqa: E402
from edgespec.exporters.onnx.graph import GraphOptions, build_decoder  # noqa: E402
from edgespec.exporters.openvino.export import convert_graph, source_weights  # noqa: E402
from tests.test_transcode import AFFINE, EXACT, block_tolerance, raw_blocks  # noqa: E402
from tests.tiny import LONG_PROMPT  # noqa: E402

# one Gemma 3 layer whose every matrix row is a multiple of the K-quant super-block (256)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 256, 2, 1, 128, 256, 64
MATRICES = {  # GGUF name -> (rows, row length)
    "token_embd.weight": (VOCAB, HIDDEN),
    "blk.0.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
    "blk.0.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
    "blk.0.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
    "blk.0.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
    "blk.0.ffn_gate.weight": (FFN, HIDDEN),
    "blk.0.ffn_up.weight": (FFN, HIDDEN),
    "blk.0.ffn_down.weight": (HIDDEN, FFN),
}
# the name each matrix's codes carry in the graph (onnx/graph's initializer names)
GRAPH_NAMES = {"model.embed_tokens.weight": "token_embd.weight", **{
    f"model.layers.0.{k}": f"blk.0.{v}.weight" for k, v in (
        ("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output"),
        ("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down"))}}
NORMS = {"token_embd_norm": None, "output_norm.weight": HIDDEN, "blk.0.attn_norm.weight": HIDDEN,
         "blk.0.attn_q_norm.weight": HEAD_DIM, "blk.0.attn_k_norm.weight": HEAD_DIM,
         "blk.0.post_attention_norm.weight": HIDDEN, "blk.0.ffn_norm.weight": HIDDEN,
         "blk.0.post_ffw_norm.weight": HIDDEN}


def tiny_gguf(path, qtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    """A one-layer Gemma 3 GGUF whose matrices are random `qtype` blocks (a tied head); returns the
    raw blocks by GGUF name."""
    from gguf import GGUFWriter

    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "gemma3")
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(1)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    raws = {}
    for name, (n, k) in MATRICES.items():
        raws[name] = raw_blocks(qtype, rng, n, k)
        w.add_tensor(name, raws[name], raw_shape=raws[name].shape, raw_dtype=T[qtype])
    for name, size in NORMS.items():
        if size:
            w.add_tensor(name, rng.normal(0, 0.1, size).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return raws


def _codes_constant(output):
    """The Constant holding the codes under a weight's dequantization subgraph (None: activations)."""
    node = output.get_node()
    while node.get_type_name() != "Constant":
        if node.get_input_size() == 0:
            return None
        node = node.input_value(0).get_node()
    return node


def _linear_map(model, name: str, k: int) -> np.ndarray:
    """(N, K): what the IR multiplies a weight's input rows by, from feeding the identity to the
    weight's MatMul (as the CPU plugin computes it in f32). The weight must be the whole of it: one
    compressed constant subgraph, no correction term after the MatMul (a split-off min or zero
    point would not fuse into the plugin's compressed FullyConnected)."""
    clone = model.clone()
    mm = next(op for op in clone.get_ordered_ops() if op.get_type_name() == "MatMul" and (
        c := _codes_constant(op.input_value(1))) is not None and c.get_friendly_name().split(".codes")[0] == name)
    x = ov.opset13.parameter([1, k, k], np.float32, name="x")
    for target in list(mm.input_value(0).get_target_inputs()):
        target.replace_source_output(x.output(0))
    users = [t.get_node().get_type_name() for t in mm.output(0).get_target_inputs()]
    assert "Subtract" not in users, f"{name}: a correction term follows the weight's MatMul"
    compiled = ov.Core().compile_model(ov.Model([mm.output(0)], [x], "weight"), "CPU",
                                       {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"})
    return compiled({"x": np.eye(k, dtype=np.float32)[None]})[0][0].T


def _weights_of(model) -> dict[str, tuple[np.ndarray, str]]:
    """GGUF name -> (the (N, K) weight the IR's MatMul applies, its codes' element type)."""
    out = {}
    for op in model.get_ordered_ops():
        codes = _codes_constant(op.input_value(1)) if op.get_type_name() == "MatMul" else None
        base = codes.get_friendly_name().split(".codes")[0] if codes is not None else None
        if base not in GRAPH_NAMES:  # attention's MatMuls multiply activations, not weights
            continue
        assert op.get_attributes()["transpose_b"]
        k = op.get_input_partial_shape(1)[1].get_length()
        out[GRAPH_NAMES[base]] = (_linear_map(model, base, k), str(codes.get_output_element_type(0)))
    return out


def _embedding_rows(model, ids: np.ndarray) -> np.ndarray:
    """The tied table's rows `ids` as the IR's embedding Gather dequantizes them, (len(ids), HIDDEN)."""
    table = next(op for op in model.get_ops() if op.get_friendly_name().startswith("model.embed_tokens.weight.codes")
                 and any(t.get_node().get_type_name() == "Gather" for t in op.output(0).get_target_inputs()))
    node = table
    while not (node.get_type_name() == "Reshape" and node.get_output_partial_shape(0).rank.get_length() == 3):
        node = next(iter(node.output(0).get_target_inputs())).get_node()
    param = next(p for p in model.get_parameters() if p.get_friendly_name() == "input_ids")
    sub = ov.Model([node.output(0)], [param], "embedding")
    compiled = ov.Core().compile_model(sub, "CPU", {"INFERENCE_PRECISION_HINT": "f32",
                                                    "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"})
    return compiled({"input_ids": ids[None].astype(np.int64)})[0][0]


@pytest.mark.parametrize("name", EXACT + AFFINE)
def test_every_openvino_weight_dequantizes_like_gguf(tmp_path, name):
    raws = tiny_gguf(tmp_path / "m.gguf", name)
    model = read_gguf(tmp_path / "m.gguf")
    ir = convert_graph(model.spec, source_weights(model.tensors), GraphOptions(kv_layout="buffer"), tmp_path)
    got = _weights_of(ir)
    assert sorted(got) == sorted(MATRICES)  # every matrix, the tied head included
    bits = transcode(raws["token_embd.weight"], T[name], MATRICES["token_embd.weight"], "t").bits
    for gname, (w, etype) in got.items():
        assert etype == ("<Type: 'uint4_t'>" if bits == 4 else "<Type: 'uint8_t'>"), (gname, etype)
        n, k = MATRICES[gname]
        ref = dequantize(raws[gname], T[name]).reshape(n, k)
        if name in EXACT and name not in ("Q5_1", "Q5_K"):  # 8-bit mins are folded: float32 rounding
            np.testing.assert_array_equal(w, ref, err_msg=gname)
        else:
            tol = block_tolerance(transcode(raws[gname], T[name], (n, k), gname))
            bad = np.abs(w - ref) > tol
            assert not bad.any(), f"{gname}: {bad.sum()} elements off, max {np.abs(w - ref).max()}"
    ids = np.array([5, 0, 63, 5])
    emb = dequantize(raws["token_embd.weight"], T[name]).reshape(VOCAB, HIDDEN)[ids]
    tol = block_tolerance(transcode(raws["token_embd.weight"], T[name], (VOCAB, HIDDEN), "e"))[ids]
    assert not (np.abs(_embedding_rows(ir, ids) - emb) > tol).any()


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0"])
def test_the_tied_table_is_stored_once(tmp_path, name):
    """The embedding Gather and the head's MatMul read one table in the saved IR: the file holds
    the GGUF's codes once (a second table would add the table's codes again)."""
    tiny_gguf(tmp_path / "m.gguf", name)
    model = read_gguf(tmp_path / "m.gguf")
    weights = source_weights(model.tensors)
    ir = convert_graph(model.spec, weights, GraphOptions(kv_layout="buffer"), tmp_path)
    ov.save_model(ir, str(tmp_path / "model.xml"), compress_to_fp16=False)
    blocks = sum(w.nbytes if hasattr(w, "codes") else np.asarray(w, np.float32).nbytes for w in weights.values())
    table = weights["model.embed_tokens.weight"].codes.nbytes
    size = (tmp_path / "model.bin").stat().st_size
    assert size < blocks + table // 2, (size, blocks, table)


def _feeds(ids: list[int], n_kv: int, head_dim: int, n_layers: int) -> dict:
    s = len(ids)
    feeds = {"input_ids": np.array([ids], np.int64), "position_ids": np.arange(s, dtype=np.int64)[None],
             "attention_mask": np.ones((1, s), np.int64), "logits_index": np.arange(s, dtype=np.int64)}
    for j in range(n_layers):
        for kind in ("key", "value"):
            feeds[f"past_{kind}_{j}"] = np.zeros((1, n_kv, 0, head_dim), np.float32)
    return feeds


@pytest.fixture(scope="module")
def q8_bundle(zoo, tmp_path_factory):
    """(a Q8_0 GGUF of the tiny Gemma 3, its ONNX + OpenVINO bundle with a 16-row VocabTrim
    self-draft), exported once for the tests below, which only read it."""
    pytest.importorskip("llama_cpp", reason="quantizing a GGUF needs llama-cpp-python")
    b = zoo.bundle("gemma3", None, formats=("gguf",), target_precision="int8")
    src = b / load_bundle(b).manifest.target.formats["gguf"].file
    out = tmp_path_factory.mktemp("q8") / "b"
    return src, export_bundle(ExportConfig(output=out, target=src, formats=("onnx", "openvino"), draft_vocab=16))


def test_gguf_bundle_on_openvino_is_the_gguf_model(q8_bundle, tmp_path):
    """A Q8_0 GGUF exported to ONNX and OpenVINO: the IR keeps u8 codes, computes in fp32 (no
    dynamic int8 activations) the logits of the fp32 graph of gguf-py's dequantized weights, and on
    edgespec's OpenVINO runtime (int8 activations, as llama.cpp and onnxruntime's level 4 compute)
    picks the transcoded onnxruntime bundle's argmax."""
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime
    from edgespec.runtimes.openvino.runtime import OpenVinoRuntime

    src, out = q8_bundle
    model = read_gguf(src)
    m = load_bundle(out).manifest
    for entry in (m.target, m.draft):
        art = entry.formats["openvino"]
        assert art.precision == "int8" and art.quantization["method"] == "gguf-transcode"
        assert art.quantization["gguf_file_type"] == "Q8_0"
    ir = ov.Core().read_model(str(out / m.target.formats["openvino"].file))
    consts = [op for op in ir.get_ops() if op.get_type_name() == "Constant"]
    assert any(str(c.get_output_element_type(0)) == "<Type: 'uint8_t'>" and c.get_byte_size() >= 4096
               for c in consts)
    assert not any(str(c.get_output_element_type(0)) == "<Type: 'float32'>" and c.get_output_partial_shape(0).rank
                   .get_length() == 2 and c.get_byte_size() >= 4096 for c in consts)  # no f32 matrix

    ids = GGUFTokenizer(open_gguf(src))(LONG_PROMPT).input_ids
    ref_path = tmp_path / "ref" / "model.onnx"
    ref_path.parent.mkdir()
    import onnx

    onnx.save_model(build_decoder(model.spec, model.dequantized(), GraphOptions(kv_layout="append")), str(ref_path))
    exact = ov.Core().compile_model(ir, "CPU", {"INFERENCE_PRECISION_HINT": "f32",
                                                "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"})
    spec = model.spec
    logits = exact(_feeds(ids, spec.n_kv_heads, spec.head_dim, spec.n_layers))["logits"][0]
    with OnnxRuntime(ref_path) as ref, OnnxRuntime(out / m.target.formats["onnx"].file) as ort, \
            OpenVinoRuntime(out / m.target.formats["openvino"].file) as ovr:
        want = ref.forward(ids, len(ids))
        np.testing.assert_allclose(logits, want, atol=1e-4, rtol=1e-4)
        got, peer = ovr.forward(ids, len(ids)), ort.forward(ids, len(ids))
    assert (got.argmax(-1) == peer.argmax(-1)).mean() >= 0.9
    np.testing.assert_allclose(got, want, atol=0.1 * np.abs(want).max())


def test_gguf_bundle_speculative_on_openvino_equals_plain_and_onnxruntime(q8_bundle):
    """The default GGUF bundle shape (source target, VocabTrim self-draft on the target's blocks) on
    the openvino backend: the draft runs on the target's body, speculative greedy equals plain
    greedy, and every token of it is onnxruntime's argmax on the transcoded bundle, or within its
    int8-activation rounding of it (the bound test_gguf_bundle_on_openvino_is_the_gguf_model uses)."""
    from edgespec.decoding import SamplingParams
    from edgespec.engine.engine import load
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    src, out = q8_bundle
    ids = GGUFTokenizer(open_gguf(src))(LONG_PROMPT).input_ids
    n = 24
    with load(out, backend="openvino", use_draft=False) as plain, load(out, backend="openvino") as spec:
        outs = []
        for engine in (plain, spec):
            tokens = list(ids)
            for _ in engine.stream_ids(tokens, SamplingParams(), n):
                pass
            outs.append(tokens[len(ids):])
        assert spec.shared_body and spec.last_stats.drafted > 0
    assert outs[0] == outs[1]
    m = load_bundle(out).manifest
    # the random model may pick a stop id before n tokens: which step does depends on the CPU's
    # kernels (it did at token 23 on an AVX-512 EPYC, not on an AVX2 one)
    assert len(outs[0]) == n or (0 < len(outs[0]) < n and outs[0][-1] in m.tokenizer.stop_token_ids)
    n = len(outs[0])
    with OnnxRuntime(out / m.target.formats["onnx"].file) as ort:
        logits = ort.forward(ids + outs[0][:-1], n)  # the positions predicting each generated token
    picked = logits[np.arange(n), outs[0]]
    assert (picked >= logits.max(-1) - 0.1 * np.abs(logits).max()).all()
