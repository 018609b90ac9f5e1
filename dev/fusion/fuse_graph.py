"""Fuse more of the default bundle's per-row operators at load, probe the result's exactness and
time it against the bundle's own graph, interleaved in one process. A dev/ experiment, not a
product path: the bundle is left as it is, the variant written to a temporary folder.

    python dev/fusion/fuse_graph.py [BUNDLE] [--variants "mins;bsnh,sum;mins,bsnh,sum"] [--probe-width 17]
                                    [--reach 1024] [--probe-skip bundle] [--no-probe] [--no-timings]
                                    [--rounds 7] [--reps 15] [--out dev/results/fusion.json]

The bundle's fused graph (exporters/onnx/fused.py) already names onnxruntime's RMSNorm,
residual-add-and-RMSNorm, FastGelu and RotaryEmbedding kernels and one MatMulNBits over q/k/v and
over gate/up. What stays between them, per layer, and what each pass takes away:

mins   A Q4_K product is MatMulNBits(x) - (block sums of x) @ mins, then the sandwich norm:
       Sub and SimplifiedLayerNormalization become one SkipSimplifiedLayerNormalization of
       MatMulNBits(x) and (block sums) @ (-mins) (a + (-b) is a - b bit for bit; the negated
       table is constant-folded at load): two kernels a Q4_K product less one.
bsnh   RotaryEmbedding on (1, S, heads * hd) rows as the projection writes them instead of
       (1, heads, S, hd): no Transpose before it (q and k) nor after it (k, whose rows leave as
       `new_key`); the query rows then stack position-major (row s * rep + h, the row mask tiled
       alike), so attention's output is already (1, S, heads * hd) and its Transpose goes too:
       four Transposes a layer less, and the rows each product sees are the same.
sum    The two 128-deep score slices and the mask added by one Sum instead of two Adds.

For each variant: the largest logit difference from the bundle's graph over a short greedy run,
the exactness probe (runtimes/exactness.probe, widths 2..--probe-width, sampled starts up to
--reach keys), then the step's time: the bundle's graph and each variant in one process on
onnxruntime's process-wide pool (as `edgespec` runs them), interleaved round by round: a plain
step (1 row) and verifies of 2, 4 and 8 rows after 64 and 512 positions, and the draft's one-row
forward (its graph rewritten alike), the variants' order alternating from round to round.
Medians over rounds of the per-round medians, with the spread (min-max of the round medians)
and the paired ratio to the bundle's graph. A process's sessions can run a few percent faster or
slower as a whole than the same graph in another process: compare several processes' ratios
(dev/results/fusion.md).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edgespec.bench.machine import cpu_model
from edgespec.runtimes import exactness
from edgespec.runtimes.onnxruntime.pool import share_threads
from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

MS = "com.microsoft"
DEFAULT_BUNDLE = Path.home() / ".cache/edgespec/bundles/gemma3-270m-r4"


# ---------------------------------------------------------------- graph surgery

class Graph:
    """A model's node list with producer/consumer look-ups and inline int64 constants."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.nodes = list(model.graph.node)
        self.consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
                       if not t.external_data and t.data_type == onnx.TensorProto.INT64}
        self._n = 0

    def producer(self, name: str):
        return next((n for n in self.nodes if name in n.output), None)

    def consumers(self, name: str) -> list:
        return [n for n in self.nodes if name in n.input]

    def const(self, values) -> str:
        self._n += 1
        name = f"fusion_c{self._n}"
        self.model.graph.initializer.append(numpy_helper.from_array(np.asarray(values, np.int64), name))
        self.consts[name] = np.asarray(values, np.int64)
        return name

    def ints(self, name: str) -> list[int] | None:
        return self.consts[name].ravel().tolist() if name in self.consts else None

    def fresh(self, hint: str) -> str:
        self._n += 1
        return f"fusion_{hint}_{self._n}"

    def replace(self, old, new: list) -> None:
        i = self.nodes.index(old)
        self.nodes[i:i + 1] = new

    def finish(self) -> onnx.ModelProto:
        outputs = {o.name for o in self.model.graph.output}
        while True:  # drop nodes nothing reads
            read = {i for n in self.nodes for i in n.input} | outputs
            keep = [n for n in self.nodes if any(o in read for o in n.output)]
            if len(keep) == len(self.nodes):
                break
            self.nodes = keep
        del self.model.graph.node[:]
        self.model.graph.node.extend(self.nodes)
        used = {i for n in self.nodes for i in n.input}
        inits = [t for t in self.model.graph.initializer if t.name in used]
        del self.model.graph.initializer[:]
        self.model.graph.initializer.extend(inits)
        return self.model


def _attr(node, name: str, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def fuse_mins(g: Graph) -> int:
    """Sub(MatMulNBits(x), MatMul(sums, mins)) -> SimplifiedLayerNormalization as one
    SkipSimplifiedLayerNormalization(MatMulNBits(x), MatMul(sums, Neg(mins)))."""
    count = 0
    for sub in [n for n in g.nodes if n.op_type == "Sub"]:
        corr = g.producer(sub.input[1])
        readers = g.consumers(sub.output[0])
        if corr is None or corr.op_type != "MatMul" or not corr.input[1].endswith(".mins"):
            continue
        if len(readers) != 1 or readers[0].op_type != "SimplifiedLayerNormalization":
            continue
        norm = readers[0]
        neg = g.fresh("neg_mins")
        g.replace(corr, [helper.make_node("Neg", [corr.input[1]], [neg], name=g.fresh("n")),
                         helper.make_node("MatMul", [corr.input[0], neg], list(corr.output), name=g.fresh("n"))])
        g.replace(norm, [helper.make_node(
            "SkipSimplifiedLayerNormalization", [sub.input[0], sub.input[1], norm.input[1]], [norm.output[0]],
            name=g.fresh("n"), domain=MS, epsilon=_attr(norm, "epsilon", 1e-5))])
        g.nodes.remove(sub)
        count += 1
    return count


def _rotary_chains(g: Graph) -> list[tuple]:
    """(Transpose in, RotaryEmbedding, its one reader) for every rotary of (1, heads, S, hd) rows."""
    out = []
    for rot in [n for n in g.nodes if n.op_type == "RotaryEmbedding"]:
        tin = g.producer(rot.input[0])
        readers = g.consumers(rot.output[0])
        if tin is None or tin.op_type != "Transpose" or list(_attr(tin, "perm")) != [0, 2, 1, 3] or len(readers) != 1:
            return []
        out.append((tin, rot, readers[0]))
    return out


def _output_chains(g: Graph) -> list[tuple]:
    """(MatMul(probs, values), the Reshape to (1, S, heads * hd)) of every attention whose output
    goes Reshape, Reshape, Transpose(0, 2, 1, 3), Reshape."""
    out = []
    for mm in [n for n in g.nodes if n.op_type == "MatMul"]:
        p = g.producer(mm.input[0])
        if p is None or p.op_type != "Softmax":
            continue
        chain, cur = [], mm
        for op in ("Reshape", "Reshape", "Transpose", "Reshape"):
            readers = g.consumers(cur.output[0])
            if len(readers) != 1 or readers[0].op_type != op:
                return []
            cur = readers[0]
            chain.append(cur)
        out.append((mm, chain[-1]))
    return out


def _head_size(g: Graph, tin) -> int:
    """The head size of the rows a rotary reads: Reshape(projection, [1, -1, heads, hd]), its norm, Transpose."""
    norm = g.producer(tin.input[0])
    shape = g.producer(norm.input[0]) if norm is not None else None
    if shape is None or shape.op_type != "Reshape" or not g.ints(shape.input[1]):
        raise SystemExit("bsnh: a rotary's rows are not a per-head norm of a projection's reshape")
    return g.ints(shape.input[1])[-1]


def fuse_bsnh(g: Graph) -> int:
    """RotaryEmbedding on (1, S, heads * hd), query rows stacked position-major (module docstring)."""
    rotaries, outputs = _rotary_chains(g), _output_chains(g)
    tiles = [n for n in g.nodes if n.op_type == "Tile" and (g.ints(n.input[1]) or [0, 0])[1:] == [1]]
    if not rotaries or len(outputs) * 2 != len(rotaries) or not tiles:
        raise SystemExit("bsnh: the graph is not the fused append graph this pass knows")
    for tin, rot, reader in rotaries:
        flat, rows = g.fresh("rows"), g.fresh("rot")
        hd = _head_size(g, tin)
        new = [helper.make_node("Reshape", [tin.input[0], g.const([0, 0, -1])], [flat], name=g.fresh("n")),
               helper.make_node("RotaryEmbedding", [flat, *rot.input[1:]], [rows], name=g.fresh("n"), domain=MS)]
        if reader.op_type == "Transpose":  # k: its rows leave as new_key (1, S, kvh, hd)
            new.append(helper.make_node("Reshape", [rows, g.const([0, 0, -1, hd])], list(reader.output),
                                        name=g.fresh("n")))
            g.nodes.remove(reader)
        else:  # q: Reshape to (1, kvh, rows, hd): the same shape, rows now position-major
            if reader.op_type != "Reshape" or (g.ints(reader.input[1]) or [0, 0])[1] != 1:
                raise SystemExit("bsnh: written for one KV head (several would need their Transpose back)")
            new.append(helper.make_node("Reshape", [rows, reader.input[1]], list(reader.output), name=g.fresh("n")))
            g.nodes.remove(reader)
        g.replace(rot, new)
        g.nodes.remove(tin)
    for mm, last in outputs:
        last.input[0] = mm.output[0]
    for tile in tiles:  # (S, T) -> (S * rep, T), row s * rep + h
        rep = g.ints(tile.input[1])[0]
        a, b = g.fresh("mask"), g.fresh("mask")
        g.replace(tile, [
            helper.make_node("Unsqueeze", [tile.input[0], g.const([1])], [a], name=g.fresh("n")),
            helper.make_node("Tile", [a, g.const([1, rep, 1])], [b], name=g.fresh("n")),
            helper.make_node("Flatten", [b], list(tile.output), name=g.fresh("n"), axis=2)])
    return len(rotaries)


def fuse_sum(g: Graph) -> int:
    """Add(Add(a, b), mask) before a Softmax -> Sum(a, b, mask)."""
    count = 0
    for add in [n for n in g.nodes if n.op_type == "Add"]:
        inner = g.producer(add.input[0])
        readers = g.consumers(add.output[0])
        if inner is None or inner.op_type != "Add" or len(readers) != 1 or readers[0].op_type != "Softmax":
            continue
        if len(g.consumers(inner.output[0])) != 1:
            continue
        g.replace(add, [helper.make_node("Sum", [*inner.input, add.input[1]], list(add.output), name=g.fresh("n"))])
        g.nodes.remove(inner)
        count += 1
    return count


PASSES = {"mins": fuse_mins, "bsnh": fuse_bsnh, "sum": fuse_sum}


def _node_count(path: Path) -> int:
    return len(onnx.load(str(path), load_external_data=False).graph.node)


def _link(src: Path, dst: Path) -> None:
    """A hard link (the runtime refuses weights linked from outside a model's folder), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def write_variant(bundle: Path, out: Path, passes: list[str]) -> dict:
    """The bundle's target and draft graphs rewritten by `passes` into out/target, out/draft (their
    weights hard-linked from the bundle); returns what each pass changed."""
    changed = {}
    for part in ("target", "draft"):
        model = onnx.load(str(bundle / part / "model.onnx"), load_external_data=False)
        g = Graph(model)
        changed[part] = {p: PASSES[p](g) for p in passes}
        model = g.finish()
        changed[part]["nodes"] = len(model.graph.node)
        (out / part).mkdir(parents=True, exist_ok=True)
        onnx.save(model, str(out / part / "model.onnx"))
        for f in (bundle / part).iterdir():
            if f.name != "model.onnx" and not (out / part / f.name).exists():
                _link(f, out / part / f.name)
    return changed


# ---------------------------------------------------------------- measurement

def _ids(n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(7).integers(16, vocab, size=n)]


def logit_diff(ref: OnnxRuntime, rt: OnnxRuntime, steps: int = 48) -> dict:
    """The largest |logit| difference and argmax agreement over a prompt's prefill and a greedy run."""
    worst, same = 0.0, 0
    prompt = _ids(40, ref.vocab_size)
    for r in (ref, rt):
        r.reset()
    a = np.array(ref.forward(prompt, 1)[-1])
    b = np.array(rt.forward(prompt, 1)[-1])
    for _ in range(steps):
        worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - b))))
        same += int(a.argmax() == b.argmax())
        tok = int(a.argmax())
        a, b = np.array(ref.forward([tok], 1)[-1]), np.array(rt.forward([tok], 1)[-1])
    for r in (ref, rt):
        r.reset()
    return {"max_abs_diff": worst, "argmax_agree": f"{same}/{steps}"}


def _prefill(rt: OnnxRuntime, ids: list[int], n: int) -> None:
    rt.reset()
    for i in range(0, n, 128):
        rt.forward(ids[i:min(n, i + 128)], 1)


def _timed(rt: OnnxRuntime, ids: list[int], past: int, width: int, reps: int) -> float:
    """Median ms of `reps` forwards of `width` rows after `past` positions (trimmed back each time)."""
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        rt.forward(ids[past:past + width], width)
        times.append(time.perf_counter() - t0)
        rt.trim(past)
    return statistics.median(times[2:]) * 1e3


def timings(runtimes: dict[str, dict[str, OnnxRuntime]], contexts, widths, rounds: int, reps: int) -> list[dict]:
    """Per (model, past, width): each variant's round medians, interleaved variant by variant."""
    rows = []
    for part, rts in runtimes.items():
        ids = _ids(max(contexts) + max(widths) + 1, next(iter(rts.values())).vocab_size)
        for past in contexts:
            for rt in rts.values():
                _prefill(rt, ids, past)
            for width in (widths if part == "target" else (1,)):
                per = {name: [] for name in rts}
                for r in range(rounds):  # the order alternates, so no variant always runs first
                    for name, rt in (list(rts.items()) if r % 2 == 0 else list(rts.items())[::-1]):
                        per[name].append(_timed(rt, ids, past, width, reps))
                rows.append({"model": part, "past": past, "width": width, **_summary(per)})
    return rows


def _summary(per: dict[str, list[float]]) -> dict:
    base = per["bundle"]
    out = {}
    for name, ms in per.items():
        ratios = [m / b for m, b in zip(ms, base)]
        out[name] = {"ms": round(statistics.median(ms), 3), "min": round(min(ms), 3), "max": round(max(ms), 3),
                     "ratio": round(statistics.median(ratios), 4),
                     "ratio_range": [round(min(ratios), 4), round(max(ratios), 4)],
                     "rounds_ms": [round(m, 3) for m in ms]}
    return out


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?", type=Path, default=DEFAULT_BUNDLE)
    ap.add_argument("--variants", default="mins;bsnh,sum;mins,bsnh,sum",
                    help="';'-separated variants, each a ','-separated list of passes")
    ap.add_argument("--probe-width", type=int, default=17)
    ap.add_argument("--reach", type=int, default=1024, help="sampled probe starts up to this many keys (0: none)")
    ap.add_argument("--no-probe", action="store_true")
    ap.add_argument("--probe-skip", default="", help="','-separated variants not to probe (e.g. bundle)")
    ap.add_argument("--no-timings", action="store_true")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--contexts", default="64,512")
    ap.add_argument("--widths", default="1,2,4,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("dev/results/fusion.json"))
    return ap.parse_args()


def _write_variants(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, Path], dict]:
    """({variant: bundle folder}, the report's start: CPU, node counts and what each pass changed)."""
    folders = {"bundle": args.bundle}
    doc = {"cpu": cpu_model(), "threads": args.threads, "bundle": args.bundle.name, "variants": {},
           "passes": {"bundle": {part: {"nodes": _node_count(args.bundle / part / "model.onnx")}
                                 for part in ("target", "draft")}}}
    for spec in args.variants.split(";"):
        folders[spec] = tmp / spec.replace(",", "+")
        doc["passes"][spec] = write_variant(args.bundle, folders[spec], spec.split(","))
        print(spec, doc["passes"][spec], flush=True)
    return folders, doc


def _check(targets: dict[str, OnnxRuntime], args: argparse.Namespace, doc: dict) -> None:
    """Each variant's logits against the bundle's graph, and the exactness probe of each."""
    for name, rt in targets.items():
        entry = doc["variants"].setdefault(name, {})
        if name != "bundle":
            entry["vs_bundle"] = logit_diff(targets["bundle"], rt)
        if not args.no_probe and name not in args.probe_skip.split(","):
            sampled = None if args.reach else ()
            ex = exactness.probe(rt, args.probe_width, threads=args.threads, sampled=sampled, reach=args.reach or 128)
            entry["probe"] = {"exact": list(ex.exact), "exact_width": ex.exact_width, "worst_diff": ex.worst_diff,
                              "reach": ex.reach, "ms": ex.probe_ms}
        print(name, entry, flush=True)


def main() -> int:
    args = _args()
    share_threads()  # every session on one process-wide pool that spins between runs, as `edgespec` runs
    tmp = Path(tempfile.mkdtemp(prefix="edgespec-fusion-"))
    try:
        folders, doc = _write_variants(args, tmp)
        open_rt = lambda folder, part: OnnxRuntime(folder / part / "model.onnx", threads=args.threads)  # noqa: E731
        targets = {name: open_rt(f, "target") for name, f in folders.items()}
        _check(targets, args, doc)
        if not args.no_timings:
            drafts = {name: open_rt(f, "draft") for name, f in folders.items()}
            contexts = [int(c) for c in args.contexts.split(",")]
            widths = [int(w) for w in args.widths.split(",")]
            doc["timings"] = timings({"target": targets, "draft": drafts}, contexts, widths, args.rounds, args.reps)
            doc["load_average"] = os.getloadavg()
            for row in doc["timings"]:
                print(row["model"], row["past"], row["width"],
                      {k: (v["ms"], v["ratio"], v["ratio_range"]) for k, v in row.items() if isinstance(v, dict)})
    finally:
        shutil.rmtree(tmp)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print("written", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
