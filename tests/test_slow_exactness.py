"""Slow tier: speculative greedy == plain greedy on the real default model (Gemma 3 270M), on every
installed backend, on the machine at hand: all 24 bench prompts x 64 tokens (the grounded ones
run past 128 and 144 keys, where onnxruntime's score products once rounded apart), the cost
policy free to pick any draft length, each backend verifying only at the widths its exactness
probe found exact here (or in the exact mode the engine switched to). The engines open with the
long-context tests' options (tests/real.py's LONG_CONTEXT), so the probe that reaches ~5k keys for
test_slow_contexts is the one these read from the session's cache: one probe per backend. This is
the slow tier's one check of speculative == plain on llama.cpp's GGUF bundle at short contexts
(test_slow_llamacpp's six prompts were a subset of the same question on the same bundle)."""
from __future__ import annotations

import pytest

from tests.real import LONG_CONTEXT

pytestmark = pytest.mark.slow

N_TOKENS = 64
FORMATS = ("onnxruntime", "openvino", "llamacpp")


@pytest.fixture(scope="module")
def prompts():
    from edgespec.bench.suites import load_prompts

    return [p for suite in ("chat", "code", "grounded") for p in load_prompts(suite)]


# the bundle each backend runs: the default bundle itself for onnxruntime (conftest.default_cache),
# the slow tier's shared exports (tests/real.py) for the others, whose drafts keep the full
# vocabulary (no VocabTrim calibration run: minutes the exactness question does not need)
REAL_BUNDLES = {"openvino": "openvino", "llamacpp": "gguf"}


@pytest.fixture(params=list(FORMATS))
def bundle(request):
    """(backend, the bundle it runs)"""
    from edgespec.runtimes import installed_backends

    if request.param not in installed_backends():
        pytest.skip(f"{request.param} is not installed")
    if request.param == "onnxruntime":
        request.getfixturevalue("default_cache")
        from edgespec.engine.engine import default_bundle

        return request.param, default_bundle()
    return request.param, request.getfixturevalue("real_bundle")(REAL_BUNDLES[request.param])


def test_speculative_greedy_equals_plain_on_every_backend(bundle, prompts):
    from edgespec.bench.suites import encode_prompt
    from edgespec.decoding import SamplingParams
    from edgespec.engine.engine import load

    backend, path = bundle
    kw = {"backend": backend, **LONG_CONTEXT}
    with load(path, use_draft=False, **kw) as plain, load(path, **kw) as spec:
        verdict = spec.exactness
        assert verdict is not None, "the default engine drafts, so it probes"
        print(f"{backend}: {verdict.describe()} [probe {verdict.probe_ms:.0f} ms]")
        width = spec.decoder.limits.verify_width
        assert width == (verdict.exact_width if verdict.exact_width >= 2 else None)
        drafted, widest = 0, 1
        for p in prompts:
            ids = encode_prompt(spec.tokenizer, p)
            outs = []
            for engine in (plain, spec):
                tokens = list(ids)
                for _ in engine.stream_ids(tokens, SamplingParams(), N_TOKENS):
                    pass
                outs.append(tokens[len(ids):])
                if engine is spec:
                    drafted += engine.last_stats.drafted
                    widest = max(widest, 1 + max(engine.last_stats.k_history, default=0))
            assert outs[1] == outs[0], f"{backend}, prompt {p.id}: speculative output left plain's"
        if verdict.exact_width >= 2:
            assert drafted > 0 and widest <= verdict.exact_width
        print(f"{backend}: {drafted} tokens drafted, widest verify {widest}")


# the same check in a process whose onnxruntime sessions share the process-wide thread pool, as
# the `edgespec` command runs them (runtimes/onnxruntime/pool.py): the grounded prompts (the ones
# that run past 128 and 144 keys) and two of each other suite, what tells the pool's kernels apart
# (every prompt of every suite is checked in-process above)
_ON_THE_POOL = """
import json
import edgespec
from edgespec.engine.engine import default_bundle, load
from edgespec.bench.suites import encode_prompt, load_prompts
from edgespec.decoding import SamplingParams
from edgespec.runtimes.onnxruntime.pool import pool_state

edgespec.share_threads()
path = default_bundle()
left, drafted = [], 0
with load(path, backend="onnxruntime", use_draft=False) as plain, load(path, backend="onnxruntime") as spec:
    for p in load_prompts("chat")[:2] + load_prompts("code")[:2] + load_prompts("grounded"):
        ids = encode_prompt(spec.tokenizer, p)
        outs = []
        for engine in (plain, spec):
            tokens = list(ids)
            for _ in engine.stream_ids(tokens, SamplingParams(), 64):
                pass
            outs.append(tokens[len(ids):])
        drafted += spec.last_stats.drafted
        if outs[1] != outs[0]:
            left.append(p.id)
print(json.dumps({"left": left, "drafted": drafted, "pool": pool_state()}))
"""


def test_speculative_greedy_equals_plain_on_the_shared_thread_pool(default_cache):
    pytest.importorskip("onnxruntime")
    from tests.test_ort_pool import run_json

    got = run_json(_ON_THE_POOL, timeout=1800)
    assert got["pool"]["allowed"] and got["pool"]["made"] not in (None, "theirs")
    assert got["drafted"] > 0 and got["left"] == [], f"speculative output left plain's on {got['left']}"
