"""The engine's configuration (config.py) and its assembly plan (assembly.py), without a model:
fake manifests stand in for bundles, and the installed backends are given, not looked up. The
seams for tools (Engine.variant, Engine.describe, an injected clock) run on a tiny bundle."""
from __future__ import annotations

import argparse
import dataclasses
from types import SimpleNamespace

import pytest

from edgespec.engine.assembly import MAX_PROBE_WIDTH, plan_engine, probe_width
from edgespec.engine.config import OPTIONS, EngineConfig, engine_config
from edgespec.errors import ConfigError
from edgespec.runtimes import BACKENDS

ALL = ["onnxruntime", "openvino", "llamacpp"]


def art(fmt: str, precision: str, role: str = "target"):
    return SimpleNamespace(file=f"{role}/{fmt}.model", precision=precision)


def manifest(target=("onnx", "openvino"), draft=("onnx", "openvino"), precision="int8", draft_precision="int4",
             self_draft=True):
    t = SimpleNamespace(formats={f: art(f, precision) for f in target})
    d = SimpleNamespace(formats={f: art(f, draft_precision, "draft") for f in draft}) if draft else None
    return SimpleNamespace(target=t, draft=d, self_draft=self_draft)


def plan(m=None, installed=ALL, **kw):
    return plan_engine(m or manifest(), EngineConfig(**kw), list(installed))


# ---------------------------------------------------------------- EngineConfig


@pytest.mark.parametrize("kw, match", [
    (dict(backend="tensorrt"), "unknown backend"),
    (dict(draft_backend="tensorrt"), "unknown backend"),
    (dict(policy="psychic"), "unknown draft policy"),
    (dict(k=-1), "k must be an integer >= 0"),
    (dict(k=True), "k must be an integer >= 0"),
    (dict(drafter="psychic"), "unknown drafter 'psychic'"),
    (dict(draft_body="borrowed"), "draft_body must be one of"),
    (dict(max_context=1), "max_context must be an integer >= 2"),
    (dict(prefill_chunk=0), "prefill_chunk must be an integer >= 1"),
    (dict(prefill_chunk=True), "prefill_chunk must be an integer >= 1"),
    (dict(threads=0), "threads must be an integer >= 1"),
    (dict(memory_budget="lots"), "memory budget must be a size"),
    (dict(use_draft="no"), "use_draft must be True or False"),
    (dict(device=""), "device must be a device name"),
    (dict(probe_context=10), "probe_context must be an integer in 64.."),
])
def test_a_bad_option_is_refused_when_the_config_is_built(kw, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kw)


def test_the_config_is_frozen_and_overrides_are_validated_again():
    cfg = EngineConfig(k=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.k = 4
    assert engine_config(cfg, backend="openvino") == EngineConfig(k=3, backend="openvino")
    assert engine_config() == EngineConfig() and engine_config(cfg) is cfg
    with pytest.raises(ConfigError, match="k must be"):
        engine_config(cfg, k=-2)
    with pytest.raises(ConfigError, match="unknown engine option kk"):
        engine_config(kk=3)
    assert EngineConfig(memory_budget="1KiB").budget_bytes == 1024 and EngineConfig().budget_bytes is None


def test_every_field_has_one_flag_and_the_cli_parses_into_the_config():
    from edgespec.cli.common import add_engine_args, engine_config_from_args

    assert set(OPTIONS) == {f.name for f in dataclasses.fields(EngineConfig)}
    assert OPTIONS["backend"].choices == tuple(BACKENDS)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--no-draft", "-k", "3", "--draft-policy", "cost", "--threads", "2", "--static-shapes",
                         "--max-context", "64", "--backend", "openvino"])
    cfg = engine_config_from_args(args)
    assert cfg == EngineConfig(use_draft=False, k=3, policy="cost", threads=2, static=True, max_context=64,
                               backend="openvino")
    assert engine_config_from_args(p.parse_args([])) == EngineConfig()
    # a verb's own default fills only what the user left unset
    assert engine_config_from_args(p.parse_args([]), tune=False).tune is False
    assert engine_config_from_args(p.parse_args(["--tune"]), tune=False).tune is True


def test_load_shows_the_config_fields_as_keywords():
    import inspect

    from edgespec.engine.engine import load

    params = inspect.signature(load).parameters
    assert list(params)[:2] == ["bundle", "config"]
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= set(params)


# ---------------------------------------------------------------- the plan


def test_the_backend_follows_the_preference_order_among_installed_ones():
    assert plan().backend == "onnxruntime"
    assert plan(installed=["openvino"]).backend == "openvino"
    assert plan(device="GPU").backend == "openvino"  # only OpenVINO drives a GPU
    assert plan(device="GPU", installed=["onnxruntime"]).backend == "onnxruntime"
    with pytest.raises(ConfigError, match="no installed backend runs"):
        plan(installed=["llamacpp"])
    with pytest.raises(ConfigError, match="bundle has no gguf artifacts for backend llamacpp"):
        plan(backend="llamacpp")


def test_the_draft_runs_on_the_targets_body_where_that_is_the_same_computation():
    p = plan(backend="openvino")
    assert p.shared_body and p.draft.backend == "openvino" and p.draft.file == "draft/openvino.model"
    assert p.drafter == "both" and p.policy == "cost" and p.k == 4 and p.pacing.max_k == 8
    assert "static" not in p.target.options and "spin" not in p.target.options
    own = plan(m=manifest(precision="fp32"), backend="openvino")
    assert not own.shared_body and "dearer" in own.drafting.reason
    # forced: it shares all the same; impossible: the reason is the error
    assert plan(m=manifest(precision="fp32"), backend="openvino", draft_body="shared").shared_body
    gguf = manifest(target=("gguf",), draft=("gguf",))
    if BACKENDS["llamacpp"].shared_body is None:
        with pytest.raises(ConfigError, match="--draft-body shared: the llamacpp backend cannot"):
            plan(m=gguf, draft_body="shared")
    with pytest.raises(ConfigError, match="not the target's own model"):
        plan(m=manifest(self_draft=False), backend="openvino", draft_body="shared")
    # a memory budget plans the shared body too (memory/loading.py: EngineBudget.open_pair)
    budgeted = plan(backend="openvino", memory_budget="1GB")
    assert budgeted.shared_body and budgeted.budgeted


def test_backend_options_come_from_the_registry_rows():
    # two models alternating on the cores: onnxruntime's threads must not spin between runs
    p = plan(drafter="model", draft_body="own")
    assert p.target.options["spin"] is False and p.draft.options["spin"] is False
    assert "spin" not in plan(drafter="ngram").target.options and plan(drafter="ngram").draft is None
    assert plan(use_draft=False).drafter is None and plan(use_draft=False).draft is None
    # static shapes: the target verifies k + 1 wide, the draft runs 2 wide
    s = plan(backend="openvino", static=True, k=3)
    assert s.target.options["static"] is True and s.target.options["width"] == 4
    assert s.draft.options["width"] == 2 and not s.shared_body and s.policy == "fixed"
    assert plan(backend="openvino", drafter="ngram").target.options["static"] is False  # the width still goes
    with pytest.raises(ConfigError, match="static shapes need the openvino backend"):
        plan(static=True)


def test_limits_and_the_exact_mode_switch():
    assert plan(max_context=64).target.options["kv_capacity"] == 64
    b = plan(max_context=64, memory_budget="1GB")
    assert "kv_capacity" not in b.target.options and b.budgeted and not b.switchable  # the budget sizes it
    assert plan().switchable and not plan(backend="openvino", static=True).switchable
    assert not plan(m=manifest(target=("gguf",), draft=("gguf",))).switchable  # llama.cpp has no exact modes


def test_the_draft_model_runs_where_it_has_an_artifact():
    m = manifest(target=("onnx",), draft=("openvino",))
    p = plan(m=m, drafter="model")
    assert p.backend == "onnxruntime" and p.draft.backend == "openvino" and p.draft.format == "openvino"
    assert p.draft.options["device"] is None  # another backend: not the target's device
    with pytest.raises(ConfigError, match="use --drafter ngram or --no-draft"):
        plan(m=m, drafter="model", draft_backend="onnxruntime")
    with pytest.raises(ConfigError, match="the bundle has no draft model"):
        plan(m=manifest(draft=None), drafter="model")
    assert plan(m=manifest(draft=None)).drafter == "ngram"


def test_probe_width_covers_what_the_drafting_may_ask_for():
    assert probe_width("both", "fixed", 3, None) == 4
    assert probe_width("both", "cost", 4, None) == 17  # 2k drafts and as many lookup tails
    assert probe_width(None, "fixed", 0, None) == 17  # a plain engine probes for the default speculative one
    assert probe_width("both", "cost", 20, None) == MAX_PROBE_WIDTH
    assert probe_width("both", "cost", 4, 5) == 5 and probe_width("both", "fixed", 0, None) == 2


def test_describe_is_plain_values():
    import json

    d = plan(backend="openvino").describe()
    assert json.loads(json.dumps(d)) == d
    assert d["draft_body"] == "shared" and d["target"]["precision"] == "int8"


# ---------------------------------------------------------------- the engine's seams for tools


def test_variants_share_the_runtimes_and_limits(zoo):
    from edgespec.decoding import FixedK
    from edgespec.engine.engine import load
    from tests.zoo import DISAGREEING

    with load(zoo.bundle("llama", DISAGREEING), drafter="model", k=2, max_context=96, draft_body="own") as e:
        plain, fixed = e.variant(plain=True), e.variant(policy=FixedK(3))
        ngram = e.variant(drafter="ngram", k=2)
        for d in (plain, fixed, ngram, e.decoder):
            assert d.target is e.target and d.context_limit == e.opened.context_limit == 96
            assert d.limits.verify_width == e.decoder.limits.verify_width
        assert plain.drafter is None and fixed.policy.k == 3 and fixed.draft is e.draft and ngram.draft is None
        assert ngram.policy.next_k() == 2
        desc = e.describe()
        assert desc["target"]["backend"] == "onnxruntime" and desc["draft"]["precision"] == DISAGREEING
        assert desc["config"]["k"] == 2 and desc["draft_body"] == "own" and desc["limits"]["context_limit"] == 96
    with load(zoo.bundle("llama"), use_draft=False) as e, pytest.raises(ConfigError, match="needs the draft model"):
        e.variant(drafter="model")


def test_an_injected_clock_times_the_generation(zoo):
    from edgespec.bundle import load_bundle
    from edgespec.engine.engine import Engine

    ticks = []

    def clock() -> float:  # one virtual second per reading
        ticks.append(len(ticks))
        return float(len(ticks))

    with Engine(load_bundle(zoo.bundle("llama")), EngineConfig(drafter="ngram"), clock=clock) as e:
        e.generate("the cat and the cat and the cat", max_tokens=8)
        st = e.last_stats
    assert ticks and st.steps > 0
    # every duration is a whole number of virtual seconds: nothing read the wall clock
    assert st.elapsed_s == int(st.elapsed_s) and st.verify_ms % 1000 == 0 and st.draft_ms % 1000 == 0
    assert st.verify_ms >= 1000 * st.steps


def test_decoder_limits_take_the_tightest_bound():
    from edgespec.decoding.limits import DecoderLimits
    from edgespec.engine.assembly import decoder_limits

    assert decoder_limits(None, [None, None], None, None, False) == DecoderLimits(
        context_limit=None, max_draft=None, verify_width=None, draft_width=None, trees=True, max_batch=None)
    # drafting within the keys the probe checked its widths at; no exact width, no such bound
    assert decoder_limits(None, [], None, SimpleNamespace(exact_width=5, trees=None, reach=4095), False
                          ).exact_reach == 4095
    assert decoder_limits(None, [], None, SimpleNamespace(exact_width=1, trees=None, reach=4095), False
                          ).exact_reach is None
    # draft trees unless the probe found a tree forward's rows off plain decoding's
    assert decoder_limits(None, [], None, SimpleNamespace(exact_width=5, trees=True, reach=99), False).trees
    assert not decoder_limits(None, [], None, SimpleNamespace(exact_width=5, trees=False, reach=99), False).trees
    exact = SimpleNamespace(exact_width=5, trees=None, reach=4095)
    lim = decoder_limits(512, [4096, None], None, exact, True)
    assert lim.context_limit == 512 and lim.verify_width == lim.draft_width == 5
    assert decoder_limits(None, [], None, exact, False).draft_width is None
    none_exact = SimpleNamespace(exact_width=1, trees=None, reach=99)
    assert decoder_limits(None, [], None, none_exact, True).verify_width is None
    plan = SimpleNamespace(kv_capacity=300, max_draft=3, prefill_chunk=32)
    lim = decoder_limits(1000, [400], plan, None, False)
    assert lim.context_limit == 300 and lim.max_draft == 3 and lim.max_batch == 32
    assert decoder_limits(None, [], SimpleNamespace(kv_capacity=9, max_draft=40, prefill_chunk=8), None,
                          False).max_batch == 41  # a verify of every draft still fits one forward
    # without a plan, prompts go in the config's chunks, never narrower than the widest verify
    assert decoder_limits(None, [], None, None, False, prefill_chunk=128).max_batch == 128
    assert decoder_limits(None, [], None, None, False, prefill_chunk=8).max_batch == MAX_PROBE_WIDTH
    assert decoder_limits(None, [], plan, None, False, prefill_chunk=128).max_batch == 32  # the plan's


def test_a_policy_gets_the_free_width_when_built_and_the_decoder_leaves_it():
    from edgespec.decoding import FixedK, SpeculativeDecoder, make_policy
    from tests.toy import ToyRuntime

    assert make_policy("cost", 3, free_width=4).free_width == 4 and make_policy("cost", 3).free_width == 1
    assert make_policy("fixed", 3, free_width=4) == FixedK(3)  # nothing to weigh: no field for it
    with pytest.raises(ConfigError, match="free_width"):
        make_policy("cost", 3, free_width=0)
    policy = make_policy("cost", 2, free_width=3)
    decoder = SpeculativeDecoder(ToyRuntime(40, seed=0), ToyRuntime(40, seed=1), policy=policy)
    assert decoder.policy is policy and policy.free_width == 3  # not rewritten from the target's capabilities
