"""OpenVINO runtime modes: the KV holder each runtime plans (openvino/kv.plan_kv, no model needed),
and the padded-rows mode the engine switches to where one-row forwards round apart."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("openvino", reason="the OpenVINO backend needs openvino (pip install 'edgespec[openvino]')")

from edgespec.bundle import load_bundle  # noqa: E402
from edgespec.engine.engine import load  # noqa: E402
from edgespec.errors import BackendError  # noqa: E402
from edgespec.runtimes.openvino.runtime import OpenVinoRuntime  # noqa: E402
from tests.ov_state_kv import StatefulKV, register  # noqa: E402
from tests.test_export_onnx import decode  # noqa: E402
from tests.test_openvino import ov_bundle, ov_target  # noqa: E402
from tests.tiny import PROMPTS, VOCAB  # noqa: E402

# -- the KV holder: picked once, from the device and the options ------------------------------

def test_the_kv_holder_is_planned_from_the_device_and_the_options(monkeypatch):
    """plan_kv is pure: no model is needed to see which holder a runtime would build. `kv` names a
    registered holder only: a class is no parameter, and OpenVINO's state opens once a test registers it."""
    from edgespec.runtimes.openvino.kv import (
        DEFAULT_KV_CAPACITY,
        DEFAULT_STATIC_CAPACITY,
        DynamicBufferKV,
        StaticKV,
        plan_kv,
    )

    plan = plan_kv("CPU", "f32", pad_rows=True, wide=True)
    assert (plan.kind, plan.capacity, plan.width, plan.pad_rows, plan.wide, plan.quantize) == \
        (DynamicBufferKV, DEFAULT_KV_CAPACITY, None, True, True, True)  # padded attention: int8 activations stay exact
    assert not plan_kv("GPU", "f32", wide=True).wide  # only the CPU plugin re-prepares per width
    npu = plan_kv("NPU", "f16", width=4, pad_rows=True, wide=True)  # an NPU compiles static shapes only
    assert (npu.kind, npu.capacity, npu.width, npu.pad_rows, npu.wide) == (StaticKV, DEFAULT_STATIC_CAPACITY, 4,
                                                                            False, False)
    assert plan_kv("CPU", "f32", static=True, capacity=10).quantize is False  # unpadded: f32 activations
    assert plan_kv("CPU", "bf16", static=True).quantize is True  # bf16 rounds apart anyway
    for kw in (dict(kv="state"), dict(kv=dict), dict(kv=StatefulKV)):  # not registered; a class is no name
        with pytest.raises(BackendError, match="kv must be one of"):
            plan_kv("CPU", "f32", **kw)
    state = plan_kv("CPU", "f32", kv=register(monkeypatch), pad_rows=True, wide=True)
    assert (state.kind, state.pad_rows, state.wide, state.quantize) == (StatefulKV, False, False, False)
    for kw in (dict(kv="state", static=True), dict(kv=StatefulKV)):
        with pytest.raises(BackendError, match="kv must be one of"):
            plan_kv("CPU", "f32", **kw)


# -- the padded-rows mode: what the engine switches to where one-row decodes round apart ----------

def test_padded_rows_compute_the_same_model_and_keep_only_the_real_rows(zoo, monkeypatch):
    path = ov_bundle(zoo, "llama")
    ir = path / load_bundle(path).manifest.target.formats["openvino"].file
    plain, padded = OpenVinoRuntime(ir), OpenVinoRuntime(ir, pad_rows=True)
    assert padded.capabilities.extra["pad_rows"] and not plain.capabilities.extra["pad_rows"]
    ids = [int(t) for t in np.random.default_rng(4).integers(3, VOCAB, 20)]
    np.testing.assert_allclose(padded.forward(ids[:10], n_logits=3), plain.forward(ids[:10], n_logits=3), atol=1e-4)
    for t in ids[10:14]:
        np.testing.assert_allclose(padded.forward([t]), plain.forward([t]), atol=1e-4)
    assert padded.n_past == plain.n_past == 14  # the padding row is never cached
    padded.trim(6)
    plain.trim(6)
    np.testing.assert_allclose(padded.forward(ids[6:9], n_logits=2), plain.forward(ids[6:9], n_logits=2), atol=1e-4)
    for kw in (dict(kv=register(monkeypatch)), dict(static=True, width=4)):  # only the dynamic buffer pads
        assert not OpenVinoRuntime(ir, pad_rows=True, **kw).capabilities.extra["pad_rows"]


@pytest.mark.parametrize("body", ["own", "shared"])
def test_the_engine_switches_to_padded_rows_where_one_row_rounds_apart(zoo, monkeypatch, body):
    """A CPU whose one-row forwards round unlike wider ones (made here by perturbing wider
    unpadded forwards): the probe finds the default inexact, and the engine reopens the target (with
    a draft on its body) in the padded-rows mode, where the probe decides again."""
    forward = OpenVinoRuntime.forward

    def rounded(self, token_ids, n_logits=1):
        out = forward(self, token_ids, n_logits)
        return out + np.float32(1e-3) if len(token_ids) > 1 and not self.capabilities.extra["pad_rows"] else out

    monkeypatch.setattr(OpenVinoRuntime, "forward", rounded)
    with load(ov_bundle(zoo, "gemma3"), backend="openvino", drafter="model", draft_body=body, retune=True) as e:
        body_rt = e.target.shared.body if body == "shared" else e.target
        switched = body_rt.capabilities.extra["pad_rows"]
        assert switched == (e.exactness.exact_width > 1)  # switched where the padded mode is exact here
        # neither branch passes by default: exact padded rows draft, inexact ones decode plainly
        assert (e.drafter_name == "model") is switched
        assert (e.opened.inexact_refusal is None) is switched
        if body == "shared":
            assert e.target.head.pad_rows == e.draft.head.pad_rows == switched and e.shared_body
        ids = e.tokenizer.encode(PROMPTS[1])
        spec = decode(e, ids, 16)[0]
    with load(ov_bundle(zoo, "gemma3"), backend="openvino", use_draft=False) as plain:
        assert decode(plain, ids, 16)[0] == spec


@pytest.mark.parametrize("padded_exact", [True, False], ids=["padded-exact", "padded-inexact"])
def test_the_mode_switch_follows_the_probe_whatever_this_cpu_does(zoo, monkeypatch, padded_exact):
    """The probe scripted per mode, so both outcomes run on every CPU: where the padded mode is
    exact the engine switches to it and drafts; where it is not, it stays, and decodes plainly."""
    from edgespec.runtimes import exactness

    def scripted(rt, max_width, *args, **kw):
        exact = rt.capabilities.extra.get("pad_rows") is True and padded_exact
        widths = tuple(range(2, max_width + 1)) if exact else ()
        return exactness.Exactness(max_width, widths, 0.0 if exact else 1e-3, 1.0)

    monkeypatch.setattr(exactness, "probe", scripted)
    with load(ov_bundle(zoo, "gemma3"), backend="openvino", drafter="model", draft_body="own", retune=True) as e:
        assert e.target.capabilities.extra["pad_rows"] is padded_exact
        assert e.exactness.fully_exact is padded_exact
        assert (e.drafter_name == "model") is padded_exact
        assert e.opened.speculation()["speculative"] is padded_exact
        if padded_exact:
            assert e.decoder.limits.verify_width == e.exactness.exact_width
        ids = e.tokenizer.encode(PROMPTS[1])
        spec = decode(e, ids, 12)[0]
    with load(ov_bundle(zoo, "gemma3"), backend="openvino", use_draft=False) as plain:
        assert plain.target.capabilities.extra["pad_rows"] is padded_exact  # the mode the machine settled
        assert decode(plain, ids, 12)[0] == spec


def test_the_state_holder_reports_dynamic_quantization_as_batch_variance(zoo, monkeypatch):
    # OpenVINO's state would keep padded keys, so that holder is exact only in f32
    class QuantizedStateKV(StatefulKV):
        name = "quantized-state"
        quantize = True

    assert ov_target(zoo, "llama", kv=register(monkeypatch)).capabilities.batch_variance is None
    rt = ov_target(zoo, "llama", kv=register(monkeypatch, QuantizedStateKV))
    assert "dynamic" in rt.capabilities.batch_variance and rt.capabilities.extra["dynamic_quantization"]
