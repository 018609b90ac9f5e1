"""Slow tier: the real default model (Gemma 3 270M) exported to OpenVINO with an fp32 target, against
transformers and against itself: speculative greedy == plain greedy == transformers in each
configuration, the exact mode's verifies bit for bit one-token decodes, and a draft split at its
hidden state. OpenVINO on the export a user's `edgespec export --format openvino` writes (the
GGUF's own blocks) is checked with the other backends: speculative == plain on the 24 bench
prompts in test_slow_exactness, at ~2k- and ~8k-token contexts in test_slow_contexts."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("openvino", reason="the OpenVINO backend needs openvino (pip install 'edgespec[openvino]')")

from edgespec.bundle import load_bundle  # noqa: E402
from edgespec.engine.engine import load  # noqa: E402
from edgespec.runtimes.openvino.runtime import OpenVinoRuntime  # noqa: E402
from tests.test_export_onnx import decode, hf_greedy, verify_matches_decodes  # noqa: E402
from tests.test_openvino import exact_mode  # noqa: E402

pytestmark = pytest.mark.slow
# The context the engines here hold: the prompts and their replies sit within it, and each
# configuration's probe checks the context its runtime holds (a prefill of as many tokens and
# forwards attending to up to as many keys, the dearest part of this test), so it is no longer than
# they need. The draft IR's verify checks run past the first powers of two, up to CONTEXT.
# OpenVINO's long contexts: tests/test_slow_contexts.py.
ENGINE_CONTEXT = 256
CONTEXT = 1024


@pytest.fixture(scope="module")
def exported(real_bundle):
    """The default model in OpenVINO IR (tests/real.py): an fp32 target (compared with transformers'
    fp32 model; a GGUF's default, its own blocks, rounds as llama.cpp does) and an NNCF int4 self-draft."""
    return real_bundle("openvino-fp32")


def test_default_model_on_openvino_speculative_equals_plain_equals_transformers(exported, hf_default):
    """Gemma 3 270M exported to OpenVINO (fp32 target, NNCF int4 self-draft): speculative greedy ==
    plain greedy == transformers, dynamic, static-shape and with the draft on the target's body.
    Where the probe finds no exact verify width for a configuration on this CPU (static shapes
    here), the engine decodes plainly and says why, and drafting anyway (allow_inexact) still
    drafts; the int4 IR verifies bit for bit like one-token decodes, and split at its hidden state
    it computes the fused IR's bits."""
    out = exported
    n = 32
    refs = []
    for prompt in ("The capital of France is", "def fibonacci(n):\n    "):
        ids = hf_default.tokenizer(prompt).input_ids
        refs.append((ids, hf_greedy(hf_default.model, ids, n)))
    for static, body in ((False, "own"), (True, "own"), (False, "shared")):
        with load(out, use_draft=False, static=static, max_context=ENGINE_CONTEXT) as plain, \
                load(out, k=4, drafter="model", static=static, draft_body=body, max_context=ENGINE_CONTEXT) as spec:
            refused = spec.opened.inexact_refusal
            assert plain.backend == spec.backend == "openvino"
            assert spec.draft_backend == (None if refused else "openvino")
            assert refused is not None or spec.shared_body is (body == "shared")
            drafted = 0
            for ids, ref in refs:
                got_plain = decode(plain, ids, n)[0]
                got_spec, d, _ = decode(spec, ids, n)
                drafted += d
                assert got_spec == got_plain == ref
            assert (drafted == 0) if refused else (drafted > 0), (static, body, refused)
        if refused:  # the mechanism still drafts when told to, and rounds like plain on these prompts
            with load(out, k=4, drafter="model", static=static, draft_body=body, allow_inexact=True,
                      max_context=ENGINE_CONTEXT) as spec:
                drafted = 0
                for ids, ref in refs:
                    got_spec, d, _ = decode(spec, ids, n)
                    drafted += d
                    assert got_spec == ref
                assert drafted > 0
    # the int4 draft IR, where the CPU plugin quantizes activations on the fly: in the mode the
    # probe picks on this CPU, a verify is bit for bit one-token decodes; where that is the
    # one-row mode, without the key padding, or the query padding, it is not (not vacuous)
    import edgespec.runtimes.openvino.kv as ov_kv

    draft_ir = out / load_bundle(out).manifest.draft.formats["openvino"].file
    ids = [int(t) for t in np.random.default_rng(0).integers(1000, 200000, 760)]
    starts = (9, 58, 60, 700, 750)
    rt, verdict = exact_mode(draft_ir, kv_capacity=CONTEXT)
    assert rt.capabilities.extra["dynamic_quantization"]
    assert verdict.fully_exact, verdict.describe()
    assert all(verify_matches_decodes(rt, ids, start, width=6) for start in starts)
    padded = rt.capabilities.extra["pad_rows"]
    rt.close()
    for rewrite in ("pad_keys", "pad_queries") if not padded else ():
        with pytest.MonkeyPatch.context() as mp:  # the rewrites only act while the IR loads
            mp.setattr(ov_kv, rewrite, lambda model: 0)
            unpadded = OpenVinoRuntime(draft_ir)
        assert not all(verify_matches_decodes(unpadded, ids, start, width=6) for start in starts), rewrite
        unpadded.close()
    # the same int4 IR split at its hidden state (a draft on the target's body): body + head give
    # the fused IR's bits, prefill, one-token decodes and verifies alike
    from edgespec.runtimes.openvino.split import OpenVinoHead
    from edgespec.runtimes.shared_body import shared_pair

    fused, (split, _) = OpenVinoRuntime(draft_ir), shared_pair(OpenVinoRuntime(draft_ir, output="hidden"),
                                                               OpenVinoHead(draft_ir), OpenVinoHead(draft_ir))
    for lo, hi, n in [(0, 600, 2), *[(i, i + 1, 1) for i in range(600, 606)], (606, 611, 5), (611, 620, 9)]:
        np.testing.assert_array_equal(np.array(split.forward(ids[lo:hi], n_logits=n)),
                                      fused.forward(ids[lo:hi], n_logits=n), err_msg=f"{lo}:{hi}")
