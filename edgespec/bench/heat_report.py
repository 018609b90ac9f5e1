"""The report's part on heat (thermal.py's record): a table of clocks, temperatures and verdicts
per configuration, its warnings, and a plot of clock, temperature and speed over the repeats."""
from __future__ import annotations

from pathlib import Path
from statistics import median

__all__ = ["HEAT_PLOT", "has_heat", "heat_lines", "plot_heat"]

HEAT_PLOT = "heat.png"


def has_heat(run: dict) -> bool:
    """Whether the run read clocks or temperatures (a VM reads neither)."""
    configs = (run.get("thermal") or {}).get("configs") or {}
    return any(h.get("clock_mhz") or h.get("temp_c") for h in configs.values())


def _span(s: dict | None, unit: str) -> str:
    return "–" if not s else f"{s['median']:.0f} {unit} ({s['min']:.0f}–{s['max']:.0f})"


def heat_lines(run: dict) -> list[str]:
    """Markdown: the warnings first, then a row per configuration."""
    heat = run.get("thermal") or {}
    lines = [f"> **WARNING: {w}**" for w in heat.get("warnings", [])]
    if not has_heat(run):
        return lines + ([""] if lines else [])
    cool = heat.get("cooldown_s") or 0
    pause = f"{cool:g} s cooldown before each run" if cool else "no cooldown"
    lines += [*([""] if lines else []), f"Heat (clocks right after each run, i.e. under load; {pause}):", "",
              "| configuration | verdict | clock under load, median (range) | lowest share of top clock | "
              "temperature, median (range) | rise per run |", "|" + " --- |" * 6]
    for c, h in heat["configs"].items():
        lines.append(f"| {c} | {_verdict(h['verdict'])} | {_span(h.get('clock_mhz'), 'MHz')} | "
                     f"{_share(h.get('clock_share_min'))} | {_span(h.get('temp_c'), '°C')} | "
                     f"{_rise(h.get('temp_rise_c'))} |")
    return lines + [""]


def _verdict(v: str) -> str:
    return f"**{v}**" if v == "throttled" else v


def _share(share: float | None) -> str:
    return "–" if share is None else f"{share:.0%}"


def _rise(rise: dict | None) -> str:
    return "–" if not rise else f"{rise['median']:+.1f} °C"


def _per_repeat(run: dict, config: str, key: str) -> list[float | None]:
    """Over the prompts, the median of `key` in each repeat (heat rows), or tok/s."""
    rows = [p["configs"].get(config) for p in run.get("prompts", [])]
    rows = [r for r in rows if r]
    n = max((len(r.get("tok_s", [])) for r in rows), default=0)
    out = []
    for i in range(n):
        if key == "tok_s":
            vals = [r["tok_s"][i] for r in rows if i < len(r["tok_s"])]
        else:
            vals = [h[key] for r in rows for h in (r.get("heat") or [])[i:i + 1] if h and h.get(key) is not None]
        out.append(median(vals) if vals else None)
    return out


def plot_heat(runs: list[dict], out: Path) -> None:
    """Per repeat and configuration: decode speed, clock under load and temperature (medians over prompts)."""
    from matplotlib.figure import Figure

    runs = [r for r in runs if has_heat(r)]
    fig = Figure(figsize=(12.0, 3.8), dpi=110, layout="constrained")
    axes = fig.subplots(1, 3)
    for i, r in enumerate(runs):
        for j, c in enumerate(r["thermal"]["configs"]):
            tag = f"{c} ({r['label']})" if len(runs) > 1 else c
            for ax, key in zip(axes, ("tok_s", "clock_mhz", "temp_c")):
                ys = _per_repeat(r, c, key)
                ax.plot(range(1, len(ys) + 1), [y if y is not None else float("nan") for y in ys], marker="o",
                        color=f"C{j}", ls=["-", "--", ":"][i % 3], label=tag)
    for ax, label in zip(axes, ("decode tokens / s", "clock under load (MHz)", "hottest CPU zone (°C)")):
        ax.set_xlabel("repeat")
        ax.set_ylabel(label)
        if ax.has_data():
            ax.legend(fontsize=7)
    axes[0].set_title("Speed per repeat (median over prompts)", fontsize=9)
    axes[1].set_title("Clock right after each run", fontsize=9)
    axes[2].set_title("Temperature right after each run", fontsize=9)
    fig.savefig(out)
