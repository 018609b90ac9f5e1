"""Markdown + PNG report for one or more bench runs (one device, or several merged by `compare`):
the Markdown here, the plots in plots.py."""
from __future__ import annotations

import importlib.util
import logging
from datetime import datetime, timezone
from pathlib import Path

from ..errors import ConfigError
from .heat_report import HEAT_PLOT, has_heat, heat_lines, plot_heat
from .measure import PEER, PLAIN, SPECULATIVE, is_peer
from .plots import PEER_PLOT, PLOTS, classes_of, edgespec_configs, has_peer, plots_for, speculative_of
from .summary import peer_key

__all__ = ["write_report", "require_matplotlib", "check_report_dir", "markdown", "PLOTS", "PEER_PLOT", "HEAT_PLOT"]

logger = logging.getLogger(__name__)

MIB = 2**20


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("reports need matplotlib: pip install 'edgespec[bench]'")


def check_report_dir(path: str | Path) -> Path:
    """`path` if a report can be written there (a folder, or one that can be made), else a
    one-line ConfigError; called before measuring."""
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--report needs a folder, but {out} is a file")
    probe = out
    while not probe.exists():  # the nearest folder that exists must take the new one
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"--report: cannot make {out}: {probe} is a file")
    return out


def _server_peers(run: dict) -> list[str]:
    return [c for c in run["configs"] if is_peer(c) and c != PEER]


def _f(x, spec: str, none: str = "–") -> str:
    return none if x is None else format(x, spec)


# ---------------------------------------------------------------- markdown


def _runs_table(runs: list[dict]) -> list[str]:
    rows = ["| run | CPU | arch | ISA | cores | RAM | OS | Python | backend | libraries | bundle (target / draft) | "
            "drafting | prompts × repeat × max tokens |", "|" + " --- |" * 13]
    for r in runs:
        m, b, c = r["machine"], r["bundle"], r["config"]
        t, d = b.get("target") or {}, b.get("draft") or {}
        draft = f"{d.get('precision')} {d.get('format')}" if d else "none"
        if d.get("vocab_info"):
            draft += f", VocabTrim K={d['vocab_info'].get('k', '?')}"
        libs = ", ".join(f"{k} {v}" for k, v in r["libraries"].items() if k in ("edgespec", "onnxruntime", "openvino",
                                                                             "llama-cpp-python", "numpy"))
        rows.append(
            f"| {r['label']} | {m['cpu']} | {m['arch']} | {' '.join(m.get('isa') or []) or '?'} | "
            f"{m.get('cores_usable') or m['cores_logical']} | "
            f"{m['ram_bytes'] / 2**30:.0f} GiB | {m['os']} | {m['python']} | {r['backend'].get('name')} "
            f"{r['backend'].get('device') or 'CPU'} | {libs} | {b['name']}: {t.get('precision')} {t.get('format')} / "
            f"{draft} | {c.get('drafter')}, {c.get('policy')}, k={c.get('k')} | {c['prompts']} × {c['repeat']} × "
            f"{c['max_tokens']} |")
    return rows


def _results_table(run: dict) -> list[str]:
    peer = has_peer(run)
    head = ("| class | plain tok/s | speculative tok/s | speed-up | " +
            ("llama.cpp tok/s | plain / spec x llama.cpp | " if peer else "") +
            "TTFT plain / spec (ms) | prefill tok/s | acceptance | tokens / step | draft time | peak RSS (MiB) | "
            "identical |")
    rows = [head, "|" + " --- |" * (13 if peer else 11)]
    for cls, block in [*run["classes"].items(), ("**overall**", run["overall"])]:
        p, s = block[PLAIN], speculative_of(block) or {}
        # sampled output is not meant to equal plain output: nothing to check there
        same = "n/a" if s.get("identical", True) is None else "yes" if s.get("identical", True) else "**NO**"
        if peer:
            q = block.get(PEER) or {}
            peer_cells = (f"{_f(q.get('tok_s'), '.1f')} | {_f(p.get('x_llamacpp'), '.2f')}× / "
                          f"**{_f(s.get('x_llamacpp'), '.2f')}×** | ")
        else:
            peer_cells = ""
        rows.append(
            f"| {cls} | {p['tok_s']:.1f} | {_f(s.get('tok_s'), '.1f')} | **{_f(s.get('speedup'), '.2f')}×** | "
            f"{peer_cells}{p['ttft_ms']:.0f} / {_f(s.get('ttft_ms'), '.0f')} | {p['prefill_tok_s']:.0f} | "
            f"{_f(s.get('acceptance'), '.0%')} | {_f(s.get('mean_accepted_length'), '.2f')} | "
            f"{_f(s.get('draft_share'), '.0%')} | {max(p['peak_rss_bytes'], s.get('peak_rss_bytes', 0)) / MIB:.0f} | "
            f"{same} |")
    return rows


def _sweep_table(run: dict) -> list[str]:
    sweep = [c for c in edgespec_configs(run) if c not in (PLAIN, SPECULATIVE)]
    if not sweep:
        return []
    rows = ["", "Fixed draft lengths (all prompts):", "",
            "| configuration | tok/s | speed-up | acceptance | tokens / step | draft time |", "|" + " --- |" * 6]
    for c in [PLAIN, SPECULATIVE, *sweep]:
        m = run["overall"].get(c)
        if m:
            rows.append(f"| {c} | {m['tok_s']:.1f} | {_f(m.get('speedup'), '.2f')} | {_f(m.get('acceptance'), '.0%')} "
                        f"| {m['mean_accepted_length']:.2f} | {m['draft_share']:.0%} |")
    return rows


def _peer_lines(run: dict) -> list[str]:
    """Who the peer was and how far its greedy text agrees with edgespec plain."""
    info = run.get("peer")
    if not info or not has_peer(run):
        return []
    origin = {"given": "given with --peer-gguf", "source": "the GGUF the bundle's target was exported from",
              "bundle": "the bundle's own GGUF"}.get(info.get("origin"), info.get("origin"))
    q = run["overall"].get(PEER, {})
    agree = "; ".join(f"{cls} {_f(b.get(PEER, {}).get('agree_tokens'), '.0f')}"
                      for cls, b in run["classes"].items() if PEER in b)
    sampled = _sampling_text(run)
    agreement = (f" Its greedy text agrees with edgespec plain for a median of {_f(q.get('agree_tokens'), '.0f')} "
                 f"tokens before the first difference (per class: {agree}); {q.get('agree_prompts', 0)} of "
                 f"{q.get('prompts', 0)} prompts agree throughout (a quantized GGUF in another program need not "
                 f"round as edgespec does).") if sampled is None else ""
    return ["", f"Peer: {info.get('library')} {info.get('version')}'s own plain decode of "
            f"`{info.get('gguf')}` ({origin}), {sampled or 'greedy'}, {info.get('threads')} thread(s)"
            f"{' on the GPU ' + str(info['gpu']) if info.get('gpu') else ''}, in the same process, interleaved "
            f"with edgespec on the same prompt token ids. `x llama.cpp` is the ratio of totals: the class's "
            f"decoded tokens over its decode time, edgespec's over llama.cpp's on the same prompts and repeats "
            f"(the median of paired per-prompt ratios is in the JSON, `x_llamacpp_paired`).{agreement}", ""]


def _server_lines(run: dict) -> list[str]:
    """llama.cpp's own server, per peer (plain and each speculative type): its speed by its own
    timings, its acceptance, edgespec's ratios over it, and the build and flags it ran with."""
    peers = _server_peers(run)
    if not peers:
        return []
    rows = ["", "llama.cpp's own server (`llama-server`), decode speed by its own `timings`:", "",
            "| class | peer | its tok/s | its acceptance | plain x it | speculative x it |", "|" + " --- |" * 6]
    for cls, block in [*run["classes"].items(), ("**overall**", run["overall"])]:
        p, s = block[PLAIN], speculative_of(block) or {}
        for peer in peers:
            q, key = block.get(peer) or {}, peer_key(peer)
            rows.append(f"| {cls} | {peer} | {_f(q.get('tok_s'), '.1f')} | {_f(q.get('acceptance'), '.0%')} | "
                        f"{_f(p.get(key), '.2f')}× | **{_f(s.get(key), '.2f')}×** |")
    for peer in peers:
        info = (run.get("peers") or {}).get(peer, {})
        build = info.get("build") or {}
        cmake = " ".join(f"-D{k}={v}" for k, v in (build.get("cmake") or {}).items())
        rows += ["", f"`{peer}`: {info.get('version')}, built with `{cmake or '?'}` ({build.get('compiler') or '?'}); "
                 f"run as `llama-server {' '.join(info.get('flags') or [])}`."]
    return rows + [""]


def _sampling_text(run: dict) -> str | None:
    """The run's sampler in words, or None for greedy decoding."""
    sp = (run.get("config") or {}).get("sampling")
    if not isinstance(sp, dict) or not sp.get("temperature"):
        return None
    return (f"sampled at temperature {sp['temperature']:g}, top-p {sp.get('top_p', 1.0):g}, "
            f"top-k {sp.get('top_k', 0)}, min-p {sp.get('min_p', 0.0):g}")


def _mismatch_lines(run: dict) -> list[str]:
    bad = run["mismatches"]
    if not bad:
        return []
    shown = ", ".join(f"{b['class']}/{b['prompt']} ({b['config']}, repeat {b['repeat'] + 1}, token "
                      f"{b['first_difference']})" for b in bad[:10])
    return ["", f"> **WARNING: greedy speculative output differed from plain decoding in {len(bad)} run(s)**: "
            f"{shown}{' …' if len(bad) > 10 else ''}. Speculative decoding must be lossless; please report this.", ""]


def _devices_table(runs: list[dict]) -> list[str]:
    """One row per run: what a fleet comparison needs at a glance (overall figures)."""
    rows = ["Per run, over all prompts:", "",
            "| run | arch | ISA | plain tok/s | speculative tok/s | speed-up | acceptance | tokens / step | "
            "peak RSS (MiB) | x llama.cpp (spec) | exactness | c(B) (B: cost over a one-token forward) |",
            "|" + " --- |" * 12]
    for r in runs:
        o, m = r["overall"], r["machine"]
        p, s = o[PLAIN], speculative_of(o) or {}
        rss = max(p["peak_rss_bytes"], s.get("peak_rss_bytes", 0)) / MIB
        exact = (r.get("exactness") or {}).get("summary", "–")
        costs = r.get("verify_costs") or {}
        cb = ", ".join(f"{b}: {c:.2f}" for b, c in (costs.get("c") or {}).items()) or "–"
        rows.append(f"| {r['label']} | {m['arch']} | {' '.join(m.get('isa') or []) or '?'} | {p['tok_s']:.1f} | "
                    f"{_f(s.get('tok_s'), '.1f')} | **{_f(s.get('speedup'), '.2f')}×** | "
                    f"{_f(s.get('acceptance'), '.0%')} | {_f(s.get('mean_accepted_length'), '.2f')} | {rss:.0f} | "
                    f"{_f(s.get('x_llamacpp'), '.2f')} | {exact} | {cb} |")
    return rows + [""]


def _compare_table(runs: list[dict]) -> list[str]:
    classes = classes_of(runs)
    peer = any(has_peer(r) for r in runs)
    what = "plain → spec tok/s (speed-up" + ("; spec x llama.cpp)" if peer else ")")
    head = "| run | " + " | ".join(f"{c} {what}" for c in [*classes, "overall"]) + " |"
    rows = ["## Comparison", "", head, "|" + " --- |" * (len(classes) + 2)]
    for r in runs:
        cells = []
        for cls in [*classes, "overall"]:
            block = r["overall"] if cls == "overall" else r["classes"].get(cls)
            if not block:
                cells.append("–")
                continue
            s = speculative_of(block) or {}
            x = f"; {_f(s.get('x_llamacpp'), '.2f')}×" if peer else ""
            cells.append(f"{block[PLAIN]['tok_s']:.1f} → {_f(s.get('tok_s'), '.1f')} "
                         f"(**{_f(s.get('speedup'), '.2f')}×**{x})")
        rows.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    return rows + [""] + _devices_table(runs)


def _roofline_table(roof: dict | None) -> list[str]:
    """The run's roofline (bench/roofline.py): one row per kind of forward."""
    if not roof:
        return []
    bw = ", ".join(f"{t} thread{'s' * (t != '1')}: {v:.1f} GB/s" for t, v in roof["bandwidth_gb_s"].items())
    lines = [f"Roofline (memory read bandwidth measured here: {bw}):", "",
             "| forward | rows | ms | weights read (MB) | GB/s | share of bandwidth | operators |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in roof["rows"]:
        mb = None if row["weights_bytes"] is None else row["weights_bytes"] / 1e6
        lines.append(f"| {row['role']} | {row['width']} | {_f(row['ms'], '.2f')} | {_f(mb, '.0f')} | "
                     f"{_f(row['gb_s'], '.1f')} | {_f(row['of_bandwidth'], '.0%')} | {_f(row['ops'], 'd')} |")
    if roof.get("draft_of_plain") is not None:
        lines += ["", f"A drafted token costs {roof['draft_of_plain']:.2f} of a plain step."]
    return lines + [""]


def markdown(runs: list[dict], plots: list[str]) -> str:
    title = "edgespec bench" if len(runs) == 1 else f"edgespec bench: {len(runs)} runs compared"
    lines = [f"# {title}", "",
             f"Generated {datetime.now(timezone.utc).isoformat(timespec='seconds')} from run(s) made "
             + ", ".join(r["created"] for r in runs) + ".", "", "## Runs", "", *_runs_table(runs), ""]
    if len(runs) > 1:
        lines += _compare_table(runs)
    for r in runs:
        mem = r.get("memory", {})
        load = r["machine"].get("load_avg_1min")
        lines += [f"## {r['label']}", ""]
        if r.get("exactness"):
            lines += [f"Exactness probe: {r['exactness']['summary']}.", ""]
        if (r.get("verify_costs") or {}).get("c"):
            vc = r["verify_costs"]
            lines += ["Cost of a B-token target forward over a one-token forward (c(B)): "
                      + ", ".join(f"c({b}) = {c:.2f}" for b, c in vc["c"].items())
                      + f", at {vc['one_token_ms']:.1f} ms per one-token forward.", ""]
        lines += _roofline_table(r.get("roofline"))
        lines += _mismatch_lines(r)
        if r.get("skipped"):
            lines += [f"Skipped (prompt + reply exceed the context limit): {', '.join(r['skipped'])}.", ""]
        lines += _results_table(r) + _peer_lines(r) + _server_lines(r) + _sweep_table(r) + ["", *heat_lines(r)]
        lines += ["", f"Prompts: {r['config']['prompts']} ({r['bundle']['chat_format']} for chat prompts). "
                  f"Load average at the start: {_f(load, '.2f')}; run took {r['duration_s']:.0f} s. "
                  f"RSS {_f(mem.get('rss_before_load'), ',')} B before loading, "
                  f"{_f(mem.get('rss_after_load'), ',')} B after.", ""]
    lines += ["## Plots", ""] + [f"![{p.split('.')[0]}]({p})" for p in plots] + [""]
    modes = sorted({_sampling_text(r) or "greedy decoding" for r in runs})
    lines += ["## How this was measured", "",
              "Plain and speculative decoding ran in one process on the same loaded model runtimes, alternating per "
              "prompt and repeat (rotating which goes first), each from empty KV caches, after a warm-up. "
              f"{'; '.join(modes).capitalize()}; chat prompts end where `edgespec chat` ends a reply (an "
              "end-of-turn token, the next speaker, a blank line); continuation prompts run to the token limit "
              "unless `--stop-at-eos` was given. Per prompt, the median over "
              "repeats; a class's tok/s is its prompts' decoded tokens (after the first) over the sum of their "
              "median decode times. The speed-up is speculative tok/s divided by plain tok/s, both measured; "
              "it is never computed from the acceptance rate. TTFT covers the prompt's prefill (and the draft "
              "model's catch-up) and the first step; prefill tok/s = prompt tokens / TTFT of plain decoding. "
              "Acceptance = accepted / drafted tokens; tokens/step = tokens committed per target forward. "
              "Draft time = share of the step time spent drafting. Peak RSS is the whole process (both models "
              "loaded, and the llama.cpp peer's model when it ran), sampled every 5 ms with psutil.", ""]
    return "\n".join(lines)


def write_report(runs: list[dict], out_dir: str | Path) -> Path:
    """Write report.md and the PNG plots into `out_dir`; returns the Markdown file's path."""
    require_matplotlib()
    if not runs:
        raise ConfigError("nothing to report: no runs")
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--report needs a folder, but {out} is a file")
    out.mkdir(parents=True, exist_ok=True)
    plots = plots_for(runs)
    if any(has_heat(r) for r in runs):
        plots.append((HEAT_PLOT, plot_heat))
    for name, plot in plots:
        plot(runs, out / name)
    md = out / "report.md"
    md.write_text(markdown(runs, [name for name, _ in plots]), encoding="utf-8")
    logger.info("report written to %s", md)
    return md
