"""The bench report's plots (report.py writes them beside its Markdown): matplotlib's object API
(Figure + Agg, no pyplot state), imported when a plot is drawn, so the bench runs without
matplotlib unless a report is asked for. Also the few readings of a run's document that the
plots and the Markdown share."""
from __future__ import annotations

from pathlib import Path

from .measure import PEER, PLAIN, SPECULATIVE, is_peer

__all__ = ["PLOTS", "PEER_PLOT", "plots_for", "has_peer", "edgespec_configs", "classes_of", "speculative_of"]

PLOTS = ("speed.png", "acceptance.png", "draft_length.png")
PEER_PLOT = "llamacpp.png"  # written when a run measured the llama.cpp peer


def has_peer(run: dict) -> bool:
    """Whether the run measured llama-cpp-python beside edgespec."""
    return PEER in run.get("configs", ())


def edgespec_configs(run: dict) -> list[str]:
    """The run's own configurations (plain, speculative, a sweep's), peers left out."""
    return [c for c in run["configs"] if not is_peer(c)]


def classes_of(runs: list[dict]) -> list[str]:
    """The prompt classes of the runs, in first-seen order."""
    return list(dict.fromkeys(c for r in runs for c in r["classes"]))


def speculative_of(block: dict) -> dict | None:
    """A block's speculative metrics: the default configuration's, else the first swept one's."""
    return block.get(SPECULATIVE) or next((m for c, m in block.items() if c != PLAIN and not is_peer(c)), None)


def _figure(w: float, h: float, ncols: int = 1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=110, layout="constrained")
    axes = fig.subplots(1, ncols)
    return fig, (list(axes) if ncols > 1 else [axes])


def _class_metrics(run: dict, classes: list[str], config: str) -> list[dict]:
    """`config`'s metrics per class ("overall" too; the speculative one as speculative_of picks it), {} where absent."""
    blocks = [run["overall"] if cls == "overall" else run["classes"].get(cls, {}) for cls in classes]
    return [(b.get(PLAIN) if config == PLAIN else speculative_of(b)) or {} for b in blocks]


def _repeat_range(metrics: list[dict]) -> list[list[float]]:
    """Error bars from each bar's tok/s down to its slowest repeat and up to its fastest."""
    lo, hi = [], []
    for m in metrics:
        spread, mid = m.get("tok_s_spread"), m.get("tok_s", 0.0)
        lo.append(max(mid - spread["min"], 0.0) if spread else 0.0)
        hi.append(max(spread["max"] - mid, 0.0) if spread else 0.0)
    return [lo, hi]


def _plot_speed(runs: list[dict], out: Path) -> None:
    classes = [*classes_of(runs), "overall"]
    fig, (ax,) = _figure(max(6.0, 1.3 * len(classes) * max(len(runs), 1) + 2), 4.2)
    n = len(runs)
    width = 0.8 / (2 * n)
    for i, r in enumerate(runs):
        plain, spec = _class_metrics(r, classes, PLAIN), _class_metrics(r, classes, SPECULATIVE)
        xs = [j + (2 * i) * width - 0.4 + width / 2 for j in range(len(classes))]
        tag = f" ({r['label']})" if n > 1 else ""
        ax.bar(xs, [m.get("tok_s", 0.0) for m in plain], width, label=f"plain{tag}", color=f"C{i}", alpha=0.45,
               yerr=_repeat_range(plain), ecolor="grey", capsize=2)
        bars = ax.bar([x + width for x in xs], [m.get("tok_s", 0.0) for m in spec], width, label=f"speculative{tag}",
                      color=f"C{i}", yerr=_repeat_range(spec), ecolor="black", capsize=2)
        ups = [m.get("speedup") for m in spec]
        for bar, up in zip(bars, ups):
            if up:
                ax.annotate(f"{up:.2f}×", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(classes)), classes)
    ax.set_ylabel("decode tokens / s (bars: slowest to fastest repeat)")
    ax.set_title("Plain vs speculative decoding per prompt class")
    ax.legend(fontsize=8)
    fig.savefig(out)


def _plot_acceptance(runs: list[dict], out: Path) -> None:
    classes = [*classes_of(runs), "overall"]
    fig, (ax1, ax2) = _figure(max(8.0, 1.2 * len(classes) * len(runs) + 4), 4.0, ncols=2)
    width = 0.8 / len(runs)
    for i, r in enumerate(runs):
        acc, tps = [], []
        for cls in classes:
            s = speculative_of(r["overall"] if cls == "overall" else r["classes"].get(cls, {})) or {}
            acc.append(s.get("acceptance") or 0.0)
            tps.append(s.get("mean_accepted_length") or 0.0)
        xs = [j + i * width - 0.4 + width / 2 for j in range(len(classes))]
        ax1.bar(xs, acc, width, label=r["label"], color=f"C{i}")
        ax2.bar(xs, tps, width, label=r["label"], color=f"C{i}")
    ax1.set_ylim(0, 1)
    ax1.set_ylabel("acceptance (accepted / drafted)")
    ax2.set_ylabel("tokens per target forward")
    ax2.axhline(1.0, color="grey", lw=0.8, ls="--")
    for ax, title in ((ax1, "Acceptance per class"), (ax2, "Mean accepted length per class")):
        ax.set_xticks(range(len(classes)), classes)
        ax.set_title(title)
    if len(runs) > 1:
        ax1.legend(fontsize=8)
    fig.savefig(out)


def _plot_draft_length(runs: list[dict], out: Path) -> None:
    fig, (ax1, ax2) = _figure(10.0, 4.0, ncols=2)
    swept = any(c not in (PLAIN, SPECULATIVE) for r in runs for c in edgespec_configs(r))
    for i, r in enumerate(runs):
        tag = f" {r['label']}" if len(runs) > 1 else ""
        _plot_acceptance_by_k(ax1, None if swept else ax2, r, f"C{i}", tag)
        if swept:
            _plot_sweep_speed(ax2, r, f"C{i}", tag)
    _label_draft_length_axes(ax1, ax2, swept)
    fig.savefig(out)


def _plot_acceptance_by_k(ax1, ax2, r: dict, color: str, tag: str) -> None:
    """One run's acceptance per draft length and drafter on `ax1`; on `ax2` (when given) the share
    of drafted steps at each length."""
    rows = (speculative_of(r["overall"]) or {}).get("by_draft_length", [])
    for j, drafter in enumerate(dict.fromkeys(x["drafter"] for x in rows)):
        ks, acc, steps = zip(*sorted((x["k"], x["acceptance"], x["steps"]) for x in rows if x["drafter"] == drafter))
        ls = ["-", "--", ":"][j % 3]
        ax1.plot(ks, acc, color=color, ls=ls, label=f"{drafter}{tag}")
        # marker area ~ steps: a point from two steps should not look as sure as one from two hundred
        ax1.scatter(ks, acc, s=[12 + 4 * n ** 0.5 for n in steps], color=color, zorder=3)
        if ax2 is not None:
            total = sum(steps) or 1
            ax2.plot(ks, [n / total for n in steps], marker="o", color=color, ls=ls, label=f"{drafter}{tag}")


def _plot_sweep_speed(ax, r: dict, color: str, tag: str) -> None:
    """One run's speed at each fixed k of --k-sweep, with plain's and the policy's as lines."""
    ks = sorted((int(c[2:]), r["overall"][c]["tok_s"]) for c in r["configs"]
                if c.startswith("k=") and c in r["overall"])
    ax.plot([k for k, _ in ks], [t for _, t in ks], marker="o", color=color, label=f"fixed k{tag}")
    ax.axhline(r["overall"][PLAIN]["tok_s"], color=color, ls=":", lw=1, label=f"plain{tag}")
    if SPECULATIVE in r["overall"]:
        ax.axhline(r["overall"][SPECULATIVE]["tok_s"], color=color, ls="--", lw=1,
                   label=f"speculative ({r['config'].get('policy')}){tag}")


def _label_draft_length_axes(ax1, ax2, swept: bool) -> None:
    from matplotlib.ticker import MaxNLocator

    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.set_xlabel("draft length k (tokens drafted in a step; marker size ~ steps)")
    ax1.set_ylabel("acceptance")
    ax1.set_ylim(0, 1.05)
    ax1.set_title("Acceptance per draft length")
    ax2.set_xlabel("draft length k")
    if swept:
        ax2.set_ylabel("decode tokens / s")
        ax2.set_title("Speed per fixed draft length (--k-sweep)")
    else:
        ax2.set_ylabel("share of drafted steps")
        ax2.set_title("Draft lengths the policy chose")
    for ax in (ax1, ax2):
        if ax.has_data():
            ax.legend(fontsize=8)


def _plot_peer(runs: list[dict], out: Path) -> None:
    """x llama.cpp per class: bars for the medians, dots for each prompt's paired ratio."""
    runs = [r for r in runs if has_peer(r)]
    classes = [*classes_of(runs), "overall"]
    configs = [PLAIN, SPECULATIVE]
    n = len(runs) * len(configs)
    width = 0.8 / n
    fig, (ax,) = _figure(max(6.0, 1.2 * len(classes) * n / 2 + 2), 4.2)
    for i, r in enumerate(runs):
        tag = f" ({r['label']})" if len(runs) > 1 else ""
        for j, c in enumerate(configs):
            slot = i * len(configs) + j
            xs = [k + slot * width - 0.4 + width / 2 for k in range(len(classes))]
            _peer_bars(ax, xs, width, r, c, classes, f"C{i}", tag)
            _paired_dots(ax, xs, r, c, classes)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(classes)), classes)
    ax.set_ylabel("decode tok/s over llama.cpp's")
    ax.set_title("edgespec over llama.cpp, same GGUF model\n"
                 "bars: total tokens over total time; dots: per prompt, median of paired repeats", fontsize=9)
    ax.legend(fontsize=8)
    fig.savefig(out)


def _peer_bars(ax, xs: list[float], width: float, r: dict, config: str, classes: list[str], color: str,
               tag: str) -> None:
    """One configuration's speed over llama.cpp's per class (the ratio of totals), annotated."""
    vals = [((r["overall"] if cls == "overall" else r["classes"].get(cls, {})).get(config) or {}).get("x_llamacpp")
            for cls in classes]
    bars = ax.bar(xs, [v or 0.0 for v in vals], width, color=color, alpha=0.45 if config == PLAIN else 1.0,
                  label=f"edgespec {config}{tag}")
    for bar, v in zip(bars, vals):
        if v:
            ax.annotate(f"{v:.2f}×", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=8)


def _paired_dots(ax, xs: list[float], r: dict, config: str, classes: list[str]) -> None:
    """The per-prompt paired ratios the medians are taken over, at their class and at "overall"."""
    for row in r.get("prompts", []):
        x = (row["configs"].get(config) or {}).get("x_llamacpp_paired")
        if x is not None and row["class"] in classes:
            ax.scatter([xs[classes.index(row["class"])], xs[-1]], [x, x], s=9, color="black", zorder=3)


def plots_for(runs: list[dict]) -> list[tuple[str, object]]:
    """(file name, plot function) of each plot the runs call for, before the heat plot."""
    plots = list(zip(PLOTS, (_plot_speed, _plot_acceptance, _plot_draft_length)))
    if any(has_peer(r) for r in runs):
        plots.append((PEER_PLOT, _plot_peer))
    return plots
