"""Slow tier, GPU: the real default GGUF (Gemma 3 270M Q4_K_M) with every layer on a Vulkan device.

Run by `.ci/gpu` on Mesa's lavapipe; skipped with a one-line reason where there is no Vulkan build
of llama.cpp or no Vulkan device (`.ci/gpu` then fails). Speculative greedy must equal plain greedy
on the device on every prompt, drafting every time: at the probe's exact widths there, or under
allow_inexact where it found none (said, and equal then up to near-ties the rounding may flip);
the CPU build of the same model writes the same text as the GPU where the two agree on the first
tokens (checked, not assumed: a software GPU sums in another order)."""
from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

# raw text, code and chat turns: each prompt asks the device the same question (a verify's rows
# against its one-token rows, at the probe's widths), and a software GPU decodes slowly, so the
# tier's time goes with their number
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "<start_of_turn>user\nName three colors.<end_of_turn>\n<start_of_turn>model\n",
           "import numpy as np\n\ndef mean(xs):\n", "Once upon a time, in a small village,",
           "SELECT name FROM users WHERE",
           "<start_of_turn>user\nWhat is 7 times 8?<end_of_turn>\n<start_of_turn>model\n",
           "Photosynthesis is the process by which"]
# few tokens: a software GPU decodes about one a second; the first prompts' texts also go to the CPU check
N_TOKENS = int(os.environ.get("EDGESPEC_GPU_TOKENS", "6"))
CPU_PROMPTS = 3


@pytest.fixture(scope="module")
def bundle(real_bundle):
    from edgespec.errors import BackendError
    from edgespec.runtimes.llamacpp_vulkan.library import load_vulkan_library

    try:
        if not load_vulkan_library().devices():
            pytest.skip("no Vulkan device (lavapipe needs mesa-vulkan-drivers and GGML_VK_VISIBLE_DEVICES=0)")
    except BackendError as e:
        pytest.skip(str(e).split(":")[0])
    return real_bundle("gguf")  # the main tier's, where CI keeps it (tests/real.py)


def _greedy(engine, prompt: str) -> tuple[list[int], list[int], int]:
    """(prompt ids, N_TOKENS greedy tokens, drafted tokens)."""
    from edgespec.decoding import SamplingParams

    ids = engine.tokenizer.encode(prompt)
    tokens, drafted = list(ids), 0
    for step in engine.decoder.stream(tokens, SamplingParams(), N_TOKENS):
        drafted += step.drafted
    return ids, tokens[len(ids):], drafted


def test_default_gguf_speculative_equals_plain_on_the_gpu(bundle):
    """Drafting on the device in every run: at the widths the probe found exact there, or under
    allow_inexact where it found none (said in the output), and then equal to plain up to near-ties."""
    import edgespec
    from tests.test_gpu import assert_same_or_near_tie, drafting_engine

    # two drafts and a short context: the probe's forwards grow with the widths and it prefills up
    # to the context's end once, each dear on a software GPU
    spec, verdict, inexact = drafting_engine(bundle, backend="llamacpp_vulkan", device="GPU", k=2, max_context=256)
    with spec, edgespec.load(bundle, backend="llamacpp_vulkan", device="GPU", use_draft=False,
                             max_context=256) as plain:
        assert spec.target.capabilities.extra["gpu"].startswith("Vulkan")
        assert verdict is not None and inexact == (not verdict.exact)
        print(f"\nGPU probe: {verdict.describe()}{'; drafting under allow_inexact' if inexact else ''}")
        varied = drafted = 0
        for prompt in PROMPTS:
            ids, got, d = _greedy(spec, prompt)
            _, want, _ = _greedy(plain, prompt)
            assert len(got) == N_TOKENS, prompt
            assert_same_or_near_tie(plain, ids, got, want, verdict, inexact)
            varied += len(set(want)) > 2
            drafted += d
        assert varied >= len(PROMPTS) // 2  # real text, not a model stuck on one token
        assert drafted > 0, "the speculative engine drafted nothing on the device"


def test_default_gguf_gpu_text_against_the_cpu_build(bundle):
    """Recorded, and held to the first tokens: the GPU and the CPU build round differently, so a
    near-tie may later send them apart, but the first tokens of these prompts are not near-ties."""
    import edgespec

    with edgespec.load(bundle, backend="llamacpp_vulkan", device="GPU", use_draft=False) as gpu, \
            edgespec.load(bundle, backend="llamacpp", use_draft=False) as cpu:
        same = 0
        for prompt in PROMPTS[:CPU_PROMPTS]:
            g, c = _greedy(gpu, prompt)[1], _greedy(cpu, prompt)[1]
            assert g[:4] == c[:4], prompt
            same += g == c
        print(f"\nGPU == CPU build on {same}/{CPU_PROMPTS} prompts ({N_TOKENS} tokens)")
