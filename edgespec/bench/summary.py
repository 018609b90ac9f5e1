"""From measured runs to per-prompt and per-class figures (pure functions).

A configuration's decode speed is the ratio of totals: every run's tokens after its first step
over every run's time after its first step (the first step is timed with the prompt, so its
tokens are not counted either). The speed-up is that speed divided by plain decoding's, never a
figure derived from acceptance. Greedy speculative output must equal plain output token for
token; every prompt where it does not is listed as a mismatch (sampled runs are not compared
here: the tests check that a seed gives plain decoding's text whatever was drafted).

When the llama.cpp peer ran (peer.py), every edgespec configuration also gets `x_llamacpp`, the
same ratio of totals over the peer's speed on the same prompts and repeats, and beside it
`x_llamacpp_paired`: per prompt, the median over repeats of its tok/s over the peer's in the same
repeat (the two ran back to back), then the median over the prompts. The peer is another program
on a quantized GGUF, so its greedy text is not required to match; how far it agrees with edgespec
plain is reported (`agree_tokens`), never counted as a mismatch. Every other peer (llama-server,
plain or speculative: server_peer.py) gets the same pair of ratios under its own key
(`peer_key`: `x_llama_server`, `x_llama_server_ngram_simple`, ...) and its own agreement.
"""
from __future__ import annotations

from collections import defaultdict
from statistics import median

from .measure import PEER, PLAIN, RunRecord, is_peer
from .thermal import heat_rows

__all__ = ["summarise", "group_runs", "class_metrics", "repeat_spread", "prompt_rows", "mismatches",
           "first_difference", "peer_ratio", "peer_ratio_paired", "peer_agreement", "peer_figures", "peer_key",
           "peers_of"]


def peer_key(peer: str) -> str:
    """The metrics key of a configuration's speed over `peer`'s: x_llamacpp for llama-cpp-python,
    x_llama_server for llama-server, x_llama_server_ngram_simple for llama-server+ngram-simple."""
    return "x_llamacpp" if peer == PEER else "x_" + peer.replace("-", "_").replace("+", "_")


def group_runs(runs: list[RunRecord]) -> dict[tuple[str, str, str], list[RunRecord]]:
    """(class, prompt, config) -> its repeats, in run order."""
    out: dict[tuple[str, str, str], list[RunRecord]] = defaultdict(list)
    for r in runs:
        out[(r.cls, r.prompt, r.config)].append(r)
    return dict(out)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def repeat_spread(values: list[float]) -> dict:
    """{min, max, relative}: how far per-repeat speeds spread, relative = (max - min) / median."""
    mid = median(values)
    return {"min": min(values), "max": max(values), "relative": (max(values) - min(values)) / mid if mid > 0 else None}


def class_metrics(groups: list[list[RunRecord]], plain: dict | None = None) -> dict:
    """Figures for one configuration over a set of prompts (`groups`: one list of repeats per prompt)."""
    groups = [g for g in groups if g]
    if not groups:
        return {}
    flat = [r for g in groups for r in g]
    per_rep = _per_repeat_speed(groups)
    m = {
        **_prompt_figures(groups),
        "runs": len(flat),
        "tok_s": _rate(sum(r.decode_tokens for r in flat), sum(r.decode_s for r in flat)),
        "tok_s_per_repeat": per_rep,
        # how far the repeats spread: a device that heats (or a busy neighbour) widens it
        "tok_s_spread": repeat_spread(per_rep),
        "e2e_tok_s": _rate(sum(len(r.tokens) for r in flat), sum(r.total_s for r in flat)),
        **_step_figures(flat),
        "peak_rss_bytes": _first_repeat_peak(flat),
        "by_draft_length": _by_draft_length(flat),
    }
    if plain is not None:
        m["speedup"] = _ratio(m["tok_s"], plain.get("tok_s"))
        m["e2e_speedup"] = _ratio(m["e2e_tok_s"], plain.get("e2e_tok_s"))
    return m


def _prompt_figures(groups: list[list[RunRecord]]) -> dict:
    """Per prompt the median over its repeats: tokens made, time to first token, prefill speed."""
    ttft = [median(r.ttft_s for r in g) for g in groups]
    prompt_tokens = sum(g[0].prompt_tokens for g in groups)
    return {"prompts": len(groups), "new_tokens": int(sum(median(len(r.tokens) for r in g) for g in groups)),
            "prompt_tokens": int(prompt_tokens), "ttft_ms": 1e3 * median(ttft),
            "prefill_tok_s": _rate(prompt_tokens, sum(ttft))}


def _first_repeat_peak(flat: list[RunRecord]) -> int:
    """Peak RSS over the first repeat, where classes run in suite order: the allocator keeps what
    it took, so a later repeat would show every class at the whole run's peak."""
    first = min(r.repeat for r in flat)
    return max(r.peak_rss for r in flat if r.repeat == first)


def _rate(amount: float, seconds: float) -> float:
    """`amount` per second, 0.0 over no time."""
    return amount / seconds if seconds > 0 else 0.0


def _per_repeat_speed(groups: list[list[RunRecord]]) -> list[float]:
    """The class speed in each repeat alone: how noisy the medians are."""
    out = []
    for i in range(max(len(g) for g in groups)):
        reps = [g[i] for g in groups if i < len(g)]
        out.append(_rate(sum(r.decode_tokens for r in reps), sum(r.decode_s for r in reps)))
    return out


def _step_figures(flat: list[RunRecord]) -> dict:
    """Acceptance, tokens and drafts per target forward, and where a step's time went."""
    drafted, accepted, steps = (sum(getattr(r, f) for r in flat) for f in ("drafted", "accepted", "steps"))
    draft_ms, verify_ms = sum(r.draft_ms for r in flat), sum(r.verify_ms for r in flat)
    made = sum(len(r.tokens) for r in flat)
    return {
        "acceptance": accepted / drafted if drafted else None,
        "mean_accepted_length": made / steps if steps else 0.0,  # tokens committed per target forward
        "mean_draft_length": drafted / steps if steps else 0.0,
        "draft_ms_per_token": draft_ms / made if made else 0.0,
        "verify_ms_per_token": verify_ms / made if made else 0.0,
        "draft_share": draft_ms / (draft_ms + verify_ms) if draft_ms + verify_ms > 0 else 0.0,
    }


def _by_draft_length(flat: list[RunRecord]) -> list[dict]:
    """Steps and accepted drafts per (drafter, draft length), in drafter then length order."""
    by_k: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
    for r in flat:
        for key, (n, a) in r.by_k.items():
            drafter, k = key.split(":")
            by_k[(drafter, int(k))][0] += n
            by_k[(drafter, int(k))][1] += a
    return [{"drafter": drafter, "k": k, "steps": n, "accepted": a, "acceptance": a / (n * k)}
            for (drafter, k), (n, a) in sorted(by_k.items())]


def _paired(runs: list[RunRecord], peer_runs: list[RunRecord]) -> float | None:
    """One prompt: the median over repeats of tok/s over the peer's tok/s in the same repeat."""
    peer = {r.repeat: r for r in peer_runs}
    pairs = [r.tok_s / peer[r.repeat].tok_s for r in runs if r.repeat in peer and peer[r.repeat].tok_s > 0]
    return median(pairs) if pairs else None


def peers_of(groups: dict[tuple[str, str, str], list[RunRecord]]) -> list[str]:
    """The peer configurations that ran, in run order."""
    return list(dict.fromkeys(c for _, _, c in groups if is_peer(c)))


def peer_ratio(groups: dict[tuple[str, str, str], list[RunRecord]], classes: list[str], config: str,
               peer: str = PEER) -> float | None:
    """`config`'s speed over `peer`'s on `classes`: the ratio of totals (decode tokens over decode
    time), on the (prompt, repeat) pairs both ran."""
    mine = theirs = None
    for (cls, prompt, c), rs in groups.items():
        if c != config or cls not in classes:
            continue
        by_repeat = {r.repeat: r for r in groups.get((cls, prompt, peer), [])}
        for r in rs:
            if r.repeat in by_repeat:
                a, b = mine or (0, 0.0), theirs or (0, 0.0)
                mine = (a[0] + r.decode_tokens, a[1] + r.decode_s)
                theirs = (b[0] + by_repeat[r.repeat].decode_tokens, b[1] + by_repeat[r.repeat].decode_s)
    if mine is None or not mine[1] or not theirs[1] or not theirs[0]:
        return None
    return (mine[0] / mine[1]) / (theirs[0] / theirs[1])


def peer_ratio_paired(groups: dict[tuple[str, str, str], list[RunRecord]], classes: list[str],
                      config: str, peer: str = PEER) -> float | None:
    """`config`'s speed over `peer`'s on `classes`: the median of paired per-prompt ratios."""
    ratios = [_paired(rs, groups.get((cls, prompt, peer), []))
              for (cls, prompt, c), rs in groups.items() if c == config and cls in classes]
    ratios = [x for x in ratios if x is not None]
    return median(ratios) if ratios else None


def _agree(plain: list[int], peer: list[int]) -> int:
    at = first_difference(plain, peer)
    return len(plain) if at is None else at


def peer_agreement(groups: dict[tuple[str, str, str], list[RunRecord]], classes: list[str],
                   peer: str = PEER) -> dict:
    """How many greedy tokens `peer`'s output agrees with edgespec plain's before the first
    difference, per prompt (first runs): the median, the least, and the prompts that agree throughout."""
    agree, whole = [], 0
    for (cls, prompt, c), rs in groups.items():
        ref = groups.get((cls, prompt, PLAIN))
        if c != peer or cls not in classes or not ref:
            continue
        agree.append(_agree(ref[0].tokens, rs[0].tokens))
        whole += first_difference(ref[0].tokens, rs[0].tokens) is None
    if not agree:
        return {}
    return {"agree_tokens": median(agree), "agree_tokens_min": min(agree), "agree_prompts": whole,
            "identical": whole == len(agree)}


def peer_figures(groups: dict[tuple[str, str, str], list[RunRecord]], classes: list[str], config: str) -> dict:
    """The peer-relative fields of `config`'s metrics on `classes` ({} when no peer ran): a peer's
    agreement with plain, an edgespec configuration's ratios over every peer."""
    if is_peer(config):
        return peer_agreement(groups, classes, config)
    out: dict = {}
    for peer in peers_of(groups):
        key = peer_key(peer)
        out[key] = peer_ratio(groups, classes, config, peer)
        out[f"{key}_paired"] = peer_ratio_paired(groups, classes, config, peer)
    return out


def mismatches(groups: dict[tuple[str, str, str], list[RunRecord]], greedy: bool = True) -> list[dict]:
    """Every (prompt, configuration, repeat) whose greedy tokens differ from plain decoding's first
    run; none for sampled runs, which are not required to agree."""
    out: list[dict] = []
    if not greedy:
        return out
    for (cls, prompt, config), runs in sorted(groups.items()):
        ref = groups.get((cls, prompt, PLAIN))
        if not ref or is_peer(config):  # a peer is compared by peer_agreement, not required to match
            continue
        for r in runs:
            if r is ref[0]:
                continue
            at = first_difference(ref[0].tokens, r.tokens)
            if at is not None:
                out.append({"class": cls, "prompt": prompt, "config": config, "repeat": r.repeat,
                            "first_difference": at})
    return out


def _config_cells(rs: list[RunRecord], ref: list[RunRecord], greedy: bool, config: str,
                  peer_runs: dict[str, list[RunRecord]]) -> dict:
    """One configuration's figures on one prompt: per repeat, medians, and against plain and the peers."""
    drafted = sum(r.drafted for r in rs)
    cells = {
        "tok_s": [r.tok_s for r in rs],
        "ttft_ms": [1e3 * r.ttft_s for r in rs],
        "total_s": [r.total_s for r in rs],
        "median_tok_s": median(r.tok_s for r in rs),
        "acceptance": sum(r.accepted for r in rs) / drafted if drafted else None,
        "identical": all(first_difference(ref[0].tokens, r.tokens) is None for r in rs) if ref and greedy else None,
    }
    if is_peer(config):
        if ref:
            cells["agree_tokens"] = _agree(ref[0].tokens, rs[0].tokens)
        return cells
    for p, theirs in peer_runs.items():
        if theirs:
            cells[f"{peer_key(p)}_paired"] = _paired(rs, theirs)
    return cells


def prompt_rows(groups: dict[tuple[str, str, str], list[RunRecord]], configs: list[str],
                greedy: bool = True) -> list[dict]:
    """One row per prompt: its sizes, and per configuration the per-repeat speeds and medians."""
    keys = list(dict.fromkeys((cls, prompt) for cls, prompt, _ in groups))
    peers = peers_of(groups)
    rows = []
    for cls, prompt in keys:
        ref = groups.get((cls, prompt, PLAIN), [])
        row = {"class": cls, "id": prompt, "prompt_tokens": ref[0].prompt_tokens if ref else None,
               "new_tokens": len(ref[0].tokens) if ref else None, "configs": {}}
        peer_runs = {p: groups.get((cls, prompt, p), []) for p in peers}
        if peer_runs.get(PEER) and ref:
            row["agree_tokens"] = _agree(ref[0].tokens, peer_runs[PEER][0].tokens)
        for c in configs:
            rs = groups.get((cls, prompt, c), [])
            if rs:
                row["configs"][c] = _config_cells(rs, ref, greedy, c, peer_runs)
                row["configs"][c].update(heat_rows(rs))  # per repeat: the CPU right after the run (thermal.py)
        rows.append(row)
    return rows


def summarise(runs: list[RunRecord], configs: list[str], greedy: bool = True) -> dict:
    """{"classes": {cls: {config: metrics}}, "overall": {config: metrics}, "prompts": [...], "mismatches": [...]}"""
    groups = group_runs(runs)
    classes = list(dict.fromkeys(r.cls for r in runs))

    def block(selected: list[str]) -> dict:
        out: dict = {}
        for c in [PLAIN] + [c for c in configs if c != PLAIN]:
            per_prompt = [rs for (cls, _, cfg), rs in groups.items() if cfg == c and cls in selected]
            m = class_metrics(per_prompt, out.get(PLAIN) if not is_peer(c) else None)  # a peer: no speed-up
            if m:
                m["identical"] = not any(b["config"] == c and b["class"] in selected for b in bad) if greedy \
                    else None
                out[c] = {**m, **peer_figures(groups, selected, c)}
        return out

    bad = mismatches(groups, greedy)
    return {"classes": {cls: block([cls]) for cls in classes}, "overall": block(classes),
            "prompts": prompt_rows(groups, configs, greedy), "mismatches": bad}
