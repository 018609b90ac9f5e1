"""Memory budgets with a draft on the target's body: the draft costs its head only (no KV cache,
no forward scratch), so the speculative bound sits just above the plain one; the pair is opened,
measured and planned through EngineBudget.open_pair (tiny onnxruntime bundles)."""
from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest

from edgespec.bundle import load_bundle
from edgespec.memory import ModelMemory, candidate_bytes, describe_plan, lower_bounds, plan_memory
from edgespec.memory.loading import BudgetedLoad, EngineBudget
from edgespec.memory.measure import rss_bytes
from edgespec.memory.planner import PLAN_HEADROOM
from tests.zoo import DISAGREEING

MiB = 2**20
BASE = 80 * MiB
TARGET = ModelMemory("target", 400 * MiB, {"float32": 36864}, 262144)
OWN = ModelMemory("draft", 150 * MiB, {"float32": 36864}, 16384)
HEAD = ModelMemory("draft", 12 * MiB, {"float32": 0}, 16384, shares_body=True)


def test_only_a_draft_on_the_targets_body_holds_no_kv_cache():
    with pytest.raises(ValueError, match="bad memory figures"):
        ModelMemory("draft", 12 * MiB, {"float32": 0}, 16384)
    assert HEAD.kv("float32", 4096) == 0 and HEAD.workspace(256, 4096) == 0


def test_the_shared_bodys_bound_is_the_plain_one_plus_its_head_and_candidates():
    plain = lower_bounds(BASE, TARGET, None, k=4)
    shared, own = lower_bounds(BASE, TARGET, HEAD, k=4), lower_bounds(BASE, TARGET, OWN, k=4)
    extra = HEAD.fixed + candidate_bytes(4, 262144, 16384) - candidate_bytes(0, 262144, None)
    # the bounds carry the plan's unplanned headroom (planner.PLAN_HEADROOM), a share of each
    assert shared.least_speculative - plain.least_plain == pytest.approx(extra / (1 - PLAN_HEADROOM), abs=1)
    assert shared.least_speculative < own.least_speculative


def test_a_budget_holds_a_longer_context_with_the_draft_on_the_targets_body():
    budget = 1000 * MiB
    shared, own = plan_memory(budget, BASE, TARGET, HEAD, k=4), plan_memory(budget, BASE, TARGET, OWN, k=4)
    assert shared.use_draft and own.use_draft
    assert shared.kv_capacity > own.kv_capacity
    assert shared.total <= budget
    text = describe_plan(shared)
    assert "draft head on the target's body" in text and "draft KV cache" not in text


def test_a_draft_not_loaded_is_planned_from_its_estimate():
    """The engine hands finish() the draft it has, None when the first plan left it out."""
    load = BudgetedLoad(2**40, 4, 8)
    load.target = replace(TARGET, measured=True)
    plan = load.final(OWN, {"draft": None})
    assert plan.use_draft and plan.kv_capacity > 0


@pytest.fixture
def bundle(zoo):
    pytest.importorskip("onnxruntime")
    return zoo.bundle("llama", DISAGREEING)


def open_pair(bundle, **kw):
    from edgespec.runtimes.onnxruntime.split import open_shared_pair

    m = load_bundle(bundle).manifest
    return open_shared_pair(bundle / m.target.formats["onnx"].file, bundle / m.draft.formats["onnx"].file, **kw)


def test_engine_budget_opens_measures_and_plans_the_pair(bundle):
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    b = load_bundle(bundle)
    # a budget counts the whole process, and a test process holds what earlier tests loaded
    budget = rss_bytes() + 2**30
    own = EngineBudget(budget, b, "onnx", "onnx", OnnxRuntime.kv_dtypes, 4, 8, True)
    eb = EngineBudget(budget, b, "onnx", "onnx", OnnxRuntime.kv_dtypes, 4, 8, True, shared_body=True)
    assert eb._d_est.shares_body and eb._d_est.fixed <= own._d_est.fixed
    assert eb.load_draft
    target, draft = eb.open_pair(functools.partial(open_pair, bundle))
    with target, draft:
        assert target.kv_capacity == eb.first.kv_capacity  # the first plan sized the body's buffers
        plan = eb.finish({"target": target, "draft": draft})
        assert plan.use_draft and eb.load.draft.shares_body and eb.load.draft.measured
        assert eb.load.draft.fixed == draft.memory_bytes()["weights"] > 0
        assert eb.load.target.scratch is not None  # the body's scratch was probed through the target
        # the least each needs (the printed bounds are rounded up to a MiB each)
        assert plan.bounds.least_speculative - plan.bounds.least_plain < own._d_est.fixed
        # the probe left both runtimes empty and consistent
        assert target.n_past == draft.n_past == 0
        ids = [5, 9, 33, 2, 7]
        with OnnxRuntime(bundle / b.manifest.target.formats["onnx"].file) as fused:
            np.testing.assert_array_equal(np.array(target.forward(ids, n_logits=2)), fused.forward(ids, n_logits=2))
