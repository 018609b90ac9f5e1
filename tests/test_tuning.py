"""The tuner (edgespec/engine/tuning.py): the choice is a pure function of fake measurements; which
configurations are candidates comes from fake manifests; how a step is measured is checked on toy
runtimes that record their forwards; one integration test measures tiny real models on
onnxruntime and OpenVINO (the chosen configuration is a measured one, cached, and remeasured
under retune)."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np
import pytest

from edgespec.engine.assembly import Tuned, decoder_limits, plan_engine
from edgespec.engine.config import EngineConfig
from edgespec.engine.tuning import (
    ACCEPTANCES,
    Measurement,
    candidates,
    choose,
    contenders,
    merged,
    skip_reason,
    verify_costs,
)
from tests.test_assembly import ALL, manifest
from tests.toy import ToyRuntime


def fake(backend="onnxruntime", body="shared", *, one=30.0, draft=10.0, c=(1.0, 1.1, 1.3, 1.6, 2.2), exact=17,
         free=True) -> Measurement:
    """A measurement with verify costs c(B) for B = 2, 3, 5, 9, 17 (those within `exact`)."""
    widths = (2, 3, 5, 9, 17)
    return Measurement(backend, body, free, one, draft if body else 0.0,
                       {b: one * cb for b, cb in zip(widths, c) if b <= exact}, exact, 1.0)


def steep_c():
    return (1.64, 2.1, 2.63, 5.32, 9.0)  # llama.cpp's c(B) on the 2-vCPU AVX2 machine (issue 22), extrapolated


# ---------------------------------------------------------------- the choice (pure)


def test_a_cheaper_step_wins_and_the_choice_is_one_of_the_candidates():
    # equal one-token and draft costs: the flatter verify curve commits more per ms
    steep = fake("llamacpp", "own", one=25.0, c=steep_c(), exact=7)
    flat = fake("onnxruntime", "shared", one=25.0, c=(0.97, 1.1, 1.46, 2.75, 4.0))
    choice = choose([steep, flat])
    assert (choice.backend, choice.draft_body) == ("onnxruntime", "shared") and flat.score() > steep.score()
    # a much cheaper one-token forward outweighs a steeper curve
    assert choose([fake("llamacpp", "own", one=10.0, c=steep_c(), exact=7), flat]).backend == "llamacpp"
    # no drafting: the cheapest one-token forward wins, whatever its verify curve
    plain = [fake("llamacpp", None, one=20.0, c=(3, 4, 5, 6, 7), free=False),
             fake("onnxruntime", None, one=32.0, free=False)]
    assert choose(plain).backend == "llamacpp"
    assert plain[0].score() == pytest.approx(1e3 / 20.0)


def test_the_draft_cost_decides_between_bodies_with_equal_verifies():
    shared, own = fake(body="shared", draft=8.0), fake(body="own", draft=15.0)
    assert choose([own, shared]).draft_body == "shared"
    assert choose([fake(body="shared", draft=15.0), fake(body="own", draft=8.0)]).draft_body == "own"


def test_a_tie_or_a_small_difference_keeps_the_first_listed():
    a, b = fake("onnxruntime"), fake("openvino")
    assert choose([a, b]).backend == "onnxruntime" and choose([b, a]).backend == "openvino"
    slightly, clearly = fake("openvino", one=29.0), fake("openvino", one=25.0)  # 3% and 20% faster
    assert choose([a, slightly]).backend == "onnxruntime" and choose([a, clearly]).backend == "openvino"
    with pytest.raises(ValueError):
        choose([])


def test_the_width_limit_follows_the_verify_curve_and_stays_within_the_exact_widths():
    steep = fake(c=(1.6, 2.6, 4.5, 9.0, 18.0), free=False)  # each verified token costs nearly a step
    flat = fake(c=(1.0, 1.0, 1.05, 1.1, 1.2))
    assert choose([steep]).verify_width < choose([flat]).verify_width == 17
    narrow = fake(c=(1.0, 1.0, 1.05, 1.1, 1.2), exact=5)  # the probe found only 2-5 exact
    assert set(narrow.verify_ms) == {2, 3, 5} and choose([narrow]).verify_width == 5
    # a drafting step that never pays still leaves width 2, for a policy that finds it does
    hopeless = fake(draft=100.0, c=(3.0, 5.0, 9.0, 17.0, 33.0), free=False)
    assert hopeless.best(ACCEPTANCES[-1], hopeless.draft_ms)[0] == 0 and choose([hopeless]).verify_width == 2


def test_a_noisy_sample_cannot_make_a_wider_forward_cheaper():
    noisy = fake(c=(0.3, 0.9, 1.3, 1.6, 2.2))  # a 2-token verify timed below a one-token forward
    widths = sorted(noisy.curve)
    assert all(noisy.curve[a] <= noisy.curve[b] for a, b in zip(widths, widths[1:]))
    assert noisy.curve[1] == noisy.curve[2] < noisy.one_token_ms
    assert choose([noisy]).verify_width > 2


def test_free_sources_widen_the_limit_a_dear_draft_model_alone_would_narrow():
    model_only = fake(draft=25.0, free=False)
    with_lookup = fake(draft=25.0, free=True)
    assert model_only.draft_costs == (25.0,) and with_lookup.draft_costs == (25.0, 0.0)
    assert choose([with_lookup]).verify_width > choose([model_only]).verify_width


def test_the_two_best_are_measured_again_only_when_close_and_keep_their_fastest_figures():
    a, b, far = fake("onnxruntime", one=30.0), fake("openvino", one=31.0), fake("llamacpp", one=90.0)
    assert contenders([far, b, a]) == [1, 2] and contenders([a, far]) == [] and contenders([a]) == []
    quiet = fake("onnxruntime", one=25.0, draft=12.0, c=(1.2, 1.0, 1.0, 1.0, 1.0), exact=9)
    m = merged(a, quiet)
    assert m.one_token_ms == 25.0 and m.draft_ms == 10.0 and set(m.verify_ms) == {2, 3, 5, 9}
    assert m.verify_ms[2] == min(a.verify_ms[2], quiet.verify_ms[2]) and m.measure_ms == 2.0


def test_a_measurement_survives_its_cache_form():
    m = fake(exact=9)
    back = Measurement.from_dict({**m.to_dict(), "cached": True})
    assert back.cached and back.verify_ms == m.verify_ms and back.score() == pytest.approx(m.score())


@pytest.mark.parametrize("poison", [
    {"one_token_ms": 0}, {"one_token_ms": 1e400}, {"exact_width": 1e400}, {"exact_width": "9"},
    {"verify_ms": {"2": -1.0}}, {"verify_ms": {"x": 3.0}}, {"draft_body": "both"}, {"bogus": 1}, {"free": "yes"},
])
def test_a_poisoned_tuning_record_is_measured_again(tmp_path, caplog, poison):
    """A cached record that fails validation is discarded with a log line, never a crash (a zero
    one-token time used to divide by zero) and never believed."""
    import json

    from edgespec.engine.tuning import _read

    path = tmp_path / "record.json"
    path.write_text(json.dumps({**fake(exact=9).to_dict(), **poison}))
    with caplog.at_level("WARNING"):
        assert _read(path) is None
    assert "discarding the cached tuning record" in caplog.text
    path.write_text(json.dumps(fake(exact=9).to_dict()))
    assert _read(path).cached


# ---------------------------------------------------------------- candidates and the plan


def test_candidates_are_every_installed_backend_and_body_that_can_open_the_bundle():
    cfg = EngineConfig(tune=True)
    got = candidates(manifest(target=("onnx", "openvino", "gguf"), draft=("onnx", "openvino", "gguf")), cfg, ALL)
    # the draft runs on the target's body where the backend can (a body of its own holds the model
    # twice); llama.cpp cannot, so its draft has its own; an fp32 target's body is still a candidate
    assert got == [("onnxruntime", "shared"), ("openvino", "shared"), ("llamacpp", "own")]
    m = manifest(precision="fp32")
    assert ("openvino", "shared") in candidates(m, cfg, ALL)
    assert candidates(m, cfg, ["openvino"]) == [("openvino", "shared")]


def test_what_the_config_fixes_is_the_only_candidate_tried():
    m = manifest()
    assert candidates(m, EngineConfig(backend="openvino"), ALL) == [("openvino", "shared")]
    assert candidates(m, EngineConfig(draft_body="own"), ALL) == [("onnxruntime", "own"), ("openvino", "own")]
    assert candidates(m, EngineConfig(backend="openvino", draft_body="own"), ALL) == [("openvino", "own")]
    # no draft model: one configuration per backend
    assert candidates(m, EngineConfig(use_draft=False), ALL) == [("onnxruntime", None), ("openvino", None)]
    assert candidates(manifest(draft=None), EngineConfig(), ALL) == [("onnxruntime", None), ("openvino", None)]


@pytest.mark.parametrize("kw, why", [
    (dict(tune=False), "off"), (dict(static=True, backend="openvino"), "static"),
    (dict(memory_budget="2GB"), "budget"), (dict(device="GPU"), "CPU"),
])
def test_loads_that_are_not_tuned_say_why(kw, why):
    assert why in skip_reason(EngineConfig(**{"tune": True, **kw}))
    assert skip_reason(EngineConfig(tune=True)) is None


def test_the_tuned_choice_fills_only_what_the_config_leaves_open():
    m, tuned = manifest(), Tuned("openvino", "own", 5)
    p = plan_engine(m, EngineConfig(), ALL, tuned)
    assert (p.backend, p.shared_body, p.pacing.verify_limit, p.tuned) == ("openvino", False, 5, True)
    assert "measured" in p.drafting.reason
    # an explicit backend, draft body and k win; no k given keeps the tuner's width
    p = plan_engine(m, EngineConfig(backend="onnxruntime", draft_body="shared", k=3), ALL, tuned)
    assert (p.backend, p.shared_body, p.pacing.verify_limit) == ("onnxruntime", True, None)
    assert plan_engine(m, EngineConfig(), ALL).pacing.verify_limit is None
    # the decoder keeps to the narrower of the exact widths and the tuner's limit
    probe = SimpleNamespace(exact_width=9, trees=None, reach=4096)
    assert decoder_limits(None, [], None, probe, True, 5).verify_width == 5
    assert decoder_limits(None, [], None, probe, True, 17).draft_width == 9
    assert decoder_limits(None, [], None, probe, False).verify_width == 9


def test_tune_is_a_switch_on_the_command_line_and_off_where_the_environment_says(monkeypatch):
    from edgespec.cli.common import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    monkeypatch.setenv("EDGESPEC_TUNE", "1")
    assert engine_config_from_args(p.parse_args([])).tune
    assert not engine_config_from_args(p.parse_args(["--no-tune"])).tune
    monkeypatch.setenv("EDGESPEC_TUNE", "0")
    assert not EngineConfig().tune and engine_config_from_args(p.parse_args(["--tune"])).tune


# ---------------------------------------------------------------- measuring a step


class Recorder(ToyRuntime):
    """A toy runtime that records the ids of every forward."""

    def __init__(self, log: list, name: str, **kw) -> None:
        super().__init__(vocab=64, **kw)
        self.log, self.name = log, name

    def forward(self, token_ids, n_logits=1):
        self.log.append((self.name, tuple(token_ids)))
        return super().forward(token_ids, n_logits)


class Head:
    """A head reading the toy body's logits as hidden rows (the first `vocab` columns), logging its calls."""

    hidden_size, weight_bytes = 64, 0

    def __init__(self, log: list, name: str, vocab: int) -> None:
        self.log, self.name, self.vocab_size = log, name, vocab

    def __call__(self, hidden):
        self.log.append((self.name, len(hidden)))
        return np.asarray(hidden)[:, :self.vocab_size]

    def close(self) -> None:
        pass


def test_on_a_shared_body_each_verify_follows_its_drafts_and_runs_the_body_on_one_row():
    from edgespec.runtimes.shared_body import shared_pair

    log: list = []
    target, draft = shared_pair(Recorder(log, "body"), Head(log, "target", 64), Head(log, "draft", 32))
    out = verify_costs(target, (1, 2, 5), prefix=8, repeats=2, draft=draft, shared_body=True)
    assert set(out["ms"]) == {"1", "2", "5"} and out["draft_ms"] > 0 and target.n_past == draft.n_past == 0
    verifies = [i for i, (who, rows) in enumerate(log) if who == "target" and rows > 1]
    assert len(verifies) == 3 * 2  # widths 2 and 5, warm-up pass and two repeats
    for i in verifies:  # the drafts' rows were computed: the verify ran the body on its last token only
        assert log[i - 1][0] == "body" and len(log[i - 1][1]) == 1
    bodies = [ids for who, ids in log if who == "body" and len(ids) > 1][1:]  # after the prefix
    assert len(set(bodies)) == len(bodies)  # fresh ids every time: no row is reused across repeats


def test_a_draft_on_its_own_body_drafts_one_token_at_a_time_and_the_caches_end_empty():
    log: list = []
    target, draft = Recorder(log, "target"), Recorder(log, "draft", noise=0.3)
    out = verify_costs(target, (1, 2, 5), prefix=8, repeats=2, draft=draft)
    assert out["draft_ms"] > 0 and target.n_past == draft.n_past == 0
    assert all(len(ids) == 1 for who, ids in log[2:] if who == "draft")  # its cache does not touch the verify
    wide = [ids for who, ids in log if who == "target" and 1 < len(ids) < 8]
    assert len(set(wide)) == len(wide) == 6
    assert verify_costs(Recorder([], "t"), (2, 4), prefix=8, repeats=1)["c"].keys() == {"2", "4"}


# ---------------------------------------------------------------- tiny real models


def test_the_engine_opens_a_measured_configuration_caches_it_and_retune_measures_again(zoo, monkeypatch, tmp_path):
    pytest.importorskip("openvino", reason="the integration test measures onnxruntime and OpenVINO")
    from edgespec.engine.engine import load
    from tests.test_openvino import ov_bundle

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    bundle = ov_bundle(zoo, "llama")
    # the draft body given, the tuner picks the backend only (and the load stays short)
    with load(bundle, tune=True, draft_body="own") as e:
        t = e.opened.tuning
        names = [(m.backend, m.draft_body) for m in t.candidates]
        assert names == [("onnxruntime", "own"), ("openvino", "own")]
        assert (t.choice.backend, t.choice.draft_body) in names
        assert (e.opened.backend, e.opened.shared_body) == (t.choice.backend, False)
        assert not any(m.cached for m in t.candidates) and t.tune_ms > 0
        assert e.opened.limits.verify_width <= min(t.choice.verify_width, e.opened.exactness.exact_width)
        assert e.describe()["tuning"]["choice"]["backend"] == e.opened.backend
        text = e.generate("the cat", max_tokens=12)
    with load(bundle, tune=True, draft_body="own") as again:
        assert all(m.cached for m in again.opened.tuning.candidates) and again.opened.tuning.tune_ms == 0
        assert again.opened.tuning.choice == t.choice and again.generate("the cat", max_tokens=12) == text
    # the chosen configuration runs in its exact mode: greedy output as plain decoding's
    with load(bundle, tune=False, backend=t.choice.backend, use_draft=False) as plain:
        assert plain.generate("the cat", max_tokens=12) == text
    with load(bundle, tune=True, draft_body="own", retune=True) as fresh:
        assert not any(m.cached for m in fresh.opened.tuning.candidates)
    with load(bundle, tune=True, backend="openvino", draft_body="own") as fixed:
        assert fixed.opened.tuning is None and fixed.opened.backend == "openvino" and not fixed.opened.shared_body
