"""Memory budgets on a real bundle: peak RSS against the budget, and speed at 1.2x the lower bound.

    python benchmarks/bench_memory.py --bundle BUNDLE [--rounds 3] [--out DIR]

BUNDLE is an export with fixed preallocated KV buffers and a VocabTrim draft (what `edgespec
export` writes; the growing-KV bundles of the first exporter no longer load, so the comparison
with that naive path that this script once made is history, in docs/LOG.md). Every measurement
runs in a fresh process (RSS is per process) and the configurations are interleaved round by
round, so a busy machine slows them alike; medians are reported.

Measured per run: RSS after load, peak RSS sampled every 2 ms by psutil in a thread while one
greedy generation runs (a --prompt-tokens prompt, --new-tokens new tokens, k=4 model drafts or
--drafting default),
and decode tokens/s. Generation memory = peak - after load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a screw press adapted from wine making. Within "
        "fifty years printers worked in more than two hundred European towns, and the price of books fell "
        "so far that students, merchants and artisans could own them. ")


class PeakAnon:
    """Peak of private (not file-backed) resident memory: what the process allocated, without the
    pages of memory-mapped weight files read in as tokens first appear."""

    def __init__(self, interval_s: float) -> None:
        import threading

        self.interval_s, self.peak, self._stop = interval_s, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import time

        from edgespec.memory.measure import anon_bytes

        while not self._stop.is_set():
            self.peak = max(self.peak, anon_bytes() or 0)
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakAnon:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def child(cfg: dict) -> dict:
    """One measurement in this (fresh) process."""
    import edgespec
    from edgespec.memory.measure import PeakRSS, anon_bytes, rss_bytes

    # "model": the draft model alone, k=4 (SpecMemo's setting); "default": what edgespec chat runs
    kw = dict(k=4, drafter="model", policy="fixed") if cfg.get("drafting", "model") == "model" else {}
    if cfg.get("budget"):
        kw["memory_budget"] = cfg["budget"]
    with edgespec.load(cfg["bundle"], **kw) as e:
        after_load, anon_load = rss_bytes(), anon_bytes()
        ids = e.tokenizer.encode(TEXT * 40)[: cfg["prompt_tokens"]]
        with PeakRSS(0.002) as peak, PeakAnon(0.002) as anon:
            rs = list(e.stream(ids, max_tokens=cfg["new_tokens"]))
        st = rs[-1].stats
        plan = e.memory_plan
        return dict(after_load=after_load, peak=peak.peak, anon_load=anon_load, anon_peak=anon.peak,
                    tok_s=st.tokens_per_s, new=st.new_tokens,
                    tokens=[t for r in rs for t in r.token_ids], draft=e.draft is not None,
                    capacity=e.context_limit, plan_total=plan.total if plan else None,
                    bounds=[plan.bounds.speculative, plan.bounds.plain] if plan else None)


def run(cfg: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    r = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], capture_output=True, text=True,
                       env=env)
    if r.returncode != 0:
        return dict(error=r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def med(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r and r[key] is not None]
    return statistics.median(vals) if vals else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--drafting", choices=("model", "default"), default="model",
                    help="model: the draft model alone, k=4 fixed; default: edgespec's default drafting")
    ap.add_argument("--factors", default="1.0,1.2,1.5,2.0", help="budgets as multiples of the speculative bound")
    ap.add_argument("--out", default=None, help="folder for results.json and memory.png")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    MiB = 2**20
    common = dict(prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, drafting=args.drafting)
    # the bounds come from a plan with a roomy budget (the same measurement a budgeted load makes)
    probe = run(dict(bundle=args.bundle, budget="64GB", **common))
    if "error" in probe:
        sys.exit(f"probe failed: {probe['error']}")
    spec_bound, plain_bound = probe["bounds"]
    print(f"lower bounds: speculative {spec_bound / MiB:.0f} MiB, plain {plain_bound / MiB:.0f} MiB")
    configs = {"unbudgeted": dict(bundle=args.bundle, **common)}
    for f in (float(x) for x in args.factors.split(",")):
        configs[f"{f:.2f}x bound"] = dict(bundle=args.bundle, budget=int(spec_bound * f), **common)
    configs["below bound"] = dict(bundle=args.bundle, budget=int((spec_bound + plain_bound) / 2), **common)
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for rnd in range(args.rounds):  # interleaved: every configuration once per round
        for name, cfg in configs.items():
            r = run(cfg)
            results[name].append(r)
            msg = r.get("error") or (f"peak {r['peak'] / MiB:.0f} MiB, "
                                     f"gen {(r['peak'] - r['after_load']) / MiB:.0f} MiB, "
                                     f"{r['tok_s']:.2f} tok/s, draft {r['draft']}, context {r['capacity']}")
            print(f"round {rnd + 1} {name:<14} {msg}", flush=True)
    print(f"\n{'config':<14} {'budget':>8} {'peak':>8} {'<=budget':>8} {'gen mem':>8} {'tok/s':>7} draft")
    summary = {}
    for name, rows in results.items():
        ok = [r for r in rows if "error" not in r]
        if not ok:
            print(f"{name:<14} error: {rows[0]['error']}")
            continue
        budget = configs[name].get("budget")
        gen = statistics.median(r["peak"] - r["after_load"] for r in ok)
        peak = med(ok, "peak")
        fits = all(r["peak"] <= budget for r in ok) if budget else None
        anon = [r["anon_peak"] - r["anon_load"] for r in ok if r.get("anon_load") is not None]
        summary[name] = dict(budget=budget, peak=peak, gen=gen, tok_s=med(ok, "tok_s"), draft=ok[0]["draft"],
                             gen_private=statistics.median(anon) if anon else None,
                             fits=fits, same_tokens=all(r["tokens"] == ok[0]["tokens"] for r in ok))
        b = f"{budget / MiB:.0f}M" if budget else "-"
        print(f"{name:<14} {b:>8} {peak / MiB:>7.0f}M {str(fits):>8} {gen / MiB:>7.0f}M "
              f"{summary[name]['tok_s']:>7.2f} {ok[0]['draft']}")
    if "1.20x bound" in summary and "unbudgeted" in summary:
        print(f"throughput at 1.2x bound: {summary['1.20x bound']['tok_s'] / summary['unbudgeted']['tok_s']:.1%} "
              f"of unbudgeted")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(dict(configs=configs, results=results, summary=summary,
                                                          bounds=[spec_bound, plain_bound]), indent=1))
        plot(summary, spec_bound, plain_bound, out / "memory.png")
        print(f"wrote {out / 'results.json'} and {out / 'memory.png'}")


def plot(summary: dict, spec_bound: int, plain_bound: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    MiB = 2**20
    names = list(summary)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(names))
    a.bar(x, [summary[n]["peak"] / MiB for n in names], label="peak RSS")
    a.scatter(x, [(summary[n]["budget"] or float("nan")) / MiB for n in names], color="red", zorder=3,
              label="budget")
    a.axhline(spec_bound / MiB, ls="--", color="gray", label="speculative bound")
    a.axhline(plain_bound / MiB, ls=":", color="gray", label="plain bound")
    a.set_xticks(list(x), names, rotation=30, ha="right")
    a.set_ylabel("MiB")
    a.legend(fontsize=8)
    a.set_title("peak RSS vs budget")
    b.bar(x, [summary[n]["gen"] / MiB for n in names], color="tab:orange")
    b.set_xticks(list(x), names, rotation=30, ha="right")
    b.set_ylabel("MiB (peak - after load)")
    b.set_title("generation memory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
