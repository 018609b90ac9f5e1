"""Slow tier: the real default GGUF (Gemma 3 270M Q4_K_M) on the llama.cpp backend.

The target is copied as it is; the draft is an int8 (Q8_0) self-draft with the full head, which
needs no VocabTrim calibration run (minutes of transformers generation); the trimmed draft on the
real model is exercised by benchmarks/bench_llamacpp.py, which checks speculative == plain too.
A verify pass must compute exactly what one-token decodes do, checked on the real Q4_K_M weights
(what speculative greedy == plain greedy rests on: that is checked on this bundle with the other
backends, on the 24 bench prompts in test_slow_exactness and at long contexts in
test_slow_contexts), and llama.cpp's own vocabulary must agree with the bundle's tokenizer (the
source of truth)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "<start_of_turn>user\nName three colors.<end_of_turn>\n<start_of_turn>model\n",
           "The history of the printing press begins", "Photosynthesis is the process by which",
           "Once upon a time, in a village by the sea,"]
N_TOKENS = 48


@pytest.fixture(scope="module")
def bundle(real_bundle):
    """The default model's GGUF bundle, shared by the slow tier (tests/real.py)."""
    return real_bundle("gguf")


def test_default_gguf_bundle_layout(bundle):
    from edgespec.bundle import load_bundle
    from edgespec.models.catalog import preset_source

    m = load_bundle(bundle).manifest
    t, d = m.target.formats["gguf"], m.draft.formats["gguf"]
    assert t.quantization == {"method": "llama.cpp", "type": "Q4_K_M", "passthrough": True,
                              "standalone": t.file}
    assert (bundle / t.file).read_bytes()[:1 << 20] == preset_source().read_bytes()[:1 << 20]
    assert d.precision == "int8"
    assert {k: d.quantization[k] for k in ("method", "type")} == {"method": "llama.cpp", "type": "Q8_0"}
    assert (bundle / d.quantization["standalone"]).is_file()
    assert m.draft.vocab_size == m.target.vocab_size == 262144


def test_llamacpp_vocab_agrees_with_bundle_tokenizer(bundle):
    import llama_cpp

    from edgespec.bundle import load_bundle
    from edgespec.runtimes.llamacpp.runtime import load_library
    from edgespec.tokenizer import Tokenizer

    lib = load_library()
    b = load_bundle(bundle)
    tok = Tokenizer(b.file(b.manifest.tokenizer.file), b.manifest.tokenizer)
    params = lib.llama_model_default_params()
    params.vocab_only = True
    model = lib.llama_model_load_from_file(str(b.file(b.manifest.target.formats["gguf"].file)).encode(), params)
    assert model
    try:
        vocab = lib.llama_model_get_vocab(model)
        assert lib.llama_vocab_n_tokens(vocab) == b.manifest.target.vocab_size
        texts = PROMPTS + ["Héllo wörld! 123 — ünïcode, emojis 🙂 and\ttabs\n\nnew lines", "  leading spaces"]
        for text in texts:
            buf = (llama_cpp.llama_token * 512)()
            raw = text.encode()
            n = lib.llama_tokenize(vocab, raw, len(raw), buf, 512, True, True)
            assert n > 0
            assert list(buf[:n]) == tok.encode(text), text
    finally:
        lib.llama_model_free(model)


def test_default_gguf_verify_pass_is_bit_identical_to_one_token_decodes(bundle):
    from edgespec.bundle import load_bundle
    from edgespec.runtimes.llamacpp.runtime import LlamaCppRuntime
    from edgespec.tokenizer import Tokenizer
    from tests.test_llamacpp import assert_verify_equals_one_token_decodes

    b = load_bundle(bundle)
    ids = Tokenizer(b.file(b.manifest.tokenizer.file), b.manifest.tokenizer).encode(" ".join(PROMPTS) * 20)
    # a context just past the checks' reach: the probe that bounds the checked width reaches as far
    # as the runtime holds, else to PROBE_REACH keys, a prefill of as many tokens (the long-context
    # test's probe reaches the far end of this bundle's context)
    with LlamaCppRuntime(b.file(b.manifest.target.formats["gguf"].file), kv_capacity=1024) as rt:
        for start in (9, 600):  # a short context, and one past flash attention's 512-position split
            assert_verify_equals_one_token_decodes(rt, ids, start, width=5)
