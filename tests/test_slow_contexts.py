"""Slow tier: one text per request on the real default model (Gemma 3 270M). Greedy output must not
depend on a memory budget (both open the mode the machine settled), on what an earlier request left
in the KV cache (prefill chunks sit at absolute positions), or on drafting at long contexts (the
probe, asked to reach the whole context, checks every split point and the sliding window's edge)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

N_TOKENS = 24
QUESTIONS = ["What is the main topic?", "Summarize it in one line.", "Who is mentioned first?",
             "What happens next?", "List three key words.", "What is the tone?", "Give it a title.",
             "What question does it raise?", "Translate the first sentence into French.",
             "What is missing from it?", "Name one number in it.", "Rewrite the last sentence.",
             "What would a critic say?", "Where does it take place?", "Explain it to a child.",
             "What is the best part?"]


@pytest.fixture(scope="module")
def cache(default_cache):
    return default_cache


def _greedy(engine, ids: list[int]) -> list[int]:
    from edgespec.decoding import SamplingParams

    tokens = list(ids)
    for _ in engine.stream_ids(tokens, SamplingParams(), N_TOKENS, stop=()):
        pass
    return tokens[len(ids):]


def _document(tokenizer, n_tokens: int) -> str:
    """Text of about `n_tokens` tokens: the bench prompts, one after another, as often as needed."""
    from edgespec.bench.suites import load_prompts

    parts = [m[1] for p in load_prompts("all") for m in p.messages] or ["The cat sat on the mat."]
    text, i = "", 0
    while len(tokenizer.encode(text)) < n_tokens:
        text += parts[i % len(parts)] + "\n\n"
        i += 1
    return text


def test_a_memory_budget_does_not_change_the_greedy_text(cache):
    import edgespec
    from edgespec.memory.measure import rss_bytes

    prompts = [f"Question: {q}\nAnswer:" for q in QUESTIONS[:8]]
    with edgespec.load() as free:
        expected = [_greedy(free, free.tokenizer.encode(p)) for p in prompts]
        mode = free.target.kernel_options()
        unbudgeted = free.context_limit
    # a budget counts the whole process, and a test process already holds what earlier tests
    # loaded: this one leaves the engine about 760 MB, which caps its context
    budget = rss_bytes() + 760_000_000
    with edgespec.load(memory_budget=budget) as budgeted:
        assert budgeted.memory_plan is not None and budgeted.context_limit < unbudgeted
        assert budgeted.target.kernel_options() == mode  # the same exact mode, whatever the budget
        assert [_greedy(budgeted, budgeted.tokenizer.encode(p)) for p in prompts] == expected


def test_a_request_s_greedy_reply_does_not_depend_on_the_one_before(cache):
    """The KV prefix an earlier request shares is reused; the reply must be the fresh engine's."""
    import edgespec
    from edgespec.server.worker import GenerationWorker

    with edgespec.load() as fresh:
        doc = _document(fresh.tokenizer, 300)
        second = fresh.tokenizer.encode(doc + QUESTIONS[1])
        first = fresh.tokenizer.encode(doc + QUESTIONS[0])
        alone = _greedy(fresh, second)
    with edgespec.load() as served:
        GenerationWorker(served)  # what the server's worker sets on the engine it serves
        _greedy(served, first)  # leaves the shared document (and its own reply) cached
        assert _greedy(served, second) == alone


# llama.cpp keeps a window-sized cache on sliding layers and cannot roll it back past its window, so
# each question after the document prefills the whole document again: fewer questions there
QUESTIONS_BY_BACKEND = {"llamacpp": 4}


def _contexts(backend: str, n_tokens: int, real_bundle):
    import edgespec
    from edgespec.runtimes import installed_backends

    if backend not in installed_backends():
        pytest.fail(f"{backend} is installed in this project's environment; it must run here")
    # the default bundle on onnxruntime; on llama.cpp the slow tier's GGUF bundle (tests/real.py)
    bundle = real_bundle("gguf") if backend == "llamacpp" else None
    # the probe checks verifies across the whole context used (by default it stops at 4096 keys,
    # and the engine drafts only within what it checked)
    kw = {"backend": backend, "max_context": n_tokens + 512, "probe_context": n_tokens + 512}
    with edgespec.load(bundle, **kw) as spec, edgespec.load(bundle, use_draft=False, **kw) as plain:
        speculative_equals_plain(spec, plain, n_tokens, QUESTIONS[:QUESTIONS_BY_BACKEND.get(backend)])


def speculative_equals_plain(spec, plain, n_tokens: int, questions: list[str] = QUESTIONS) -> None:
    """Every question after a ~`n_tokens` document: the speculative engine's greedy reply is the
    plain one's, and it drafted unless the probe left it decoding plainly."""
    doc = _document(spec.tokenizer, n_tokens)
    drafted = 0
    for q in questions:
        ids = spec.tokenizer.encode(f"{doc}Question: {q}\nAnswer:")
        assert _greedy(spec, ids) == _greedy(plain, ids), q
        drafted += spec.last_stats.drafted
    assert (drafted > 0) is (spec.drafter_name is not None), (drafted, spec.opened.inexact_refusal)


@pytest.mark.parametrize("backend", ["onnxruntime", "llamacpp"])
def test_speculative_equals_plain_at_2k_contexts(cache, real_bundle, backend):
    _contexts(backend, 2000, real_bundle)


@pytest.mark.parametrize("backend", ["onnxruntime", "llamacpp"])
def test_speculative_equals_plain_at_8k_contexts(cache, real_bundle, backend):
    _contexts(backend, 7600, real_bundle)
