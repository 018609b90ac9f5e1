"""Draft-length policies as pure functions, on synthetic costs and acceptances."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.cli.chat import k_over_time
from edgespec.decoding import DEFAULT_POLICY, DRAFTERS, POLICIES, CostAwareK, FixedK, HeuristicK, make_policy
from edgespec.decoding.policy import (
    best_k,
    best_tail,
    confidence_stop,
    decayed_counts,
    expected_tokens,
    family,
    heuristic_k,
    isotonic,
    verify_table,
)
from edgespec.engine.choices import DRAFT_BODIES
from edgespec.engine.config import DRAFT_BODY_CHOICES, DRAFTER_CHOICES, POLICY_CHOICES
from edgespec.errors import ConfigError

TARGET_MS = 30.0


def verify_ms(width: int, slope: float = 0.2) -> float:
    """A synthetic target: one-token step 30 ms, each extra verified token +20 %."""
    return TARGET_MS * (1 + slope * (width - 1))


def table(k_max: int, slope: float = 0.2) -> list[float]:
    return [verify_ms(w, slope) for w in range(1, k_max + 2)]


# ---------------------------------------------------------------- pure rules


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0  # only the target's own token
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.8, 0) == 1.0
    ks = [expected_tokens(0.7, k) for k in range(10)]
    assert ks == sorted(ks) and ks[-1] < 1 / (1 - 0.7)  # grows, bounded by 1 / (1 - alpha)


def test_best_k_plain_when_the_draft_costs_as_much_as_the_target():
    assert best_k(0.3, TARGET_MS, table(8)) == 0
    assert best_k(0.9, TARGET_MS, table(8)) == 0  # even a good draft cannot pay at that price
    assert best_k(0.0, 0.0, table(8)) == 0  # a free draft that is never right only widens the verify


def test_best_k_drafts_long_when_cheap_and_accepted():
    k = best_k(0.9, 1.0, table(8))
    assert k >= 5
    assert best_k(0.95, 0.5, table(16)) > k
    assert best_k(0.6, 0.05, table(8)) in range(1, 5)  # prompt lookup, moderate acceptance: a short draft
    # the chosen k beats every other k on expected tokens per ms
    rates = [expected_tokens(0.9, j) / (j * 1.0 + table(8)[j]) for j in range(9)]
    assert rates[k] == max(rates)


def test_best_k_shrinks_as_drafting_gets_dearer():
    ks = [best_k(0.85, c, table(8)) for c in (0.0, 2.0, 5.0, 10.0, 20.0, 30.0)]
    assert ks == sorted(ks, reverse=True) and ks[0] > 0 and ks[-1] == 0


def test_verify_table_interpolates_extrapolates_and_never_decreases():
    t = verify_table({1: 30.0, 5: 50.0}, 7, slope=0.2)
    assert t[:5] == pytest.approx([30, 35, 40, 45, 50])
    assert t[5:] == pytest.approx([56, 62])  # beyond the data: +0.2 × the one-token cost per token
    only_wide = verify_table({3: 42.0}, 4, slope=0.2)  # implies 30 ms for one token
    assert only_wide == pytest.approx([30, 36, 42, 48])
    # a dear narrow sample and a cheap wide one disagree: they are pooled, neither steers alone
    noisy = verify_table({1: 30.0, 2: 60.0, 3: 33.0}, 3, slope=0.2)
    assert noisy == pytest.approx([30.0, 46.5, 46.5])
    with pytest.raises(ValueError):
        verify_table({}, 3, 0.2)


def test_isotonic_pools_adjacent_violators():
    assert isotonic([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert isotonic([1.0, 1.43, 1.22, 1.07, 2.16, 1.51]) == pytest.approx([1.0, 1.24, 1.24, 1.24, 1.835, 1.835])
    out = isotonic([3.0, 1.0, 2.0, 0.0])
    assert out == pytest.approx([1.5] * 4) and sum(out) == pytest.approx(6.0)


def test_heuristic_plus_two_minus_one():
    assert heuristic_k(4, 4, 4, 1, 10) == 6
    assert heuristic_k(4, 4, 2, 1, 10) == 3
    assert heuristic_k(9, 9, 9, 1, 10) == 10  # capped
    assert heuristic_k(1, 1, 0, 1, 10) == 1  # floored
    assert heuristic_k(4, 0, 0, 1, 10) == 4  # nothing drafted: nothing learned


def test_confidence_stop_uses_the_joint_probability():
    assert not confidence_stop([0.9], 0.5)
    assert not confidence_stop([0.9, 0.8], 0.5)  # 0.72
    assert confidence_stop([0.9, 0.8, 0.6], 0.5)  # 0.432: a rejection has become likely
    assert confidence_stop([0.3], 0.5)
    assert not confidence_stop([0.01, 0.01], 0.0)  # 0 disables the stop


def test_acceptance_counts():
    assert decayed_counts(0.0, 0.0, 4, 4, 0.8) == (4, 4)  # fully accepted: no failure observed
    assert decayed_counts(0.0, 0.0, 4, 1, 0.8) == (1, 2)  # one success, then the first rejection
    h, t = decayed_counts(10.0, 10.0, 3, 0, 0.5)
    assert (h, t) == (5.0, 6.0)
    # under sampling the tested drafts' acceptance probabilities count instead of their coin flips
    assert decayed_counts(0.0, 0.0, 4, 1, 0.8, expected=1.7) == (1.7, 2)
    assert decayed_counts(1.0, 1.0, 4, 4, 0.5, expected=3.6) == (4.1, 4.5)


def test_sampled_acceptance_is_learned_from_probabilities_not_coin_flips():
    """A draft accepted with probability 0.85 a token: from the flips one step's rejection drags
    the decayed estimate far down; from the probabilities it stays at 0.85."""
    flips, probs = CostAwareK(), CostAwareK()
    for accepted in (4, 4, 0, 0, 1):  # an unlucky stretch
        tested = accepted + (accepted < 4)
        flips.update(4, accepted, 1.0, 1.0, source="model")
        probs.update(4, accepted, 1.0, 1.0, source="model", expected=0.85 * tested)
    assert probs.acceptance("model") > 0.8 > 0.7 > flips.acceptance("model")


# ---------------------------------------------------------------- policy objects


def test_fixed_and_heuristic_policies():
    assert FixedK(3).next_k() == FixedK(3).next_k("ngram:2") == 3
    h = HeuristicK(4, k_min=1, k_max=8)
    h.update(4, 4, 1.0, 1.0, source="model")
    h.update(4, 0, 1.0, 1.0, source="ngram:3")
    assert h.next_k("model") == 6 and h.next_k("ngram:3") == 3 and h.next_k("ngram:1") == 4
    for _ in range(5):
        h.update(6, 6, 1.0, 1.0, source="model")
    assert h.next_k("model") == 8
    with pytest.raises(ConfigError, match="k_min <= k <= k_max"):
        HeuristicK(9, k_max=8)


def test_confidence_policy_stops_drafts():
    p = make_policy("confidence", 3)
    assert p.uses_confidence and p.next_k() == 6
    assert p.keep_drafting([0.95, 0.9]) and not p.keep_drafting([0.5, 0.5])
    assert not FixedK(4).uses_confidence and FixedK(4).keep_drafting([0.01])
    with pytest.raises(ConfigError, match="confidence threshold"):
        FixedK(4, min_joint=1.5)


def test_best_tail_is_best_k_of_a_free_drafter_after_nothing():
    for alpha in (0.1, 0.5, 0.9):
        assert best_tail(0.9, 0, 3.0, alpha, table(8)) == best_k(alpha, 0.0, table(8))


def test_best_tail_appends_what_pays_for_its_verify():
    cheap = table(16, slope=0.02)
    assert best_tail(0.95, 4, 3.0, 0.0, cheap) == 0  # a lookup that is never right only widens the verify
    assert best_tail(0.95, 4, 3.0, 0.9, cheap) == 12  # one that is: as far as the table goes
    # a tail is tested only after the whole head: behind an unreliable head it is worth less
    assert best_tail(0.3, 4, 3.0, 0.6, table(16, 0.05)) == 0 < best_tail(0.95, 4, 3.0, 0.6, table(16, 0.05))
    # the choice is the best rate of the step as a whole
    t = best_tail(0.9, 3, 2.0, 0.6, table(16))
    rate = [(expected_tokens(0.9, 3) + 0.9 ** 3 * (expected_tokens(0.6, j) - 1)) / (6.0 + table(16)[3 + j])
            for j in range(14)]
    assert rate[t] == max(rate)


def primed_policy(model_alpha: float, ngram_alpha: float, slope: float = 0.02) -> CostAwareK:
    """A cost policy that has measured plain steps, model drafts (3 ms per token) and 1-gram
    lookups with these acceptances, on a target whose verifies cost `slope` per extra token."""
    p = CostAwareK(k_max=8)
    for _ in range(p.warmup):
        p.update(0, 0, 0.0, verify_ms(1, slope))
    for _ in range(20):
        for src, alpha, cost in (("model", model_alpha, 3.0), ("ngram:1", ngram_alpha, 0.001)):
            accepted = round(4 * alpha)
            p.update(4, accepted, 4 * cost, verify_ms(5, slope), source=src, ms_per_token=cost)
    return p


def test_cost_policy_plans_tails_from_measured_acceptance():
    assert CostAwareK().next_tail("ngram:1", "model", 4) == 0  # nothing measured yet
    good, bad = primed_policy(0.95, 0.9), primed_policy(0.95, 0.0)
    assert good.next_tail("ngram:1", "model", 4) > 0
    assert bad.next_tail("ngram:1", "model", 4) == 0
    assert good.next_tail("ngram:1", "model", 0) == 0  # a tail follows a draft
    # learn() moves a tail source's acceptance like a step of its own would
    before = bad.acceptance("ngram:1")
    for _ in range(5):
        bad.learn("ngram:1", 4, 4)
    assert bad.acceptance("ngram:1") > before
    # policies that do not weigh costs append no tails and keep the drafters' order
    for other in (FixedK(4), HeuristicK()):
        assert other.next_tail("ngram:3", "model", 2) == 0 and other.prefers("ngram:1", "model")


def test_cost_policy_prefers_the_drafter_with_the_better_rate():
    p = primed_policy(0.95, 0.1)
    assert not p.prefers("ngram:1", "model") and p.prefers("model", "ngram:1")
    assert p.rate("model") > p.rate("ngram:1") > 0
    assert primed_policy(0.2, 0.9).prefers("ngram:1", "model")
    assert p.prefers("ngram:3", "model")  # never measured: try it


def test_cost_policy_keeps_verify_costs_per_drafter_family():
    # on a shared body a model draft's verify reuses the rows its drafting computed: cheaper than
    # a lookup's of the same width, and neither should set the other's plan
    assert family("ngram:3") == "ngram" and family("model") == "model"
    p = CostAwareK(k_max=8)
    for _ in range(p.warmup):
        p.update(0, 0, 0.0, verify_ms(1))
    for _ in range(5):
        p.update(4, 4, 8.0, 0.7 * verify_ms(1), source="model", ms_per_token=2.0)
        p.update(4, 2, 0.0, 2.0 * verify_ms(1), source="ngram:2", ms_per_token=0.001)
    assert p.relative_verify("model")[5] == pytest.approx(0.7)
    assert p.relative_verify("ngram")[5] == pytest.approx(2.0)
    assert set(p.snapshot()["verify"]) == {"model", "ngram"}


def test_a_tail_costs_what_tokens_add_to_a_lookup_verify():
    cheap, dear = primed_policy(0.95, 0.6, slope=0.01), primed_policy(0.95, 0.6, slope=0.01)
    for _ in range(5):  # the same model verifies; lookup verifies 3x dearer per token in `dear`
        for w in range(2, 10):
            dear.update(w - 1, w // 2, 0.0, verify_ms(w, 0.3), source="ngram:1", ms_per_token=0.001)
            cheap.update(w - 1, w // 2, 0.0, verify_ms(w, 0.01), source="ngram:1", ms_per_token=0.001)
    assert 0.3 < cheap.acceptance("ngram:1") < 0.8
    assert cheap.acceptance("ngram:1") == pytest.approx(dear.acceptance("ngram:1"))
    assert cheap.next_tail("ngram:1", "model", 4) > dear.next_tail("ngram:1", "model", 4)
    # a verify with a tail mixes both families' costs: it goes into neither table
    before = {f: dear.relative_verify(f) for f in ("model", "ngram")}
    dear.update(2, 2, 4.0, 9 * verify_ms(1), source="model", ms_per_token=3.0, width=6)
    assert {f: dear.relative_verify(f) for f in ("model", "ngram")} == before


def test_cost_policy_takes_no_plain_unit_from_an_unmeasured_step():
    p = CostAwareK(k_max=8)
    for _ in range(p.warmup):
        p.update(0, 0, 0.0, verify_ms(1))
    p.update(0, 0, 0.0, None)  # a plain step whose row was computed ahead: no measure of one
    assert p.snapshot()["plain_ms"] == verify_ms(1)
    p.update(3, 3, 3.0, None, source="ngram:3", ms_per_token=0.001)  # acceptance still counts
    assert p.acceptance("ngram:3") > 0.5 and p.relative_verify("ngram") == {1: 1.0}


def simulate(policy, draft_ms: float, alpha: float, steps: int = 400, source: str = "model", seed: int = 0):
    """Drive a policy with a synthetic device; returns (tokens per ms, k per step)."""
    rng = np.random.default_rng(seed)
    tokens, ms, ks = 0, 0.0, []
    for _ in range(steps):
        k = policy.next_k(source)
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        step_draft, step_verify = k * draft_ms, verify_ms(k + 1)
        policy.update(k, accepted, step_draft, step_verify, source=source, ms_per_token=draft_ms if k else None)
        tokens, ms = tokens + accepted + 1, ms + step_draft + step_verify
        ks.append(k)
    return tokens / ms, ks


PLAIN_RATE = 1 / TARGET_MS


def test_cost_policy_falls_back_to_plain_when_drafting_cannot_pay():
    rate, ks = simulate(CostAwareK(k_max=8), draft_ms=TARGET_MS, alpha=0.3)
    assert ks[0] == 0  # the first step measures a plain step
    assert sum(k > 0 for k in ks) <= 8  # a few probes, spaced further and further apart
    assert rate > 0.97 * PLAIN_RATE
    probes = [i for i, k in enumerate(ks) if k > 0]
    gaps = np.diff(probes[1:])
    assert (np.diff(gaps) >= 0).all()  # the probe interval doubles while probes keep losing


def test_cost_policy_drafts_long_for_a_cheap_accurate_draft():
    rate, ks = simulate(CostAwareK(k_max=8), draft_ms=1.0, alpha=0.9)
    assert np.median(ks[20:]) >= 5
    # the best possible here is k = 8: 6.1 tokens for 86 ms, 2.14× plain
    assert rate > 1.9 * PLAIN_RATE


def test_cost_policy_uses_a_free_lookup_at_moderate_acceptance():
    rate, ks = simulate(CostAwareK(k_max=8), draft_ms=0.01, alpha=0.6, source="ngram:2")
    assert 1 <= np.median(ks[20:]) <= 4 and rate > 1.2 * PLAIN_RATE
    rate, ks = simulate(CostAwareK(k_max=8), draft_ms=0.01, alpha=0.02, source="ngram:1")
    assert rate > 0.95 * PLAIN_RATE  # lookup that never matches the target is abandoned


def test_cost_policy_adapts_when_acceptance_changes():
    p = CostAwareK(k_max=8)
    _, before = simulate(p, draft_ms=2.0, alpha=0.95, steps=200)
    _, after = simulate(p, draft_ms=2.0, alpha=0.05, steps=200, seed=1)
    assert np.median(before[50:]) >= 4
    assert sum(k > 0 for k in after[50:]) <= 5


def test_cost_policy_recovers_from_an_outlier_measurement():
    # a busy neighbour makes the first 3-token verify look three times dearer than it is
    p = CostAwareK(k_max=8)
    p.update(0, 0, 0.0, verify_ms(1))
    p.update(2, 2, 2.0, 3 * verify_ms(3), source="model", ms_per_token=1.0)
    assert p.plan("model") <= 1  # fooled at first ...
    _, ks = simulate(p, draft_ms=1.0, alpha=0.9, steps=200)
    assert np.median(ks[100:]) >= 5  # ... but exploring one token further keeps widths measured


def test_cost_policy_is_unmoved_by_a_neighbour_slowing_everything_alike():
    # wide verifies measured while the machine was three times slower, plain steps since then
    # fast again: costs are kept relative to a plain step at the time, so the plan holds
    calm, busy = CostAwareK(k_max=8), CostAwareK(k_max=8)
    for p, load in ((calm, 1.0), (busy, 3.0)):
        p.update(0, 0, 0.0, load * verify_ms(1))
        for w in range(2, 10):
            p.update(w - 1, 2, 0.0, load * verify_ms(w), source="model", ms_per_token=load * 3.0)
    for _ in range(5):
        busy.update(0, 0, 0.0, verify_ms(1))
    assert busy.plan("model") == calm.plan("model") > 0
    assert busy.relative_verify("model") == pytest.approx(calm.relative_verify("model"))


def test_cost_policy_explores_one_token_further_now_and_then():
    p = CostAwareK(k_max=8, explore_every=4)
    for _ in range(p.warmup):
        p.update(0, 0, 0.0, verify_ms(1))
    for w in range(2, 10):
        p.update(w - 1, 2, 0.0, verify_ms(w), source="model", ms_per_token=3.0)  # alpha about 0.67
    planned = p.plan("model")
    assert 0 < planned < 8
    assert [p.next_k("model") for _ in range(8)] == [planned] * 3 + [planned + 1] + [planned] * 3 + [planned + 1]


def test_cost_policy_measures_plain_steps_first_and_now_and_then():
    p = CostAwareK(k_max=8, refresh_every=10)
    p.update(0, 0, 0.0, 5 * verify_ms(1))  # the first forward after loading: one-off costs
    assert p.next_k("ngram:3") == 0  # one sample is not a unit yet
    for _ in range(p.warmup - 1):
        p.update(0, 0, 0.0, verify_ms(1))
    assert p.snapshot()["plain_ms"] == verify_ms(1)  # the outlier is outvoted
    ks = []
    for _ in range(30):  # a lookup that always matches and is always accepted
        k = p.next_k("ngram:3")
        ks.append(k)
        p.update(k, k, 0.01, verify_ms(k + 1), source="ngram:3", ms_per_token=0.001 if k else None)
    assert ks[0] > 0 and ks.count(0) == 2 and ks[10] == ks[21] == 0  # one plain step every 11


def test_cost_policy_drafts_into_a_free_width_however_noisy_its_measure():
    # a target that computes 2 rows per forward anyway (a static width of 2): a one-token draft
    # costs nothing on its side, so even a weak lookup is worth it there, although a noisy sample
    # makes width 2 look 40% dearer
    def primed(free_width):
        p = CostAwareK(k_max=8)
        p.free_width = free_width
        for _ in range(p.warmup):
            p.update(0, 0, 0.0, verify_ms(1))
        for accepted in (1, 0, 0, 0, 0):  # alpha about 0.2
            p.update(1, accepted, 0.0, 1.4 * verify_ms(1), source="ngram:1", ms_per_token=0.001)
        return p
    assert primed(1).plan("ngram:1") == 0
    assert primed(2).plan("ngram:1") == 1
    assert primed(2).snapshot()["plain_ms"] == pytest.approx(1.4 * verify_ms(1))  # free-width steps are plain ones


def test_cost_policy_keeps_sources_apart():
    p = CostAwareK(k_max=8)
    simulate(p, draft_ms=0.01, alpha=0.95, source="ngram:3", steps=100)
    simulate(p, draft_ms=0.01, alpha=0.05, source="ngram:1", steps=100)
    assert p.acceptance("ngram:3") > 0.8 > 0.2 > p.acceptance("ngram:1")
    assert p.plan("ngram:3") >= 4 and p.plan("ngram:1") == 0
    assert p.plan("model") is None  # never drafted: unknown cost
    assert p.next_k("model") == p.probe_k  # so it gets a try


def test_cost_policy_validation():
    with pytest.raises(ConfigError, match="probe_every"):
        CostAwareK(probe_every=0)
    with pytest.raises(ConfigError, match="accept_decay"):
        CostAwareK(accept_decay=0)
    with pytest.raises(ConfigError, match="window"):
        CostAwareK(window=0)
    with pytest.raises(ConfigError, match="refresh_every"):
        CostAwareK(refresh_every=0)
    assert CostAwareK(k_max=0).next_k() == 0


# ---------------------------------------------------------------- registry, CLI


def test_registry():
    assert list(POLICIES) == ["fixed", "heuristic", "confidence", "cost"] and DEFAULT_POLICY in POLICIES
    assert isinstance(make_policy("fixed", 2), FixedK) and make_policy("fixed", 2).next_k() == 2
    assert isinstance(make_policy("cost", 6), CostAwareK) and make_policy("cost", 6).k_max == 12
    assert make_policy("heuristic", 3).k_max == 6
    for name in POLICIES:
        assert make_policy(name, 0).next_k() == 0  # k = 0 is plain decoding under every policy
    with pytest.raises(ConfigError, match="unknown draft policy 'nope'; choose one of: fixed"):
        make_policy("nope", 2)
    with pytest.raises(ConfigError, match="k must be an integer >= 0"):
        make_policy("cost", -1)


def test_cli_choices_match_the_registries():
    assert POLICY_CHOICES == tuple(POLICIES)
    assert DRAFTER_CHOICES == ("auto", *DRAFTERS, "none")
    assert DRAFT_BODY_CHOICES == DRAFT_BODIES


def test_k_over_time_is_run_length_encoded():
    ks = [0, 0, 0, 2, 4, 4, 4, 0]
    src = ["", "", "", "model", "ngram:3", "ngram:2", "ngram:3", ""]
    assert k_over_time(ks, src) == "0×3 2 4L×3 0"
    long = k_over_time([i % 2 for i in range(100)], ["model"] * 100, max_runs=5)
    assert long == "0 1 0 1 0 ... (+95 runs)"


def test_a_source_is_one_typed_value_with_one_string_form():
    from edgespec.decoding.drafters import lookup_source
    from edgespec.decoding.sources import Source

    assert Source("ngram", 3).key == lookup_source(3) == "ngram:3" and Source("model").key == "model"
    assert Source.parse("ngram:3") == Source("ngram", 3) and Source.parse("model") == Source("model")
    assert Source.parse("recycle:tree") == Source("recycle") and family("recycle:tree") == "recycle"
    for bad in ({"kind": "ngram:3"}, {"kind": ""}, {"kind": "ngram", "n": -1}, {"kind": "ngram", "n": True}):
        with pytest.raises(ConfigError):
            Source(**bad)


def test_lookahead_guesses_are_fed_while_their_hits_pay_for_the_wider_forwards():
    """A model draft costs 3 ms against a 30 ms plain step (0.1 of a step), and each guess drawn
    saves one. With rows at 0.2 of a step three guesses cost 0.6 a forward, which one hit in four
    forwards does not pay; with rows at 0.001 of a step it does."""
    assert FixedK(4).lookahead("model", 3) == 3  # policies that weigh no costs feed them all
    dear_rows = primed_policy(0.9, 0.5, slope=0.2)
    assert dear_rows.lookahead("model", 3) == 3  # no hit rate measured yet
    for _ in range(10):
        dear_rows.learn_lookahead("model", forwards=4, hits=1)
    plans = [dear_rows.lookahead("model", 3) for _ in range(2 * dear_rows.probe_every)]
    assert plans.count(0) == len(plans) - 2 and plans.count(3) == 2  # a probe now and then

    cheap_rows = primed_policy(0.9, 0.5, slope=0.001)  # a row costs 0.001 step: one hit in 40 forwards pays
    for _ in range(10):
        cheap_rows.learn_lookahead("model", forwards=4, hits=1)
    assert [cheap_rows.lookahead("model", 3) for _ in range(20)] == [3] * 20
    assert cheap_rows.lookahead("model", 0) == 0
