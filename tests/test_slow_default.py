"""Slow tier: the real default model (Gemma 3 270M from its PyPI package), exported for real."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
N_TOKENS = 48


@pytest.fixture(scope="module")
def cache(default_cache):
    """The test session's private EDGESPEC_CACHE holding the default bundle, built through the
    default path once for the whole slow tier (conftest.default_cache)."""
    return default_cache


@pytest.fixture(scope="module")
def hf_reference(cache, hf_default):
    """Greedy continuations from transformers on the same GGUF weights."""
    import torch

    tok, model = hf_default.tokenizer, hf_default.model
    out = {}
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=N_TOKENS, min_new_tokens=N_TOKENS, do_sample=False)
            out[p] = (ids[0].tolist(), gen[0, ids.shape[1]:].tolist())
    return out


def _llamacpp_greedy(prompt_ids: list[int], n: int) -> list[int] | None:
    """llama.cpp's own greedy continuation of the default GGUF (one-token decodes), or None."""
    try:
        from edgespec.errors import BackendError
        from edgespec.models.catalog import preset_source
        from edgespec.runtimes.llamacpp.runtime import LlamaCppRuntime

        rt = LlamaCppRuntime(preset_source())
    except (ImportError, BackendError):
        return None
    with rt:
        out = [int(rt.forward(prompt_ids)[-1].argmax())]
        while len(out) < n:
            out.append(int(rt.forward([out[-1]])[-1].argmax()))
    return out


def test_default_greedy_is_exact_and_the_gguf_s_own_model(cache, hf_reference):
    """Speculative greedy == plain greedy on the default bundle, whose target keeps the GGUF's own
    blocks and computes as llama.cpp does (int8 activations): so its greedy text follows
    llama.cpp's on the same file, and transformers' fp32 dequantization only near the start."""
    import edgespec
    from edgespec.decoding import SamplingParams
    from edgespec.runtimes.base import common_prefix

    with edgespec.load() as spec_engine, edgespec.load(use_draft=False) as plain_engine:
        for prompt, (prompt_ids, ref) in hf_reference.items():
            assert spec_engine.tokenizer.encode(prompt) == prompt_ids
            results = []
            for engine in (spec_engine, plain_engine):
                tokens = list(prompt_ids)
                for _ in engine.stream_ids(tokens, SamplingParams(), N_TOKENS, stop=()):
                    pass
                results.append(tokens[len(prompt_ids):])
            spec, plain = results
            # a stop token ends ours early; transformers was forced on past it
            n = len(plain)
            assert spec == plain
            assert n == N_TOKENS or plain[-1] in spec_engine.tokenizer.stop_ids
            assert spec_engine.last_stats.drafted > 0
            # the same model as transformers' fp32 dequantization and as llama.cpp's own kernels,
            # each rounding its own way (int8 activations here and in llama.cpp, 1-2 logits apart)
            assert common_prefix(plain, ref) >= 3, (plain, ref)
            peer = _llamacpp_greedy(prompt_ids, n)
            if peer is None:  # said, not silently passed: the comparison did not run
                import importlib.util

                assert importlib.util.find_spec("llama_cpp") is None, "llama-cpp-python is installed but did not run"
                pytest.skip("llama-cpp-python is not installed: no comparison with llama.cpp's own kernels")
            # llama.cpp runs the same blocks with int8 activations as the target does: their greedy
            # texts run together well past the start (docs/exactness.md gives the measured lengths)
            assert common_prefix(plain, peer) >= 8, (plain, peer)


def test_default_chat_through_a_pipe(cache):
    proc = subprocess.run(
        [sys.executable, "-m", "edgespec", "chat", "--max-tokens", "24"],
        input="What is the capital of France?\n/stats\n", capture_output=True, text=True, timeout=600,
        env={**os.environ, "EDGESPEC_CACHE": str(cache)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "base model" in proc.stderr  # says it is using the family's chat format
    reply, stats = proc.stdout.split("last reply:", 1)
    assert reply.strip()
    assert "tok/s" in stats and "acceptance" in stats
