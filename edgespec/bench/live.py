"""The console side of a bench run: a live per-class table under a progress bar (tqdm), and the
final table. On a terminal the rows update in place after every run; when the output is piped
they are printed once per repeat pass."""
from __future__ import annotations

import sys
from typing import TextIO

from .measure import PEER, PLAIN, SPECULATIVE, RunRecord, is_peer
from .summary import class_metrics, group_runs, peer_figures, peer_key

__all__ = ["LiveTable", "format_table", "header", "HEADER", "reference_peer"]

WIDTH = 11  # of the config column; wider when a configuration's name is longer


def reference_peer(configs) -> str | None:
    """The peer the `x` column divides by: llama-cpp-python's when it ran, else the first peer."""
    peers = [c for c in configs if is_peer(c)]
    return PEER if PEER in peers else (peers[0] if peers else None)


def _x_label(peer: bool | str) -> str:
    return "x llama.cpp" if peer is True or peer == PEER else f"x {peer}"


def _x_width(peer: bool | str) -> int:
    return max(11, len(_x_label(peer)))


def header(peer: bool | str = False, width: int = WIDTH) -> str:
    """The table's column names; `peer`: with the `x PEER` column (True: llama.cpp)."""
    x = f" {_x_label(peer):>{_x_width(peer)}}" if peer else ""
    return (f"{'class':<10} {'config':<{width}} {'tok/s':>7} {'speed-up':>8}{x} {'TTFT ms':>8} {'prefill/s':>9} "
            f"{'accept':>6} {'tok/step':>8} {'draft%':>6} {'RSS MiB':>7}  same")


HEADER = header()


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def format_row(cls: str, config: str, m: dict, peer: bool | str = False, width: int = WIDTH) -> str:
    """One row; `peer`: the reference peer of the `x` column (True: llama.cpp), or none."""
    other = is_peer(config)
    if other:  # not required to match: how many tokens agree with plain before the first difference
        same = f"{_fmt(m.get('agree_tokens'), '.0f', '?')} tok agree"
    else:
        same = {True: "yes", False: "NO!"}.get(m.get("identical"), "?")
    speed = "" if config == PLAIN or other else _fmt(m.get("speedup"), ".2f")
    # a speculative peer's acceptance is its own (its drafted and accepted tokens)
    acc = "" if config in (PLAIN, PEER) or (other and m.get("acceptance") is None) else _fmt(m.get("acceptance"), ".0%")
    key = peer_key(PEER if peer is True else peer) if peer else ""
    x = f" {'' if other else _fmt(m.get(key), '.2f'):>{_x_width(peer)}}" if peer else ""
    return (f"{cls:<10} {config:<{width}} {m['tok_s']:>7.1f} {speed:>8}{x} {m['ttft_ms']:>8.0f} "
            f"{m['prefill_tok_s']:>9.0f} {acc:>6} {m['mean_accepted_length']:>8.2f} {m['draft_share']:>6.0%} "
            f"{m['peak_rss_bytes'] / 2**20:>7.0f}  {same}")


def format_table(classes: dict, overall: dict | None = None) -> list[str]:
    """Console rows: one per class and configuration, plain first."""
    configs = list(dict.fromkeys(c for block in classes.values() for c in block))
    peer = reference_peer(configs) or False
    width = max([WIDTH, *map(len, configs)])
    lines = [header(peer, width)]
    blocks = list(classes.items()) + ([("overall", overall)] if overall else [])
    for cls, block in blocks:
        for config, m in block.items():
            lines.append(format_row(cls, config, m, peer, width))
    return lines


def _running(runs: list[RunRecord], configs: list[str], greedy: bool = True) -> dict:
    """Per class and configuration, the figures of the runs so far (identity from token equality)."""
    groups = group_runs(runs)
    out: dict = {}
    for cls in dict.fromkeys(r.cls for r in runs):
        block: dict = {}
        for c in configs:
            per_prompt = [rs for (k, _, cfg), rs in groups.items() if k == cls and cfg == c]
            m = class_metrics(per_prompt, block.get(PLAIN) if not is_peer(c) else None)
            if not m:
                continue
            m["identical"] = all(
                r.tokens == groups[(k, p, PLAIN)][0].tokens
                for (k, p, cfg), rs in groups.items() if k == cls and cfg == c and (k, p, PLAIN) in groups
                for r in rs) if greedy else None
            block[c] = {**m, **peer_figures(groups, [cls], c)}
        out[cls] = block
    return out


def _prompt_line(runs: list[RunRecord], done: int, total: int, greedy: bool = True) -> str:
    """One prompt's runs in one repeat: speeds of every configuration and, greedy, whether outputs agree."""
    by = {r.config: r for r in runs}
    plain = by.get(PLAIN)
    parts = []
    for c, r in by.items():
        part = f"{c} {r.tok_s:.1f}"
        if c != PLAIN and not is_peer(c) and plain is not None and plain.tok_s:
            acc = f", acc {r.accepted / r.drafted:.0%}" if r.drafted else ""
            part += f" ({r.tok_s / plain.tok_s:.2f}x{acc})"
        parts.append(part)
    same = not greedy or plain is None or all(r.tokens == plain.tokens for r in runs if not is_peer(r.config))
    r0 = runs[0]
    return (f"[{done}/{total}] {r0.cls}/{r0.prompt} #{r0.repeat + 1} ({r0.prompt_tokens} prompt tokens): "
            f"{'; '.join(parts)} tok/s{'' if same else '  OUTPUT DIFFERS FROM PLAIN!'}")


class LiveTable:
    """`update(record, done, total)` after each run; `close()` at the end."""

    def __init__(self, configs: list[str], classes: list[str], *, file: TextIO | None = None,
                 repeat: int = 1, live: bool | None = None, greedy: bool = True) -> None:
        """greedy: whether runs are greedy, so that every configuration's output must equal plain's."""
        from tqdm import tqdm

        self.greedy = greedy
        self.file = file or sys.stderr
        self.configs, self.classes, self.repeat = configs, classes, max(repeat, 1)
        self.runs: list[RunRecord] = []
        self.live = self.file.isatty() if live is None else live
        self.peer = reference_peer(configs) or False
        self.width = max([WIDTH, *map(len, configs)])
        self._rows = []
        self._bar = tqdm(total=None, desc="bench", unit="run", file=self.file, disable=not self.live,
                         dynamic_ncols=True, leave=True)
        if self.live:
            n_rows = 1 + len(classes) * len(self._shown())
            self._rows = [tqdm(total=0, bar_format="{desc}", position=i + 1, file=self.file, leave=False)
                          for i in range(n_rows)]
            self._rows[0].set_description_str(header(self.peer, self.width))

    def update(self, rec: RunRecord, done: int, total: int) -> None:
        self.runs.append(rec)
        if self._bar.total is None:
            self._bar.reset(total=total)
        self._bar.update(1)
        self._bar.set_postfix_str(f"{rec.cls}/{rec.prompt} {rec.config} {rec.tok_s:.1f} tok/s", refresh=False)
        if self.live:
            self._refresh_rows()
            return
        same = [r for r in self.runs if (r.cls, r.prompt, r.repeat) == (rec.cls, rec.prompt, rec.repeat)]
        if len(same) == len(self.configs):  # every configuration ran on this prompt: one line for it
            print(_prompt_line(same, done, total, self.greedy), file=self.file, flush=True)
        if done % max(total // self.repeat, 1) == 0 or done == total:  # a repeat pass is complete
            self._print_pass(done, total)

    def _shown(self) -> list[str]:
        return [c for c in self.configs if c in (PLAIN, SPECULATIVE) or is_peer(c)] or self.configs

    def _table(self) -> list[str]:
        running = _running(self.runs, self._shown(), self.greedy)
        return [format_row(cls, c, m, self.peer, self.width) for cls, block in running.items()
                for c, m in block.items()]

    def _refresh_rows(self) -> None:
        for bar, text in zip(self._rows[1:], self._table()):
            bar.set_description_str(text)

    def _print_pass(self, done: int, total: int) -> None:
        print(f"-- after {done}/{total} runs (running medians)", file=self.file)
        for line in [header(self.peer, self.width), *self._table()]:
            print(line, file=self.file)
        self.file.flush()

    def close(self) -> None:
        for bar in [self._bar, *self._rows]:
            bar.close()
