"""Write a decoder-only transformer as an ONNX graph, straight from its weights.

Why not optimum's exporter: only transformers >= 5.23 reads the default GGUF (and its
tokenizer) correctly, while optimum-onnx pins transformers < 4.58. Building the graph
from the weights that transformers loaded keeps one transformers version, gives us the
KV layout the runtime wants (the past in, only the new rows out, logits only for the last
`n_logits` positions), and stores a tied embedding once (Gather and Gemm share it).

Two KV layouts, GraphOptions.kv_layout:

"append" (the default; what `edgespec export` writes for onnxruntime): the cache is sequence-major
and the graph returns only the new positions:
  input_ids (1, S) int64, n_logits (1,) int64, past_key_<i>/past_value_<i> (1, P, kvh, hd)
  → logits (1, n_logits, V), new_key_<i>/new_value_<i> (1, S, kvh, hd)
so a runtime can keep one preallocated (capacity, kvh, hd) buffer per tensor, bind its
prefix as the past and write the new rows straight after it (no growth, no copies). In a model
with sliding-window and full-attention layers, a sliding layer's past may be bound shorter than
the others: it then holds the last positions only, from kv_start = P - its length on (P: a full
layer's past), and a runtime binds the part of the cache the window can see (GraphOptions.window_keys,
the metadata says which layers), so their attention costs the same at every context length. A
caller that binds every past whole gets the same model attending over the whole cache.

"buffer" (what the OpenVINO export writes; every size is a shape, no size is a value, so the graph
can be reshaped to fixed sizes for an NPU):
  input_ids (1, S), position_ids (1, S), attention_mask (1, P+S) int64, logits_index (N,) int64,
  past_key_<i>/past_value_<i> (1, kvh, P, hd) — a KV buffer whose slot j holds position j
  → logits (1, N, V), new_key_<i>/new_value_<i> (1, kvh, S, hd) — only the new rows
The caller owns the buffer: it writes the new rows at their positions and rolls back by
masking slots out (attention_mask 0) instead of reallocating.

The first layout, past/present (the cache grew by concatenation, present_key_<i> out), is no longer
written; runtimes refuse such a graph with the fix (export the bundle again).

GraphOptions(fused_ops) writes onnxruntime's fused kernels (onnx/fused.py; on for the append layout,
off for the buffer layout OpenVINO reads): the same I/O, far fewer kernels per forward.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..gguf.deferred import pick_rows, shallow_copy
from ..gguf.source import split_fused
from ..gguf.transcode import BlockWeight
from ..spec import ModelSpec
from .external import ExternalData
from .fused import rotary
from .masks import buffer_positions_and_masks, positions_and_masks, window_align
from .moe import is_moe, moe_mlp
from .ops import _G, _activation, _add_norm, _linear, _linears, _norm, _rope, _softcap
from .tree import tree_attention, tree_context, tree_input_infos

__all__ = ["GraphOptions", "build_decoder", "OPSET", "KV_LAYOUTS"]

logger = logging.getLogger(__name__)
OPSET = 21
SCORE_DEPTH = 128  # deepest attention-score product onnxruntime sums the same way at every key count (_scores)
KV_LAYOUTS = ("append", "buffer")


@dataclass(frozen=True)
class GraphOptions:
    layers: tuple[int, ...] | None = None  # keep only these decoder layers (layer-cut drafts)
    vocab_keep: np.ndarray | None = None  # target ids of a trimmed LM head (VocabTrim)
    tie_head: bool = True  # reuse the embedding for the head when the model ties them
    weight_dtype: str = "fp32"  # "fp16" stores weights in half precision, computes in fp32
    # "append": sequence-major past (1, P, kvh, hd) in, only the new rows out (see _append_kv);
    # "buffer": the static-shape layout described above (OpenVINO)
    kv_layout: str = "append"
    # MatMulNBits' accuracy_level for BlockWeight (GGUF-transcoded) weights: 0 computes in fp32,
    # 4 lets the CPU kernels quantize activations to int8 per block (faster, not bit-faithful)
    nbits_accuracy: int = 0
    # keep 4-bit float zero points (Q4_K, Q4_1) as MatMulNBits inputs: OpenVINO's compressed weights
    # take them as they are; onnxruntime's CPU kernels run them on a far slower path (onnx/blocks.kernel_form)
    nbits_float_zero_points: bool = False
    # onnxruntime's fused kernels (onnx/fused.py: com.microsoft ops OpenVINO does not read);
    # None: on for the "append" layout, the one only onnxruntime runs
    fused_ops: bool | None = None
    # tree verification (onnx/tree.py): tree_path/tree_depth inputs, attention summed in blocks at
    # absolute positions so a tree's rows round as a chain's; onnxruntime's fused append graph only
    tree: bool = False
    # sliding-window layers may be bound only the keys their window can see (a shorter past), so
    # their cost stays flat as the context grows; None: on for the append layout without `tree`
    # (the buffer layout and the tree graph attend over the whole cache and mask)
    window_keys: bool | None = None
    # the position a runtime aligns a sliding past's start to, recorded in the metadata; None: masks.window_align
    window_align: int | None = None

    def __post_init__(self) -> None:
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        if self.fused and (self.kv_layout == "buffer" or self.nbits_float_zero_points):
            raise ValueError("fused_ops are onnxruntime's kernels; the buffer layout and float zero points are "
                             "OpenVINO's graph: give fused_ops=False")
        if self.window_keys and (self.kv_layout == "buffer" or self.tree):
            raise ValueError("window_keys is written for the append layout without tree verification")
        if self.window_align is not None and self.window_align < 1:
            raise ValueError(f"window_align must be >= 1, got {self.window_align}")

    @property
    def fused(self) -> bool:
        return self.kv_layout == "append" if self.fused_ops is None else self.fused_ops

    @property
    def windowed(self) -> bool:
        return self.kv_layout == "append" and not self.tree if self.window_keys is None else self.window_keys


def _attention(g: _G, spec: ModelSpec, w, p: str, h: str, li: int, past: tuple[str, str], ctx: dict,
               kv_names: tuple[str, str] | None = None):
    """Self-attention of layer `li` over its cache `past`; returns (output, k, v): the append
    layout's new rows, the buffer layout's past and new rows (onnx/graph._kv_outputs keeps the new).
    `kv_names`: the graph outputs the append layout's new rows are written to (the fused graph:
    v's rows leave as the projection gives them, never transposed)."""
    hd, H, KVH = spec.head_dim, spec.n_heads, spec.n_kv_heads
    fused = ctx["fused"]
    q, k, v = _linears(g, h, w, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], p,
                       "qkv_proj" if fused else None)
    q = g.op("Reshape", [q, g.const([1, -1, H, hd], dtype=np.int64)])  # (1, S, H, hd)
    k = g.op("Reshape", [k, g.const([1, -1, KVH, hd], dtype=np.int64)])
    v = g.op("Reshape", [v, g.const([1, -1, KVH, hd], dtype=np.int64)], out=kv_names[1] if kv_names else None)
    scaled = fused and p + "self_attn.q_norm.weight" in w  # the query scale folded into q_norm's weight
    if p + "self_attn.q_norm.weight" in w:  # per-head q/k norm (Gemma 3, Qwen 3)
        q = _norm(g, spec, q, w[p + "self_attn.q_norm.weight"], p + "q_norm", fused,
                  spec.query_scale if scaled else 1.0)
        k = _norm(g, spec, k, w[p + "self_attn.k_norm.weight"], p + "k_norm", fused)
    q = g.op("Transpose", [q], perm=[0, 2, 1, 3])  # (1, H, S, hd)
    k = g.op("Transpose", [k], perm=[0, 2, 1, 3])
    v = v if kv_names else g.op("Transpose", [v], perm=[0, 2, 1, 3])
    lt = spec.layer_types[li]
    cos, sin = ctx["rope"][lt]
    if fused:
        q, k = (rotary(g, t, ctx["rope_positions"], cos, sin) for t in (q, k))
    else:
        q, k = _rope(g, q, cos, sin, hd // 2), _rope(g, k, cos, sin, hd // 2)
    if ctx["append"]:
        keys, values, out_k, out_v = _append_kv(g, past, k, v, KVH, kv_names)
    else:  # the buffer layout: heads-major (1, KVH, T, hd)
        keys = out_k = g.op("Concat", [past[0], k], axis=2)
        values = out_v = g.op("Concat", [past[1], v], axis=2)
    if "score_index" in ctx:  # the tree graph (onnx/tree.py)
        out = tree_attention(g, spec, q, keys, values, ctx["row_mask"][lt], ctx,
                             lambda rows, keys: _softcap(g, _scores(g, rows, keys, hd), spec.attn_logit_softcap),
                             scaled)
        return _linear(g, out, w[p + "self_attn.o_proj.weight"], p + "o_proj"), out_k, out_v
    if ctx["append"]:
        mask = ctx["row_mask"][lt] if fused else ctx["mask"][lt]
        return _attention_rows(g, spec, w, p, q, keys, values, mask, fused, scaled), out_k, out_v
    out = _grouped_attention(g, spec, q, keys, values, ctx["mask"][lt])
    return _linear(g, out, w[p + "self_attn.o_proj.weight"], p + "o_proj"), out_k, out_v


def _grouped_attention(g: _G, spec: ModelSpec, q: str, k: str, v: str, mask: str) -> str:
    """The buffer layout's attention (OpenVINO's graph): q (1, H, S, hd), k and v (1, KVH, T, hd)
    -> (1, S, H * hd), before o_proj."""
    hd, H, KVH = spec.head_dim, spec.n_heads, spec.n_kv_heads
    rep = H // KVH
    # Group query heads under their KV head so MatMul broadcasts instead of copying K/V.
    q5 = g.op("Reshape", [q, g.const([1, KVH, rep, -1, hd], dtype=np.int64)])  # (1, KVH, rep, S, hd)
    k5 = g.op("Unsqueeze", [k, g.const([2], dtype=np.int64)])  # (1, KVH, 1, T, hd)
    v5 = g.op("Unsqueeze", [v, g.const([2], dtype=np.int64)])
    q5 = g.op("Mul", [q5, g.const(spec.query_scale, dtype=np.float32)])
    scores = g.op("MatMul", [q5, g.op("Transpose", [k5], perm=[0, 1, 2, 4, 3])])  # (1, KVH, rep, S, T)
    scores = _softcap(g, scores, spec.attn_logit_softcap)
    scores = g.op("Add", [scores, mask])
    probs = g.op("Softmax", [scores], axis=-1)
    out = g.op("MatMul", [probs, v5])  # (1, KVH, rep, S, hd)
    out = g.op("Reshape", [out, g.const([1, H, -1, hd], dtype=np.int64)])
    out = g.op("Transpose", [out], perm=[0, 2, 1, 3])
    return g.op("Reshape", [out, g.const([1, -1, H * hd], dtype=np.int64)])


def _attention_rows(g: _G, spec: ModelSpec, w, p: str, q: str, k: str, v: str, mask: str,
                    row_mask: bool = False, scaled: bool = False) -> str:
    """Attention whose score and value MatMuls never see a single query row (onnxruntime's path).

    onnxruntime multiplies a one-row left matrix with another kernel than a taller one (on AVX2
    and AVX-512 alike: 1e-7 apart), so one-token decodes would round unlike a verify of several
    tokens. Here each KV head's query heads are stacked as the rows of one MatMul (rep * S rows),
    and a model with one query head per KV head (rep = 1) stacks its queries twice, so a
    one-token forward multiplies two rows, as a verify's taller matrix does row by row.
    q (1, H, S, hd) (already times the query scale if `scaled`); k, v (1, KVH, T, hd) -> (1, S, H * hd),
    then o_proj. `row_mask`: `mask` is already one row per score row (1, 1, R, T), tiled once per
    forward, so the scores need no reshape around the mask in every layer."""
    hd, H, KVH = spec.head_dim, spec.n_heads, spec.n_kv_heads
    rep = H // KVH
    copies = 2 if rep == 1 else 1
    if not scaled:
        q = g.op("Mul", [q, g.const(spec.query_scale, dtype=np.float32)])
    if copies == 2:
        q = g.op("Concat", [q, q], axis=2)  # (1, H, 2S, hd)
    rows = g.op("Reshape", [q, g.const([1, KVH, -1, hd], dtype=np.int64)])  # (1, KVH, rep*copies*S, hd)
    scores = _softcap(g, _scores(g, rows, k, hd), spec.attn_logit_softcap)  # (1, KVH, R, T)
    if row_mask:
        probs = g.op("Softmax", [g.op("Add", [scores, mask])], axis=-1)
    else:
        T = g.op("Shape", [k], start=2, end=3)
        # (1, KVH, rep*copies, S, T): the mask broadcasts over each head's rows
        scores = g.op("Reshape", [scores, g.op("Concat", [g.const([1, KVH, rep * copies, -1], dtype=np.int64), T],
                                               axis=0)])
        probs = g.op("Softmax", [g.op("Add", [scores, mask])], axis=-1)
        probs = g.op("Reshape", [probs, g.op("Concat", [g.const([1, KVH, -1], dtype=np.int64), T], axis=0)])
    out = g.op("MatMul", [probs, v])  # (1, KVH, R, hd)
    out = g.op("Reshape", [out, g.const([1, KVH * rep, copies, -1, hd], dtype=np.int64)])  # (1, H, copies, S, hd)
    if copies == 2:
        out = g.op("Gather", [out, g.const(0, dtype=np.int64)], axis=2)  # the first copy: (1, H, S, hd)
    else:
        out = g.op("Reshape", [out, g.const([1, H, -1, hd], dtype=np.int64)])
    out = g.op("Transpose", [out], perm=[0, 2, 1, 3])
    out = g.op("Reshape", [out, g.const([1, -1, H * hd], dtype=np.int64)])
    return _linear(g, out, w[p + "self_attn.o_proj.weight"], p + "o_proj")


def _scores(g: _G, rows: str, k: str, hd: int) -> str:
    """rows (1, KVH, R, hd) @ k (1, KVH, T, hd) transposed: (1, KVH, R, T), as products of depth
    at most SCORE_DEPTH added up.

    onnxruntime's SGEMM (MLAS) sums a product deeper than 128 in one pass or in 128-deep pieces
    depending on how many output columns each of its threads takes, which follows T. A score row
    computed beside T keys and beside T + 1 (a verify's later, masked keys) then rounds apart at a
    few T (which ones depends on the head size and the thread count), and a greedy verify
    there can pick another token than plain decoding. A product of depth 128 or less is always
    one pass, at every T and thread count measured (1-8), so deeper heads are summed in slices."""
    if hd <= SCORE_DEPTH:
        return g.op("MatMul", [rows, g.op("Transpose", [k], perm=[0, 1, 3, 2])])
    depths = [min(SCORE_DEPTH, hd - i) for i in range(0, hd, SCORE_DEPTH)]
    sizes, n = g.const(depths, dtype=np.int64), len(depths)
    qs, ks = g.op("Split", [rows, sizes], n_out=n, axis=3), g.op("Split", [k, sizes], n_out=n, axis=3)
    out = None
    for q_part, k_part in zip(qs, ks):
        part = g.op("MatMul", [q_part, g.op("Transpose", [k_part], perm=[0, 1, 3, 2])])
        out = part if out is None else g.op("Add", [out, part])
    return out


def _to_heads_major(g: _G, x: str, kvh: int) -> str:
    """(1, T, kvh, hd) -> (1, kvh, T, hd); a free Reshape when there is one KV head."""
    if kvh == 1:
        return g.op("Reshape", [x, g.const([1, 1, -1, 0], dtype=np.int64)])
    return g.op("Transpose", [x], perm=[0, 2, 1, 3])


def _append_kv(g: _G, past: tuple[str, str], k: str, v: str, kvh: int, names: tuple[str, str] | None = None):
    """Sequence-major cache: attend over past + new, output only the new rows (1, S, kvh, hd).
    k, v: (1, kvh, S, hd); with `names` (the graph's outputs, written without an Identity kernel
    each) v is already the new rows, named names[1].

    Returns (keys, values): past and new, in the (1, kvh, T, hd) layout attention uses, and the outputs."""
    new_k = g.op("Transpose", [k], perm=[0, 2, 1, 3], out=names[0] if names else None)  # (1, S, kvh, hd)
    new_v = v if names else g.op("Transpose", [v], perm=[0, 2, 1, 3])
    keys = _to_heads_major(g, g.op("Concat", [past[0], new_k], axis=1), kvh)
    values = _to_heads_major(g, g.op("Concat", [past[1], new_v], axis=1), kvh)
    return keys, values, new_k, new_v


def build_decoder(
    spec: ModelSpec,
    weights: dict[str, np.ndarray],
    options: GraphOptions = GraphOptions(),
    progress: Callable[[int], None] | None = None,
    data: ExternalData | None = None,
) -> onnx.ModelProto:
    """Return the ONNX model for `spec` with `weights` (HF names: float32 numpy arrays or GGUF
    blocks). With `data`, each initializer's bytes go to that external data file as the graph is
    built (onnx/external.py), so only the tensor being written is in memory: save the returned
    graph with external.save_streamed, beside it."""
    w = shallow_copy(weights)  # split_fused renames entries; nothing is read from the file for it
    layers = options.layers if options.layers is not None else tuple(range(spec.n_layers))
    if options.tree and not (options.kv_layout == "append" and options.fused):
        # checked here, not in GraphOptions: writers set the layout on options built without it
        raise ValueError("tree verification is written for onnxruntime's fused append graph")
    g = _G(options.weight_dtype, data)
    g.nbits_accuracy, g.float_zero_points = options.nbits_accuracy, options.nbits_float_zero_points
    g.fused = options.fused
    n_vocab = len(options.vocab_keep) if options.vocab_keep is not None else spec.vocab_size
    inputs, past = _graph_inputs(spec, options, len(layers))
    ctx = _context(g, spec, options, past, _window_layers(spec, options, layers))
    x, emb_name = _embed(g, spec, w)
    residual = None  # the last residual branch, added by the next norm (one fused kernel)
    for j, li in enumerate(layers):
        x, residual = _layer(g, spec, w, li, x, residual, past[j], ctx, (f"new_key_{j}", f"new_value_{j}"))
        if progress:
            progress(1)
    x, _ = _add_norm(g, spec, x, residual, w["model.norm.weight"], "model.norm", options.fused)
    _lm_head(g, spec, w, options, _head_rows(g, spec, x, options.kv_layout == "buffer"), emb_name)
    graph = helper.make_graph(g.nodes, "edgespec_decoder", inputs, _graph_outputs(spec, options, len(layers), n_vocab),
                              initializer=g.inits)
    opsets = [helper.make_opsetid("", OPSET)]
    if any(n.domain == "com.microsoft" for n in g.nodes):
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="edgespec")
    model.ir_version = 10
    helper.set_model_props(model, _shape_metadata(spec, w, layers, n_vocab, options))
    return model


def _graph_inputs(spec: ModelSpec, options: GraphOptions, n_layers: int) -> tuple[list, list[tuple[str, str]]]:
    """The graph's inputs (module docstring) and the (past key, past value) names of each kept layer."""
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "S"])]
    if options.kv_layout == "buffer":
        inputs += [helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "S"]),
                   helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, "T"]),
                   helper.make_tensor_value_info("logits_index", TensorProto.INT64, ["N"])]
        kv_shape = [1, spec.n_kv_heads, "P", spec.head_dim]
    else:
        inputs.append(helper.make_tensor_value_info("n_logits", TensorProto.INT64, [1]))
        kv_shape = [1, "P", spec.n_kv_heads, spec.head_dim]
    past = [(f"past_key_{j}", f"past_value_{j}") for j in range(n_layers)]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, kv_shape) for pair in past for n in pair]
    if options.tree:
        inputs += tree_input_infos()
    return inputs, past


def _graph_outputs(spec: ModelSpec, options: GraphOptions, n_layers: int, n_vocab: int) -> list:
    """logits, then only the new KV rows of each kept layer, in the layout's order of axes."""
    if options.kv_layout == "buffer":
        kv_shape = [1, spec.n_kv_heads, "S", spec.head_dim]
    else:
        kv_shape = [1, "S", spec.n_kv_heads, spec.head_dim]
    return [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "N", n_vocab])] + [
        helper.make_tensor_value_info(f"new_{n}_{j}", TensorProto.FLOAT, kv_shape)
        for j in range(n_layers) for n in ("key", "value")]


def _window_layers(spec: ModelSpec, options: GraphOptions, layers) -> tuple[int, ...]:
    """The graph's layers (indices among the kept ones) whose pasts a runtime may bind shorter: the
    sliding ones, where a full-attention layer is kept too (its past says where the context ends)."""
    if not (options.windowed and spec.sliding_window):
        return ()
    sliding = tuple(j for j, li in enumerate(layers) if spec.layer_types[li] == "sliding_attention")
    return sliding if len(sliding) < len(layers) else ()


def _context(g: _G, spec: ModelSpec, options: GraphOptions, past: list[tuple[str, str]],
             sliding: tuple[int, ...]) -> dict:
    """Positions, masks and RoPE tables shared by every layer (onnx/masks.py, onnx/tree.py), and the
    layout's switches the layers read. `sliding`: the layers whose pasts may be bound shorter."""
    past0 = past[0][0]
    if options.kv_layout == "buffer":
        ctx = buffer_positions_and_masks(g, spec, past0)
    elif options.tree:
        ctx = tree_context(g, spec, past0, "input_ids")
    else:
        full = next(j for j in range(len(past)) if j not in sliding)
        ctx = positions_and_masks(g, spec, past[full][0], "input_ids", fused=options.fused,
                                  window_past=past[sliding[0]][0] if sliding else None)
    ctx["append"], ctx["fused"] = options.kv_layout == "append", options.fused
    return ctx


def _embed(g: _G, spec: ModelSpec, w) -> tuple[str, str | None]:
    """(the embedded input_ids (1, S, hidden), the embedding initializer a tied head shares: None
    for GGUF blocks, whose head reads the same blocks)."""
    embed = w["model.embed_tokens.weight"]
    if isinstance(embed, BlockWeight):
        emb_name = None
        x = g.gather_blocks(embed, "model.embed_tokens.weight", "input_ids")
    else:
        emb_name = g.weight(embed, "model.embed_tokens.weight")
        x = g.op("Gather", [emb_name, "input_ids"], axis=0)
    if spec.family.embed_scale:
        x = g.op("Mul", [x, g.const(np.float32(spec.hidden_size**0.5), dtype=np.float32)])
    return x, emb_name


def _layer(g: _G, spec: ModelSpec, w, li: int, x: str, residual: str | None, past: tuple[str, str], ctx: dict,
           kv_names: tuple[str, str]) -> tuple[str, str]:
    """Decoder layer `li`: (the residual stream, the MLP branch the next norm adds to it). Its new
    KV rows leave the graph as `kv_names`."""
    split_fused(w, spec, li)
    p, fused, sandwich = f"model.layers.{li}.", ctx["fused"], spec.family.sandwich_norm

    def norm(x: str, name: str) -> str:
        return _norm(g, spec, x, w[p + name + ".weight"], p + name, fused)

    h, x = _add_norm(g, spec, x, residual, w[p + "input_layernorm.weight"], p + "input_layernorm", fused)
    # the fused append graph writes its outputs straight from the attention (no Identity kernels)
    attn, pk, pv = _attention(g, spec, w, p, h, li, past, ctx, kv_names if fused and ctx["append"] else None)
    _kv_outputs(g, ctx, (pk, pv), kv_names)
    if sandwich:
        attn = norm(attn, "post_attention_layernorm")
    ff_norm = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
    h, x = _add_norm(g, spec, x, attn, w[p + ff_norm + ".weight"], p + ff_norm, fused)
    if is_moe(w, p):  # a mixture of experts (onnx/moe.py)
        mlp = moe_mlp(g, spec, w, p, h, fused)
        return x, norm(mlp, "post_feedforward_layernorm") if sandwich else mlp
    gate, up = _linears(g, h, w, ["mlp.gate_proj", "mlp.up_proj"], p, "gate_up_proj" if fused else None)
    gate = _activation(g, gate, spec.activation, fused)
    mlp = _linear(g, g.op("Mul", [gate, up]), w[p + "mlp.down_proj.weight"], p + "down_proj")
    return x, norm(mlp, "post_feedforward_layernorm") if sandwich else mlp


def _kv_outputs(g: _G, ctx: dict, kv: tuple[str, str], names: tuple[str, str]) -> None:
    """Name a layer's KV as the graph outputs `names`. The buffer layout's attention holds past and
    new rows: only the new ones leave, the caller's buffer holds the rest."""
    if not ctx["append"]:
        kv = tuple(g.op("Slice", [t, g.op("Neg", [g.op("Shape", ["input_ids"], start=1, end=2)]),
                                  g.const([np.iinfo(np.int64).max], dtype=np.int64), g.const([2], dtype=np.int64)])
                   for t in kv)
    if kv != names:
        g.nodes += [helper.make_node("Identity", [t], [n]) for t, n in zip(kv, names)]


def _head_rows(g: _G, spec: ModelSpec, x: str, buffer: bool) -> str:
    """The final hidden rows that reach the head, (N, hidden): only the last n_logits positions
    (the buffer layout: the rows logits_index names), so prefill of a long prompt stays cheap."""
    if buffer:  # a shape, not a value, picks how many rows reach the head
        x = g.op("Gather", [x, "logits_index"], axis=1)
    else:
        start = g.op("Neg", ["n_logits"])
        x = g.op("Slice", [x, start, g.const([np.iinfo(np.int64).max], dtype=np.int64), g.const([1], dtype=np.int64)])
    return g.op("Reshape", [x, g.const([-1, spec.hidden_size], dtype=np.int64)])


def _lm_head(g: _G, spec: ModelSpec, w, options: GraphOptions, x2: str, emb_name: str | None) -> None:
    """The LM head (tied, untied or VocabTrim-trimmed) and the final softcap, into the output "logits"."""
    keep = options.vocab_keep
    tied = "lm_head.weight" not in w or spec.tie_embeddings
    if tied and options.tie_head and keep is None:
        embed = w["model.embed_tokens.weight"]
        if isinstance(embed, BlockWeight):  # the same blocks as the embedding's Gather
            logits = g.matmul_nbits(x2, embed, "model.embed_tokens.weight")
        else:
            logits = g.op("Gemm", [x2, emb_name], transB=1)  # shares the embedding initializer
    else:
        key = "model.embed_tokens.weight" if tied else "lm_head.weight"
        # a trimmed head reads only its rows (from the GGUF file, where the weights are left there)
        hw = pick_rows(w, key, keep) if keep is not None else w[key]
        logits = _linear(g, x2, hw, "lm_head.weight")
    if spec.final_logit_softcap:
        cap = g.const(spec.final_logit_softcap, dtype=np.float32)
        logits = g.op("Mul", [g.op("Tanh", [g.op("Div", [logits, cap])]), cap])
    g.nodes.append(helper.make_node("Unsqueeze", [logits, g.const([0], dtype=np.int64)], ["logits"]))


def _shape_metadata(spec: ModelSpec, w, layers, n_vocab: int, options: GraphOptions) -> dict[str, str]:
    """Sizes a runtime needs to estimate its scratch memory without reading the weights."""
    gate = w.get(f"model.layers.{layers[0]}.mlp.gate_proj.weight") if layers else None
    return {"edgespec.kv_layout": options.kv_layout, "edgespec.hidden_size": str(spec.hidden_size),
            "edgespec.n_heads": str(spec.n_heads), "edgespec.n_layers": str(len(layers)),
            "edgespec.intermediate_size": str(gate.shape[0] if gate is not None else 4 * spec.hidden_size),
            "edgespec.vocab": str(n_vocab), "edgespec.tree": str(int(options.tree)),
            **_window_metadata(spec, options, layers)}


def _window_metadata(spec: ModelSpec, options: GraphOptions, layers) -> dict[str, str]:
    """What a runtime needs to bind the sliding layers' pasts shorter: the window, the alignment of
    their first position and which past_key_<j>/past_value_<j> are theirs."""
    sliding = _window_layers(spec, options, layers)
    if not sliding:
        return {}
    return {"edgespec.window": str(spec.sliding_window),
            "edgespec.window_align": str(options.window_align or window_align(spec.head_dim)),
            "edgespec.window_layers": ",".join(map(str, sliding))}
