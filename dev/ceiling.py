"""How fast can speculative decoding be against llama.cpp here, whatever the drafter? (issue 22)

    python dev/ceiling.py [--bundle BUNDLE] [--repeat 4] [--out dev/results/ceiling.json]

A drafter that costs nothing (prompt lookup nearly does) and is accepted with probability alpha
per token commits E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha) tokens per step of k drafts, and
the step costs one verify of k + 1 tokens, c(k + 1) one-token forwards. Against llama-cpp-python's
own plain decode of the same GGUF (ms per token L), the best any such drafter can do is

    max over k of  E(alpha, k) * L / (c(k + 1) * T1)

with T1 the target's one-token forward. This measures c(B) for B = 1..17 (the default engine's
target, its draft on the target's body idle: a lookup draft's verify computes every row) and L
(llama-cpp-python decoding two bench prompts, 64 tokens), interleaved in one process, and prints
that ceiling for alpha in 0.8 .. 1. Python's share of a step and the draft's cost are left out,
so a measured run stays below it. Issue 22 asks for 2.5x llama.cpp on grounded prompts (alpha
~0.95 measured) and 1.5x on code.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ALPHAS = (0.8, 0.9, 0.95, 0.98, 1.0)
WIDTHS = tuple(range(1, 18))


def ceiling(alpha: float, c: dict[int, float], llama_over_one: float) -> tuple[float, int]:
    """(best speed-up over llama.cpp, its draft length) for a free drafter accepted `alpha`: the
    cost policy's own arithmetic (decoding/policy.py) with no drafting cost."""
    from edgespec.decoding.policy import best_k, step_rate

    verify = [c[b] for b in sorted(c)]  # verify[k]: a verify of k + 1 tokens, in one-token forwards
    k = best_k(alpha, 0.0, verify)
    return step_rate(alpha, k, 0.0, verify) * llama_over_one, k


def main() -> None:
    import edgespec
    from edgespec.bench.machine import library_versions, machine_info
    from edgespec.bench.measure import PEER_SETTLE_S
    from edgespec.bench.peer import LlamaCppPeer, find_peer_gguf
    from edgespec.bench.suites import encode_prompt, load_prompts
    from edgespec.engine.tuning import verify_costs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default=None)
    ap.add_argument("--repeat", type=int, default=4, help="rounds of (c(B), llama.cpp), interleaved")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "ceiling.json")
    args = ap.parse_args()
    edgespec.share_threads()  # as the edgespec command runs
    engine = edgespec.load(args.bundle)
    peer = LlamaCppPeer(find_peer_gguf(engine.bundle), threads=2)
    prompts = [encode_prompt(engine.tokenizer, p) for p in (load_prompts("chat")[0], load_prompts("grounded")[0])]
    one, wide, llama = [], {b: [] for b in WIDTHS}, []
    for _ in range(args.repeat):
        costs = verify_costs(engine.target, WIDTHS, repeats=3)
        one.append(costs["one_token_ms"])
        for b in WIDTHS:
            wide[b].append(costs["ms"][str(b)])
        time.sleep(PEER_SETTLE_S)  # llama.cpp starts on idle cores, as bench runs it
        for ids in prompts:
            llama.append(1e3 / peer.decode(ids, 64).tok_s)  # decode speed after the first token, as bench's
        time.sleep(PEER_SETTLE_S)
    t1, lms = statistics.median(one), statistics.median(llama)
    c = {b: statistics.median(wide[b]) / t1 for b in WIDTHS}
    out = {
        "bench": "ceiling", "machine": machine_info(), "libraries": library_versions(),
        "one_token_ms": round(t1, 2), "llama_ms_per_token": round(lms, 2),
        "c": {b: round(v, 3) for b, v in c.items()},
        "ceiling": {str(a): dict(zip(("x_llama", "k"), (round(r, 2), k)))
                    for a in ALPHAS for r, k in [ceiling(a, c, lms / t1)]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"one-token forward {t1:.1f} ms, llama-cpp-python {lms:.1f} ms per token")
    print("c(B): " + " ".join(f"{b}:{v:.2f}" for b, v in c.items()))
    for a, v in out["ceiling"].items():
        print(f"alpha {a}: at most {v['x_llama']:.2f}x llama.cpp (k = {v['k']})")


if __name__ == "__main__":
    main()
