"""Would a tree verify round like a chain here? (issue 23, tree verification: measured first)

    python dev/tree_rows.py [--trials 200] [--threads 2] [--out dev/results/tree_rows.json]

A tree verify scores every node of a draft tree in one forward: each node's row attends to the
cached prefix and to its own ancestors, the other nodes masked out. Lossless greedy decoding
needs the accepted path's rows to be the bits a chain verify (the path alone, keys contiguous)
or a one-token forward would give: the engine's exactness probe demands exactly that of every
verify width it allows (docs/exactness.md). In a tree, a path node's key sits at the node's
place in the flattened tree, with masked siblings between the keys it reads, so the softmax's
sum and the probabilities-times-values product read the same numbers at other places.

This builds the exported decoder's attention as onnxruntime runs it (scores as two 128-deep
products, Gemma 3's head_dim 256, summed; the additive mask; Softmax; probabilities times
values; 4 query heads on one KV head as rows; float32, the CPU provider) and, for random
prefixes of 5-300 keys and random trees of 6-16 nodes, compares each path node's output row with
the same row in the chain layout, for three tree layouts:
  masked    one key matrix for the whole tree, non-ancestors masked (what GPU frameworks do);
  softmax   scores as in `masked`, each row's gathered into chain order (prefix, ancestors, the
            rest masked after them) for the softmax, scattered back for one shared
            probabilities-times-values product: cheap, only the products reorder;
  gathered  each node's rows read keys and values of their own in chain order: exact by
            construction if trailing masked keys change no bits (the probe's chain verifies
            rely on the same), but it copies the prefix's keys and values per node.
Reports per layout the fraction of rows that are bit-identical and the largest difference, and
what one layer's attention costs in each.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

HEAD_DIM, Q_HEADS = 256, 4
NEG = float(np.finfo(np.float32).min)  # the exporter's additive mask value
LAYOUTS = ("masked", "softmax", "gathered")


def _scores(node, last: int, swap: list[int]) -> list:
    """q, k -> s: the exported graph's scores, two 128-deep products summed."""
    return [node("Split", ["q", "half"], ["q0", "q1"], axis=last),
            node("Split", ["k", "half"], ["k0", "k1"], axis=last),
            node("Transpose", ["k0"], ["k0t"], perm=swap), node("Transpose", ["k1"], ["k1t"], perm=swap),
            node("MatMul", ["q0", "k0t"], ["s0"]), node("MatMul", ["q1", "k1t"], ["s1"]),
            node("Add", ["s0", "s1"], ["s"])]


def attention_session(layout: str, threads: int):
    """onnxruntime session of one layout: q (R, 256), k (T, 256), v (T, 256), mask (R, T) [and
    idx (R, T): chain position -> tree column, for `softmax`] -> out (R, 256); `gathered` has a
    leading node axis on every input and output."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    node, f = helper.make_node, TensorProto.FLOAT
    lead = ["N"] if layout == "gathered" else []
    nodes = _scores(node, *((2, [0, 2, 1]) if lead else (1, [1, 0])))
    if layout == "softmax":
        nodes += [node("GatherElements", ["s", "idx"], ["g"], axis=1), node("Add", ["g", "mask"], ["sm"]),
                  node("Softmax", ["sm"], ["pc"], axis=-1), node("Mul", ["s", "zero"], ["z"]),
                  node("ScatterElements", ["z", "idx", "pc"], ["p"], axis=1)]
    else:
        nodes += [node("Add", ["s", "mask"], ["sm"]), node("Softmax", ["sm"], ["p"], axis=-1)]
    nodes.append(node("MatMul", ["p", "v"], ["out"]))
    dims = {"q": ["R", HEAD_DIM], "k": ["T", HEAD_DIM], "v": ["T", HEAD_DIM], "mask": ["R", "T"]}
    inputs = [helper.make_tensor_value_info(n, f, lead + d) for n, d in dims.items()]
    if layout == "softmax":
        inputs.append(helper.make_tensor_value_info("idx", TensorProto.INT64, ["R", "T"]))
    graph = helper.make_graph(nodes, "attention", inputs, [helper.make_tensor_value_info("out", f, lead + dims["q"])],
                              [numpy_helper.from_array(np.array([HEAD_DIM // 2] * 2, np.int64), "half"),
                               numpy_helper.from_array(np.float32(0), "zero")])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def random_tree(rng, n: int) -> np.ndarray:
    """parent[i] < i for i >= 1 (parent[0] = -1): nodes in the flattened order a tree verify feeds."""
    return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])


def ancestors(parent: np.ndarray, i: int) -> list[int]:
    """Root to node i, both included."""
    path = []
    while i >= 0:
        path.append(i)
        i = parent[i]
    return path[::-1]


def feeds(layout: str, prefix: int, parent: np.ndarray, q, k, v) -> dict:
    """The inputs of `layout` for a tree of len(parent) nodes after `prefix` cached keys."""
    n, t = len(parent), prefix + len(parent)
    rows = lambda a: np.repeat(a, Q_HEADS, axis=0)  # noqa: E731  (4 query heads per node, as the export stacks them)
    mask = np.full((n, t), NEG, np.float32)
    order = np.zeros((n, t), np.int64)  # chain position -> tree column
    for i in range(n):
        anc = [prefix + a for a in ancestors(parent, i)]
        if layout == "masked":
            mask[i, :prefix] = 0
            mask[i, anc] = 0
        else:
            order[i] = list(range(prefix)) + anc + [c for c in range(prefix, t) if c not in anc]
            mask[i, :prefix + len(anc)] = 0
    if layout == "masked":
        return {"q": rows(q), "k": k, "v": v, "mask": rows(mask)}
    if layout == "softmax":
        return {"q": rows(q), "k": k, "v": v, "mask": rows(mask), "idx": rows(order)}
    return {"q": np.repeat(q[:, None], Q_HEADS, axis=1), "k": k[order], "v": v[order],
            "mask": np.repeat(mask[:, None], Q_HEADS, axis=1)}


def trial(sessions: dict, chain, rng) -> dict[str, tuple[int, int, float]]:
    """Per layout: (path rows compared, rows bit-identical to the chain's, largest difference),
    for one random prefix and tree."""
    prefix, n = int(rng.integers(5, 301)), int(rng.integers(6, 17))
    parent = random_tree(rng, n)
    path = ancestors(parent, int(rng.integers(1, n)))  # the accepted path: root to a random node
    k = rng.standard_normal((prefix + n, HEAD_DIM)).astype(np.float32) * 0.6
    v = rng.standard_normal((prefix + n, HEAD_DIM)).astype(np.float32)
    q = rng.standard_normal((n, HEAD_DIM)).astype(np.float32) * 0.6
    keep, d = list(range(prefix)) + [prefix + a for a in path], len(path)
    cmask = np.zeros((d, prefix + d), np.float32)
    cmask[:, prefix:] = np.where(np.tril(np.ones((d, d), bool)), 0, NEG)
    want = chain.run(None, {"q": np.repeat(q[path], Q_HEADS, axis=0), "k": k[keep], "v": v[keep],
                            "mask": np.repeat(cmask, Q_HEADS, axis=0)})[0]
    out = {}
    for layout, sess in sessions.items():
        got = sess.run(None, feeds(layout, prefix, parent, q, k, v))[0].reshape(n, Q_HEADS, HEAD_DIM)
        got = got[path].reshape(-1, HEAD_DIM)
        same = (got == want).all(axis=1)
        out[layout] = (len(same), int(same.sum()), float(np.abs(got - want).max()))
    return out


def cost_ms(sessions: dict, prefix: int, n: int, repeat: int = 30) -> dict[str, float]:
    """Median ms of one layer's tree attention per layout, a random tree of n nodes, alternated."""
    rng = np.random.default_rng(1)
    parent = random_tree(rng, n)
    k = rng.standard_normal((prefix + n, HEAD_DIM)).astype(np.float32)
    q = rng.standard_normal((n, HEAD_DIM)).astype(np.float32)
    fed = {layout: feeds(layout, prefix, parent, q, k, k) for layout in sessions}  # prepared untimed
    ms: dict[str, list[float]] = {layout: [] for layout in sessions}
    for _ in range(repeat):
        for layout, sess in sessions.items():
            t0 = time.perf_counter()
            sess.run(None, fed[layout])
            ms[layout].append(1e3 * (time.perf_counter() - t0))
    return {layout: round(float(np.median(v)), 3) for layout, v in ms.items()}


def main() -> None:
    from edgespec.bench.machine import library_versions, machine_info

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "tree_rows.json")
    args = ap.parse_args()
    sessions = {layout: attention_session(layout, args.threads) for layout in LAYOUTS}
    chain, rng = sessions["masked"], np.random.default_rng(0)  # a chain is the masked layout of a path
    totals = {layout: [0, 0, 0.0, 0] for layout in LAYOUTS}  # rows, identical, worst, trees all identical
    for _ in range(args.trials):
        for layout, (r, s, w) in trial(sessions, chain, rng).items():
            t = totals[layout]
            t[:] = [t[0] + r, t[1] + s, max(t[2], w), t[3] + (r == s)]
    out = {"bench": "tree_rows", "machine": machine_info(), "libraries": library_versions(), "threads": args.threads,
           "trials": args.trials,
           "layouts": {layout: {"path_rows": r, "bit_identical_rows": s, "bit_identical_fraction": round(s / r, 4),
                                "trees_all_rows_identical": t, "max_abs_difference": w}
                       for layout, (r, s, w, t) in totals.items()},
           "ms_per_layer": {f"prefix {p}, {n} nodes": cost_ms(sessions, p, n)
                            for p in (64, 256, 1024) for n in (8, 16)}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k not in ("machine", "libraries")}, indent=1))


if __name__ == "__main__":
    main()
