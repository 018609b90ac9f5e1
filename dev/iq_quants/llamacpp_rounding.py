"""Does llama.cpp's own activation rounding explain the greedy gap? An ONNX graph that emulates it.

llama.cpp's CPU kernels round the activation row to the weight type's `vec_dot_type` before the
integer dot products (ggml-cpu's type_traits_cpu):
  Q8_0 (Q4_0, Q5_0, Q8_0, IQ4_NL): blocks of 32; on x86 (quantize_row_q8_0, AVX path) amax of the
      block, id = 127/amax, q = round-half-even(x*id), d = amax/127 stored as fp16.
  Q8_1 (Q4_1, Q5_1): the same q and d, plus s = fp16(d * sum(q)) which multiplies the weight's
      block minimum (d here the fp32 value, before its fp16 storage).
  Q8_K (Q2_K..Q6_K, IQ4_XS): blocks of 256 (quantize_row_q8_K_ref on x86, the repacked kernels'
      quantize_mat_q8_K_4x8 rounds alike): iscale = -127/max (max the signed element of largest
      magnitude), q = nearest_int(iscale*x) (half-even), d = 1/iscale kept as fp32.
This script takes the file's ONNX export (edgespec's transcoded blocks), replaces every weight product
by a fake-quantization of its activation that reproduces the weight's vec_dot_type (ONNX ops:
Reshape, Abs, ReduceMax, Div, Mul, Round, Cast to FLOAT16 and back) and an fp32 MatMul with the
file's blocks dequantized exactly by gguf-py; the embedding lookup is untouched (llama.cpp's
get_rows dequantizes without rounding). It then decodes the held-out prompts greedily and counts the
tokens before the first difference from llama-cpp-python on the same file.

Variants (--variants): llamacpp (the emulation above), none (fp32 weights, no activation rounding),
q8_0 (every product rounded as Q8_0: 32-blocks, fp16 scale, whatever the weight type), fp32scale
(as llamacpp but the Q8_0/Q8_1 scale kept in fp32), awayround (as llamacpp but rounding half away
from zero, as the scalar reference's roundf).

    python dev/iq_quants/llamacpp_rounding.py [--types Q4_K_M,IQ4_XS,IQ4_NL,Q3_K_M,Q2_K] [--tokens 64]
        [--variants llamacpp] [--kv f32,f16,plain] [--work DIR] [--out dev/results/iq_quants_llamacpp_rounding.md]
        [--keep] [--check]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from exact_agreement import files_for  # noqa: E402
from heldout_agreement import export, first_difference, llama_cpp  # noqa: E402

from edgespec.bench.suites import encode_prompt, load_prompts  # noqa: E402
from edgespec.bundle import load_bundle  # noqa: E402
from edgespec.tokenizer import Tokenizer  # noqa: E402

# ggml-cpu type_traits_cpu: the activation format each weight type's dot product reads
VEC_DOT = {"F32": "F32", "Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0", "IQ4_NL": "Q8_0", "Q4_1": "Q8_1",
           "Q5_1": "Q8_1", "Q2_K": "Q8_K", "Q3_K": "Q8_K", "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K",
           "IQ4_XS": "Q8_K"}
# bytes per block and where the fp16 minimum sits, for the types whose product adds m * s
MIN_BLOCKS = {"Q4_1": 20, "Q5_1": 24}
# edgespec's fused or single projection -> the GGUF tensors it concatenates along its outputs
PARTS = {"qkv_proj": ("attn_q", "attn_k", "attn_v"), "q_proj": ("attn_q",), "k_proj": ("attn_k",),
         "v_proj": ("attn_v",), "o_proj": ("attn_output",), "gate_up_proj": ("ffn_gate", "ffn_up"),
         "gate_proj": ("ffn_gate",), "up_proj": ("ffn_up",), "down_proj": ("ffn_down",)}
VARIANTS = ("llamacpp", "none", "q8_0", "fp32scale", "awayround")


def gguf_parts(prefix: str) -> list[str]:
    if prefix == "model.embed_tokens.weight":
        return ["token_embd.weight"]
    _, _, layer, proj = prefix.split(".")
    return [f"blk.{layer}.{p}.weight" for p in PARTS[proj]]


def tensors_of(path: Path) -> dict:
    from gguf import GGUFReader

    return {t.name: t for t in GGUFReader(str(path)).tensors}


def dense(t) -> np.ndarray:
    """(rows, K) float32: gguf-py's dequantization of the tensor's blocks."""
    from gguf.quants import dequantize

    return dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1, int(t.shape[0]))


def split_min(t) -> tuple[np.ndarray, np.ndarray]:
    """For a Q4_1/Q5_1 tensor: (d*q without the minimum, (rows, K/32) block minima), both exact."""
    from gguf.quants import dequantize

    raw = np.array(t.data, dtype=np.uint8).reshape(-1, MIN_BLOCKS[t.tensor_type.name])
    mins = raw[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(-1, int(t.shape[0]) // 32)
    raw[:, 2:4] = 0
    codes = dequantize(raw.reshape(np.array(t.data).shape), t.tensor_type).astype(np.float32)
    return codes.reshape(-1, int(t.shape[0])), mins


class Builder:
    """Adds the nodes and initializers of the fake-quantizations to a graph."""

    def __init__(self, graph, variant: str):
        self.graph, self.variant, self.n, self.nodes = graph, variant, 0, []

    def name(self, what: str) -> str:
        self.n += 1
        return f"llq_{what}_{self.n}"

    def const(self, value, dtype=np.float32) -> str:
        from onnx import numpy_helper

        name = self.name("c")
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        from onnx import helper

        out = self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def round(self, x: str) -> str:
        if self.variant != "awayround":
            return self.op("Round", [x])  # half to even, as _mm256_round_ps(_MM_ROUND_NEAREST) and nearest_int
        half = self.op("Add", [self.op("Abs", [x]), self.const(0.5)])
        return self.op("Mul", [self.op("Sign", [x]), self.op("Floor", [half])])

    def fake_quant(self, x: str, k: int, fmt: str) -> tuple[str, str | None]:
        """(x rounded as `fmt` and dequantized, fp32 of s = fp16(d*sum(q)) per 32-block for Q8_1)."""
        if fmt == "F32" or self.variant == "none":
            return x, None
        if self.variant == "q8_0":
            fmt = "Q8_1" if fmt == "Q8_1" else "Q8_0"
        block = 256 if fmt == "Q8_K" else 32
        shape = self.op("Shape", [x])
        xb = self.op("Reshape", [x, self.const([-1, k // block, block], np.int64)])
        amax = self.op("ReduceMax", [self.op("Abs", [xb]), self.const([-1], np.int64)], keepdims=1)
        live = self.op("Greater", [amax, self.const(0.0)])
        inv = self.op("Where", [live, self.op("Div", [self.const(127.0), amax]), self.const(0.0)])
        q = self.round(self.op("Mul", [xb, inv]))
        if fmt == "Q8_K":
            # d = 1/iscale in fp32; the sign of max cancels between q and d
            d = self.op("Where", [live, self.op("Reciprocal", [inv]), self.const(0.0)])
        else:
            d = self.op("Div", [amax, self.const(127.0)])
        stored = d
        if fmt in ("Q8_0", "Q8_1") and self.variant != "fp32scale":
            stored = self.op("Cast", [self.op("Cast", [d], to=10)], to=1)  # FLOAT16 and back
        xq = self.op("Reshape", [self.op("Mul", [q, stored]), shape])
        if fmt != "Q8_1":
            return xq, None
        s = self.op("Mul", [d, self.op("ReduceSum", [q, self.const([-1], np.int64)], keepdims=1)])
        if self.variant != "fp32scale":
            s = self.op("Cast", [self.op("Cast", [s], to=10)], to=1)
        lead = self.op("Slice", [shape, self.const([0], np.int64), self.const([-1], np.int64)])
        target = self.op("Concat", [lead, self.const([k // 32], np.int64)], axis=0)
        return xq, self.op("Reshape", [s, target])


def weights_for(prefix: str, tensors: dict) -> tuple[np.ndarray, np.ndarray | None, str]:
    """(W (K, N) without Q8_1-paired minima, (K/32, N) minima or None, the activation format)."""
    parts = [tensors[n] for n in gguf_parts(prefix)]
    fmts = {VEC_DOT[t.tensor_type.name] for t in parts}
    # Q8_0 and Q8_1 round q and d alike; a product mixing them shares one rounded activation
    if len(fmts - {"Q8_0", "Q8_1"}) and len(fmts) > 1:
        raise SystemExit(f"{prefix}: parts read different activation formats {fmts}")
    cols, mins = [], []
    for t in parts:
        if t.tensor_type.name in MIN_BLOCKS:
            c, m = split_min(t)
        else:
            c, m = dense(t), np.zeros((int(np.prod(t.shape)) // int(t.shape[0]), int(t.shape[0]) // 32), np.float32)
        cols.append(c)
        mins.append(m)
    fmt = "Q8_1" if "Q8_1" in fmts else fmts.pop()
    has_min = any(t.tensor_type.name in MIN_BLOCKS for t in parts)
    return (np.ascontiguousarray(np.concatenate(cols).T), np.ascontiguousarray(np.concatenate(mins).T) if has_min
            else None, fmt)


def emulate(onnx_path: Path, gguf: Path, out: Path, variant: str, only: tuple[str, ...] = ()) -> dict:
    """Write `out` (+ .data): `onnx_path` with every MatMulNBits replaced as the module says (`only`:
    round the activations of the products whose name holds one of these only)."""
    import onnx

    if out.exists():
        return json.loads(out.with_suffix(".json").read_text())
    model = onnx.load(str(onnx_path))
    g = model.graph
    tensors = tensors_of(gguf)
    prod = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    b = Builder(g, variant)
    drop, formats = set(), {}
    for n in list(g.node):
        if n.op_type != "MatMulNBits":
            continue
        prefix = n.input[1].removesuffix(".codes")
        k = next(a.i for a in n.attribute if a.name == "K")
        w, mins, fmt = weights_for(prefix, tensors)
        assert w.shape[0] == k, (prefix, w.shape, k)
        formats[prefix] = fmt
        final = n.output[0]
        users = consumers.get(final, [])
        # K-quant minima: out = MatMulNBits(x) - MatMul(ReduceSum(blocks of x), mins); w holds both
        sub = next((u for u in users if u.op_type == "Sub" and u.input[0] == final
                    and prod[u.input[1]].op_type == "MatMul" and prod[u.input[1]].input[1] == f"{prefix}.mins"), None)
        if sub is not None:
            drop.add(id(sub))
            final = sub.output[0]
        drop.add(id(n))
        xq, s = b.fake_quant(n.input[0], k, fmt) if not only or any(o in prefix for o in only) else (n.input[0], None)
        if mins is not None and s is None:  # no rounding: the minima go back into the weights
            w, mins = w + np.repeat(mins, 32, axis=0), None
        wname = b.const(w)
        y = b.op("MatMul", [xq, wname])
        if mins is not None:
            y = b.op("Add", [y, b.op("MatMul", [s, b.const(mins)])])
        b.nodes[-1].output[0] = final
    kept = [n for n in g.node if id(n) not in drop] + b.nodes
    needed = {o.name for o in g.output}
    live = []
    for n in reversed(topo(kept, {i.name for i in g.input} | {t.name for t in g.initializer})):
        if any(o in needed for o in n.output):
            live.append(n)
            needed.update(i for i in n.input if i)
    live.reverse()
    del g.node[:]
    g.node.extend(live)
    used = {i for n in live for i in n.input}
    keep = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(out), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=out.name + ".data", size_threshold=1024)
    info = {"formats": formats, "bytes": out.stat().st_size + (out.parent / (out.name + ".data")).stat().st_size}
    out.with_suffix(".json").write_text(json.dumps(info, indent=1))
    return info


def topo(nodes: list, known: set[str]) -> list:
    """`nodes` in an order where each node's inputs come first (the new ones were appended last)."""
    known, order, pending = set(known), [], list(nodes)
    while pending:
        rest = []
        for n in pending:
            if all((not i) or i in known for i in n.input):
                order.append(n)
                known.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            raise SystemExit(f"graph has {len(rest)} nodes with unknown inputs, e.g. {rest[0].name}")
        pending = rest
    return order


def ggml_mul_mat(t, x: np.ndarray) -> np.ndarray:
    """ggml's own CPU mul_mat of the GGUF tensor `t` (its raw blocks) and x (rows, K) -> (rows, N),
    through llama-cpp-python's libggml (plain kernels: no extra buffer types in a bare context)."""
    import ctypes as C

    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib"
    base = C.CDLL(str(lib / "libggml-base.so"), mode=C.RTLD_GLOBAL)
    cpu = C.CDLL(str(lib / "libggml-cpu.so"), mode=C.RTLD_GLOBAL)

    class InitParams(C.Structure):
        _fields_ = [("mem_size", C.c_size_t), ("mem_buffer", C.c_void_p), ("no_alloc", C.c_bool)]

    vp = C.c_void_p
    for fn, res, args in [("ggml_init", vp, [InitParams]),
                          ("ggml_new_tensor_2d", vp, [vp, C.c_int, C.c_int64, C.c_int64]),
                          ("ggml_get_data", vp, [vp]), ("ggml_nbytes", C.c_size_t, [vp]),
                          ("ggml_mul_mat", vp, [vp, vp, vp]), ("ggml_new_graph", vp, [vp]),
                          ("ggml_build_forward_expand", None, [vp, vp]), ("ggml_free", None, [vp])]:
        getattr(base, fn).restype, getattr(base, fn).argtypes = res, args
    cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, C.c_int]
    cpu.ggml_cpu_init()
    k = int(t.shape[0])
    n = int(np.prod(t.shape)) // k
    ctx = base.ggml_init(InitParams(64 * k * n + 64 * x.size + (1 << 24), None, False))
    try:
        w = base.ggml_new_tensor_2d(ctx, int(t.tensor_type), k, n)
        raw = np.ascontiguousarray(np.array(t.data).view(np.uint8))
        assert raw.nbytes == base.ggml_nbytes(w)
        C.memmove(base.ggml_get_data(w), raw.ctypes.data, raw.nbytes)
        xa = np.ascontiguousarray(x, dtype=np.float32)
        xt = base.ggml_new_tensor_2d(ctx, 0, k, xa.shape[0])
        C.memmove(base.ggml_get_data(xt), xa.ctypes.data, xa.nbytes)
        y = base.ggml_mul_mat(ctx, w, xt)
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, y)
        cpu.ggml_graph_compute_with_ctx(ctx, graph, 1)
        return np.ctypeslib.as_array(C.cast(base.ggml_get_data(y), C.POINTER(C.c_float)), (xa.shape[0], n)).copy()
    finally:
        base.ggml_free(ctx)


def check_products(gguf: Path, rows: int = 5, seed: int = 0) -> list[tuple[str, str, float, float]]:
    """Per weight type in `gguf`: (tensor, type, max |ggml - emulation|, max |ggml - exact product|), each
    relative to mean |ggml|, on activations with heavy-tailed channels (the emulation is one graph node
    set per product, run by onnxruntime)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    rng, seen, out = np.random.default_rng(seed), set(), []
    for t in tensors_of(gguf).values():
        kind = t.tensor_type.name
        if len(t.shape) < 2 or kind in seen or kind not in VEC_DOT or kind == "F32":
            continue
        seen.add(kind)
        k = int(t.shape[0])
        x = (rng.standard_normal((rows, k)) * np.exp(rng.standard_normal(k))).astype(np.float32)
        g = helper.make_graph([], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])], [])
        b = Builder(g, "llamacpp")
        xq, s = b.fake_quant("x", k, VEC_DOT[kind])
        g.node.extend(b.nodes)
        for o in [xq] + ([s] if s else []):
            g.output.append(helper.make_tensor_value_info(o, TensorProto.FLOAT, None))
        got = ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
                                   .SerializeToString()).run(None, {"x": x})
        w, mins = split_min(t) if kind in MIN_BLOCKS else (dense(t), None)
        emulated = got[0] @ w.T + (got[1] @ mins.T if mins is not None else 0)
        exact = x @ (w + np.repeat(mins, 32, axis=1) if mins is not None else w).T
        ref = ggml_mul_mat(t, x)
        scale = float(np.abs(ref).mean())
        out.append((t.name, kind, float(np.abs(ref - emulated).max()) / scale,
                    float(np.abs(ref - exact).max()) / scale))
    return out


def decode(path: Path, prompts: list[list[int]], n: int, threads: int) -> tuple[list[list[int]], float]:
    """Greedy ids, one forward a token (as heldout_agreement.ours), and the one-token forwards' tok/s."""
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    outs, spent, steps = [], 0.0, 0
    with OnnxRuntime(path, threads=threads) as rt:
        for ids in prompts:
            rt.trim(0)
            got = [int(np.argmax(rt.forward(ids, 1)[-1]))]
            while len(got) < n:
                t = time.perf_counter()
                logits = rt.forward(got[-1:], 1)
                spent += time.perf_counter() - t
                steps += 1
                got.append(int(np.argmax(logits[-1])))
            outs.append(got)
    return outs, steps / spent if spent else 0.0


def llama_cpp_norepack(src: Path, prompts: list[list[int]], n: int, threads: int) -> list[list[int]]:
    """llama_cpp(..., f32_kv=True) with llama.cpp's extra buffer types off: no repacked weights, every
    product through the plain vec_dot kernels (the ones this emulation was checked against)."""
    import llama_cpp as lc

    default = lc.llama_cpp.llama_model_default_params

    def plain():
        params = default()
        params.use_extra_bufts = False
        return params

    lc.llama.llama_cpp.llama_model_default_params = plain
    try:
        return llama_cpp(src, prompts, n, True, threads)
    finally:
        lc.llama.llama_cpp.llama_model_default_params = default


def cached(path: Path, make):
    if path.exists():
        return json.loads(path.read_text())
    value = make()
    path.write_text(json.dumps(value))
    return value


def load_avg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_K_M,IQ4_XS,IQ4_NL,Q3_K_M,Q2_K")
    ap.add_argument("--variants", default="llamacpp")
    ap.add_argument("--kv", default="f32,f16,plain", help="llama.cpp runs to compare with: F32 KV cache, F16 "
                    "KV cache (its default), F32 KV cache without repacked weights (plain)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "edgespec-exact-agreement")
    ap.add_argument("--out", type=Path, default=ROOT / "dev" / "results" / "iq_quants_llamacpp_rounding.md")
    ap.add_argument("--keep", action="store_true", help="keep the emulated graphs (about 1.3 GB each)")
    ap.add_argument("--check", action="store_true", help="only compare each weight type's emulated product "
                    "with ggml's own mul_mat, and print it")
    args = ap.parse_args()
    if args.check:
        for name in [t.strip() for t in args.types.split(",") if t.strip()]:
            for row in check_products(files_for(name, args.work)[0]):
                print(name, *row[:2], f"ggml vs emulation {row[2]:.1e}", f"ggml vs exact product {row[3]:.1e}")
        return
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variant {bad[0]!r} (available: {', '.join(VARIANTS)})")
    kvs = [k for k in args.kv.split(",") if k]
    prompts = load_prompts(str(ROOT / "benchmarks" / "data" / "heldout.jsonl"))
    ids = tok = None
    store = args.work / f"{args.out.stem}.json"  # per-prompt counts, kept beside the files, not in the tree
    results = json.loads(store.read_text()) if store.exists() else {}
    t0 = time.perf_counter()
    for name in [t.strip() for t in args.types.split(",") if t.strip()]:
        q, _ = files_for(name, args.work)
        bundle = export(q, args.work / f"{name}.bundle")
        if tok is None:
            b = load_bundle(bundle)
            tok = Tokenizer(bundle / b.manifest.tokenizer.file, b.manifest.tokenizer)
            ids = [encode_prompt(tok, p) for p in prompts]
        onnx_path = bundle / load_bundle(bundle).manifest.target.formats["onnx"].file
        cache = args.work / f"{name}.ids-{args.tokens}"
        refs = {kv: cached(Path(f"{cache}.llama-{kv}.json"),
                           lambda kv=kv, q=q, ids=ids: llama_cpp_norepack(q, ids, args.tokens, args.threads)
                           if kv == "plain" else llama_cpp(q, ids, args.tokens, kv == "f32", args.threads))
                for kv in kvs}
        row = results.setdefault(name, {})
        if "plain" in kvs and "f32" in kvs:  # llama.cpp against itself, only its kernels' layout changed
            row["llama.cpp plain"] = {"tok_s": 0.0, "bytes": q.stat().st_size,
                                      **{kv: [first_difference(a, r) for a, r in zip(refs["plain"], refs[kv])]
                                         for kv in kvs if kv != "plain"}}
        today = cached(Path(f"{cache}.today.json"),
                       lambda p=onnx_path, ids=ids: list(decode(p, ids, args.tokens, args.threads)))
        row["today"] = {"tok_s": today[1], "bytes": onnx_path.stat().st_size
                        + (onnx_path.parent / (onnx_path.name + ".data")).stat().st_size,
                        **{kv: [first_difference(a, r) for a, r in zip(today[0], refs[kv])] for kv in kvs}}
        print(name, "today", {kv: statistics.median(row["today"][kv]) for kv in kvs}, flush=True)
        for variant in variants:
            out = args.work / f"{name}-{variant}" / "model.onnx"
            info = emulate(onnx_path, q, out, variant)
            load = load_avg()
            got, tps = decode(out, ids, args.tokens, args.threads)
            row[variant] = {"tok_s": tps, "load": load, "bytes": info["bytes"],
                            "formats": sorted(set(info["formats"].values())),
                            **{kv: [first_difference(a, r) for a, r in zip(got, refs[kv])] for kv in kvs}}
            print(name, variant, {kv: statistics.median(row[variant][kv]) for kv in kvs}, f"{tps:.1f} tok/s",
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            if not args.keep:
                for f in out.parent.iterdir():
                    f.unlink()
                out.parent.rmdir()
            store.write_text(json.dumps(results, indent=1))
    write_report(args, prompts, results, kvs)


def cell(r: list[int]) -> str:
    return f"{statistics.median(r):g} ({statistics.mean(r):.1f})"


def write_report(args, prompts, results: dict, kvs: list[str]) -> None:
    kvs = [kv for kv in ("f32", "f16", "plain") if any(kv in r for row in results.values() for r in row.values())]
    exact = {}
    src = ROOT / "dev" / "results" / "iq_quants_exact.md"
    for line in src.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0] in results:
            exact[cells[0]] = cells[1:]
    label = {"f32": "llama.cpp F32 KV", "f16": "llama.cpp F16 KV", "plain": "llama.cpp F32 KV, no repack"}
    head = "| type | graph | " + " | ".join(f"vs {label[kv]}: median (mean)" for kv in kvs)
    lines = [head + " | tok/s (load) | MB |", "| --- | --- |" + " --- |" * (len(kvs) + 2)]
    for name, row in results.items():
        for graph, r in row.items():
            if not any(kv in r for kv in kvs):
                continue
            speed = f"{r['tok_s']:.1f}" + (f" ({r['load']})" if "load" in r else "") if r["tok_s"] else "–"
            lines.append(f"| {name} | {graph} | " + " | ".join(cell(r[kv]) if kv in r else "" for kv in kvs)
                         + f" | {speed} | {r['bytes'] / 1e6:.0f} |")
    text = args.out.read_text() if args.out.exists() else ""
    marker = "<!-- table -->"
    table = "\n".join(lines)
    if marker in text:
        pre, _, post = text.partition(marker)
        _, _, post = post.partition(marker)
        text = f"{pre}{marker}\n{table}\n{marker}{post}"
    else:
        text = f"{marker}\n{table}\n{marker}\n"
    args.out.write_text(text)
    print(table)
    print("exact-product columns for reference:", exact)


if __name__ == "__main__":
    main()
