"""Tree verification in the exported graph: one forward scores a flattened draft tree, and every row
rounds as the same position would in a chain verify or a one-token forward.

A tree's node reads the cached prefix and its own ancestors; its siblings sit between them in the
flattened input. GPU frameworks mask the siblings out of one key matrix, but on onnxruntime's CPU
kernels a zero between two keys changes how the probabilities-times-values product sums
(measured by dev/tree_rows.py: not every row stays bit-identical), and a greedy verify that rounds unlike
plain decoding is not lossless. So this graph (GraphOptions(tree=True)) computes attention the
same way for every forward, tree or not:

- the scores of each row are gathered into chain order: the prefix's keys, then the keys of the
  node's path from the root (`tree_path`), masked after the node itself, so the Softmax reads
  the row a chain would (trailing masked keys change no bits, as a chain verify relies on);
- probabilities times values is summed in blocks of BLOCK keys at absolute positions, the blocks
  added in position order (CumSum). Blocks wholly inside the prefix are one product shared by
  every node; the one or two blocks where the prefix ends are built per node from the prefix's
  last keys and the node's path. Each block is a product of depth BLOCK (one pass in MLAS at
  every row count), so a row's sum depends only on the keys at its positions, never on how they
  arrived (one token, a chain, or a tree).

Inputs beyond the usual ones: `tree_path` (G, D) int64, the node indices (within this forward)
of each node's path from the first new row, padded after the node with any index (masked); G = 1
(one path shared by every row: a chain, a prefill, a plain decode) or G = S (one per node), and
`tree_depth` (S,) int64, each new row's depth, so its position is P + depth. A chain passes
tree_path = [[0..S-1]], tree_depth = [0..S-1]. The runtime keeps the accepted path's K/V rows.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from ..spec import ModelSpec
from .masks import masks_and_rope

__all__ = ["BLOCK", "TREE_INPUTS", "tree_context", "tree_attention", "tree_input_infos"]

BLOCK = 64  # keys per block of the probabilities-times-values sum: one MLAS pass (<= 128)
TREE_INPUTS = ("tree_path", "tree_depth")
_I64 = dict(dtype=np.int64)


def tree_input_infos() -> list:
    return [helper.make_tensor_value_info("tree_path", TensorProto.INT64, ["G", "D"]),
            helper.make_tensor_value_info("tree_depth", TensorProto.INT64, ["S"])]


def _scalar(g, x: str, axis: int) -> str:
    return g.op("Gather", [g.op("Shape", [x]), g.const(axis, **_I64)])


def _vec(g, *parts: str | int) -> str:
    """A 1-D int64 shape from constants and scalars."""
    return g.op("Concat", [g.const([p], **_I64) if isinstance(p, int) else g.op("Unsqueeze", [p, g.const([0], **_I64)])
                           for p in parts], axis=0)


def tree_context(g, spec: ModelSpec, past0: str, ids: str) -> dict:
    """What every layer of the tree graph reads, computed once a forward: RoPE caches and positions
    (P + depth), per layer type the additive mask of every score row (node-major rows: row
    s * rc + c is node s), which score column each row reads in chain order, and the blocks.

    A row's chain-order columns are the prefix's keys 0..P-1, its path's keys (column P + j: the
    depth-j key), then padding up to whole blocks: nb = nA + nt blocks of BLOCK columns, nA shared
    ([0, A), A = P rounded down to BLOCK) and nt per path ([A, A + nt * BLOCK)). Column c stands
    for position c, so the causal mask also masks the path after the node and the padding."""
    rep = spec.n_heads // spec.n_kv_heads
    rc = 2 if rep == 1 else rep  # score rows per node (two copies of a lone query head: _attention_rows)
    kvh = spec.n_kv_heads
    one = g.const(1, **_I64)
    p_len, s_len = _scalar(g, past0, 1), _scalar(g, ids, 1)  # the append layout: past (1, P, kvh, hd)
    n_groups, depth_cols = _scalar(g, "tree_path", 0), _scalar(g, "tree_path", 1)
    n_shared = g.op("Div", [p_len, g.const(BLOCK, **_I64)])
    a_len = g.op("Mul", [n_shared, g.const(BLOCK, **_I64)])
    tail = g.op("Sub", [g.op("Add", [p_len, depth_cols]), a_len])  # P - A + D
    n_tail = g.op("Div", [g.op("Add", [tail, g.const(BLOCK - 1, **_I64)]), g.const(BLOCK, **_I64)])
    pad = g.op("Sub", [g.op("Mul", [n_tail, g.const(BLOCK, **_I64)]), tail])
    n_cols = g.op("Mul", [g.op("Add", [n_shared, n_tail]), g.const(BLOCK, **_I64)])
    qpos = g.op("Add", [p_len, "tree_depth"])  # (S,)
    kpos = g.op("Unsqueeze", [g.op("Range", [g.const(0, **_I64), n_cols, one]), g.const([0], **_I64)])
    qcol = g.op("Unsqueeze", [qpos, g.const([1], **_I64)])  # (S, 1)
    ctx = masks_and_rope(g, spec, qcol, kpos, g.op("LessOrEqual", [kpos, qcol]), fused=True)
    rows = g.op("Mul", [s_len, g.const(rc, **_I64)])
    node_rows = g.const([1, rc, 1], **_I64)
    row_masks = {}
    for lt, m in ctx["mask"].items():  # (1, 1, 1, S, T) -> (1, 1, S * rc, T), node-major
        m3 = g.op("Unsqueeze", [g.op("Squeeze", [m, g.const([0, 1, 2], **_I64)]), g.const([1], **_I64)])
        row_masks[lt] = g.op("Reshape", [g.op("Expand", [m3, node_rows]), _vec(g, 1, 1, rows, n_cols)])
    zero = helper.make_tensor("zero", TensorProto.INT64, [1], [0])
    zeros = g.op("ConstantOfShape", [_vec(g, n_groups, pad)], value=zero)
    # (G, D + pad): each path's keys after the P cached ones; the padding reads key 0 (masked)
    path_keys = g.op("Concat", [g.op("Add", ["tree_path", p_len]), zeros], axis=1)
    # score columns of each row: the prefix's, then its path's (masked past the node), the padding
    prefix_cols = g.op("Unsqueeze", [g.op("Range", [g.const(0, **_I64), p_len, one]), g.const([0], **_I64)])
    cols = g.op("Concat", [g.op("Expand", [prefix_cols, _vec(g, s_len, p_len)]),
                           g.op("Expand", [path_keys, _vec(g, s_len, g.op("Add", [depth_cols, pad]))])], axis=1)
    cols = g.op("Expand", [g.op("Unsqueeze", [cols, g.const([1], **_I64)]), node_rows])  # (S, rc, nb * BLOCK)
    score_index = g.op("Expand", [g.op("Reshape", [cols, _vec(g, 1, 1, rows, n_cols)]), _vec(g, 1, kvh, rows, n_cols)])
    # values of the tail blocks, per path, block-major: (nt, G, BLOCK)
    tail_prefix = g.op("Expand", [g.op("Unsqueeze", [g.op("Range", [a_len, p_len, one]), g.const([0], **_I64)]),
                                  _vec(g, n_groups, g.op("Sub", [p_len, a_len]))])
    tail_index = g.op("Concat", [tail_prefix, path_keys], axis=1)  # (G, nt * BLOCK)
    tail_index = g.op("Transpose", [g.op("Reshape", [tail_index, _vec(g, n_groups, n_tail, BLOCK)])], perm=[1, 0, 2])
    hd = spec.head_dim
    blocks = {
        "a": g.op("Unsqueeze", [a_len, g.const([0], **_I64)]),
        "probs": _vec(g, kvh, rows, g.op("Add", [n_shared, n_tail]), BLOCK),
        "split": _vec(g, n_shared, n_tail),
        "v_shared": _vec(g, kvh, n_shared, BLOCK, hd),
        "probs_tail": _vec(g, kvh, n_tail, n_groups, g.op("Div", [rows, n_groups]), BLOCK),
        "v_tail": _vec(g, kvh, n_tail, n_groups, BLOCK, hd),
        "out_tail": _vec(g, kvh, n_tail, rows, hd),
        "tail_index": tail_index,
    }
    positions = g.op("Unsqueeze", [g.op("Range", [g.const(0, **_I64), s_len, one]), g.const([0], **_I64)])
    return {**ctx, "rope_positions": positions, "row_mask": row_masks, "score_index": score_index,
            "blocks": blocks, "rows_per_node": rc}


def tree_attention(g, spec: ModelSpec, q: str, k: str, v: str, mask: str, ctx: dict, scores_of, scaled: bool) -> str:
    """q (1, H, S, hd) after RoPE; k, v (1, KVH, P+S, hd), the prefix then the new rows in input
    order -> (1, S, H * hd), before o_proj. `scores_of(rows, k)`: onnx/graph._scores."""
    hd, H, KVH = spec.head_dim, spec.n_heads, spec.n_kv_heads
    rep, rc, b = H // KVH, ctx["rows_per_node"], ctx["blocks"]
    if not scaled:
        q = g.op("Mul", [q, g.const(spec.query_scale, dtype=np.float32)])
    q = g.op("Transpose", [g.op("Reshape", [q, g.const([1, KVH, rep, -1, hd], **_I64)])], perm=[0, 1, 3, 2, 4])
    if rc != rep:  # a lone query head twice: no product ever sees a single row
        q = g.op("Concat", [q, q], axis=3)
    rows = g.op("Reshape", [q, g.const([1, KVH, -1, hd], **_I64)])  # (1, KVH, S * rc, hd), node-major
    scores = g.op("GatherElements", [scores_of(rows, k), ctx["score_index"]], axis=3)  # chain order, padded
    probs = g.op("Softmax", [g.op("Add", [scores, mask])], axis=-1)  # (1, KVH, R, nb * BLOCK)

    def reshape(x: str, shape: str) -> str:  # allowzero: a prefix shorter than a block has 0 shared blocks
        return g.op("Reshape", [x, shape], allowzero=1)

    probs = g.op("Transpose", [reshape(probs, b["probs"])], perm=[0, 2, 1, 3])  # (KVH, nb, R, BLOCK)
    ps, pt = g.op("Split", [probs, b["split"]], n_out=2, axis=1)
    vs = reshape(g.op("Slice", [v, g.const([0], **_I64), b["a"], g.const([2], **_I64)]), b["v_shared"])
    shared = g.op("MatMul", [ps, vs])  # (KVH, nA, R, hd): blocks inside the prefix, every row at once
    vt = reshape(g.op("Gather", [v, b["tail_index"]], axis=2), b["v_tail"])  # (KVH, nt, G, BLOCK, hd)
    tail = g.op("MatMul", [reshape(pt, b["probs_tail"]), vt])  # (KVH, nt, G, R/G, hd): each path's own
    # the blocks added in position order; trailing all-zero blocks add exact zeros
    summed = g.op("CumSum", [g.op("Concat", [shared, reshape(tail, b["out_tail"])], axis=1), g.const(1, **_I64)])
    out = g.op("Gather", [summed, g.const(-1, **_I64)], axis=1)  # (KVH, R, hd)
    out = g.op("Reshape", [out, g.const([KVH, -1, rc, hd], **_I64)])
    if rc != rep:
        out = g.op("Slice", [out, g.const([0], **_I64), g.const([1], **_I64), g.const([2], **_I64)])  # the first copy
    out = g.op("Transpose", [out], perm=[1, 0, 2, 3])  # (S, KVH, rep, hd): head kvh * rep + r
    return g.op("Reshape", [out, g.const([1, -1, H * hd], **_I64)])
