"""One layer's attention: edgespec's append graph (past concatenated with the new rows, scores
summed in 128-deep slices) against onnxruntime's GroupQueryAttention on a shared buffer (the new
rows written in place), Gemma 3 270M's shapes, at several context lengths.

    python dev/attention/bench_attention.py [--threads 2]

Prints median microseconds per forward of each and their ratio. Both include the o_proj product.
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from edgespec.exporters.onnx import graph as G
from edgespec.exporters.onnx.ops import _G

H, KVH, HD, HIDDEN = 4, 1, 256, 640
CAP = 2048


def _model(g, inputs, outputs):
    graph = helper.make_graph(g.nodes, "attn", inputs, outputs, initializer=g.inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    return m


def current(w):
    """edgespec's fused append attention: q (1,H,S,hd) scaled, k (1,KVH,S,hd), v (1,S,KVH,hd)."""
    g = _G("fp32")
    g.fused = True
    spec = SimpleNamespace(head_dim=HD, n_heads=H, n_kv_heads=KVH, attn_logit_softcap=None, query_scale=1.0)
    keys, values, nk, nv = G._append_kv(g, ("past_k", "past_v"), "k", "v", KVH, ("new_k", "v"))
    out = G._attention_rows(g, spec, w, "", "q", keys, values, "mask", row_mask=True, scaled=True)
    f = TensorProto.FLOAT
    ins = [helper.make_tensor_value_info(n, f, None) for n in ("q", "k", "v", "past_k", "past_v", "mask")]
    outs = [helper.make_tensor_value_info(n, f, None) for n in (out, "new_k")]
    return _model(g, ins, outs), out


def gqa(w, window: int = -1):
    g = _G("fp32")
    q = g.op("Reshape", [g.op("Transpose", ["q"], perm=[0, 2, 1, 3]), g.const([1, -1, H * HD], dtype=np.int64)])
    k = g.op("Reshape", ["k", g.const([1, -1, KVH * HD], dtype=np.int64)])
    v = g.op("Reshape", ["v", g.const([1, -1, KVH * HD], dtype=np.int64)])
    o = g.name("attn")
    g.nodes.append(helper.make_node("GroupQueryAttention", [q, k, v, "past_k", "past_v", "seqlens_k", "total"],
                                    [o, "present_k", "present_v"], domain="com.microsoft", num_heads=H,
                                    kv_num_heads=KVH, scale=1.0, local_window_size=window))
    out = G._linear(g, o, w["self_attn.o_proj.weight"], "o_proj")
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    ins = [helper.make_tensor_value_info(n, f, None) for n in ("q", "k", "v", "past_k", "past_v")]
    ins += [helper.make_tensor_value_info("seqlens_k", i32, [1]), helper.make_tensor_value_info("total", i32, [])]
    outs = [helper.make_tensor_value_info(n, f, None) for n in (out, "present_k", "present_v")]
    return _model(g, ins, outs), out


def session(model, threads):
    o = ort.SessionOptions()
    o.intra_op_num_threads = threads
    o.enable_cpu_mem_arena = False
    return ort.InferenceSession(model.SerializeToString(), o, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    w = {"self_attn.o_proj.weight": (rng.standard_normal((HIDDEN, H * HD)) * 0.02).astype(np.float32)}
    cur_m, cur_out = current(w)
    gqa_m, gqa_out = gqa(w)
    cur, gq = session(cur_m, args.threads), session(gqa_m, args.threads)
    kbuf = rng.standard_normal((1, KVH, CAP, HD)).astype(np.float32)
    vbuf = rng.standard_normal((1, KVH, CAP, HD)).astype(np.float32)
    print(f"{'P':>6} {'S':>3} {'current us':>11} {'GQA us':>8} {'ratio':>6}")
    for p in (20, 100, 300, 600, 1000, 1800):
        for s in (1, 2, 8):
            q = rng.standard_normal((1, H, s, HD)).astype(np.float32)
            k = rng.standard_normal((1, KVH, s, HD)).astype(np.float32)
            v = rng.standard_normal((1, s, KVH, HD)).astype(np.float32)
            past = rng.standard_normal((1, p, KVH, HD)).astype(np.float32)
            mask = np.zeros((1, 1, H * s * (2 if H // KVH == 1 else 1), p + s), np.float32)
            cf = {"q": q, "k": k, "v": v, "past_k": past, "past_v": past, "mask": mask}
            b = gq.io_binding()
            for n, a in (("q", q), ("k", k), ("v", v)):
                b.bind_cpu_input(n, a)
            for n, a in (("past_k", kbuf), ("past_v", vbuf)):
                b.bind_cpu_input(n, a)
            b.bind_cpu_input("seqlens_k", np.array([p + s - 1], np.int32))
            b.bind_cpu_input("total", np.array(p + s, np.int32))
            out = np.empty((1, s, HIDDEN), np.float32)
            b.bind_output(gqa_out, "cpu", 0, np.float32, out.shape, out.ctypes.data)
            b.bind_output("present_k", "cpu", 0, np.float32, kbuf.shape, kbuf.ctypes.data)
            b.bind_output("present_v", "cpu", 0, np.float32, vbuf.shape, vbuf.ctypes.data)
            tc, tg = [], []
            for _ in range(args.reps):
                t = time.perf_counter()
                cur.run(None, cf)
                tc.append(time.perf_counter() - t)
                t = time.perf_counter()
                gq.run_with_iobinding(b)
                tg.append(time.perf_counter() - t)
            c, g = statistics.median(tc) * 1e6, statistics.median(tg) * 1e6
            print(f"{p:6d} {s:3d} {c:11.1f} {g:8.1f} {c / g:6.2f}")


if __name__ == "__main__":
    main()
