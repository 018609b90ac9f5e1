"""Slow tier: one text per request on the real default model (Gemma 3 270M). Greedy output must not
depend on a memory budget (both open the mode the machine settled), on what an earlier request left
in the KV cache (prefill chunks sit at absolute positions), or on drafting at long contexts (the
probe, asked to reach the whole context, checks every split point and the sliding window's edge)."""
from __future__ import annotations

import pytest

from tests.real import LONG_CONTEXT, LONG_TOKENS

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


# where each backend's long-context bundle comes from: the default bundle on onnxruntime; the slow
# tier's shared exports (tests/real.py) for the others: OpenVINO on the GGUF's own blocks, as a
# user's `edgespec export --format openvino` writes it, and the GGUF as shipped on llama.cpp
LONG_BUNDLES = {"onnxruntime": None, "openvino": "openvino", "llamacpp": "gguf"}
SHORT_TOKENS = 2000
LONG_QUESTIONS = 2  # per document length


def speculative_equals_plain(spec, plain, lengths: tuple[int, ...] = (SHORT_TOKENS, LONG_TOKENS),
                             questions: list[str] = QUESTIONS[:LONG_QUESTIONS]) -> None:
    """One growing conversation: a document of about lengths[0] tokens and the questions, each
    reply decoded greedily by both engines and asserted equal; then the document continued to
    about lengths[1] tokens and the questions again. Each prompt extends the last one and its
    reply, so the document is prefilled once per engine (llama.cpp, which cannot roll its sliding
    layers back past their window, would prefill it again for every fresh question), while the
    replies are decoded at ~2k keys and past 4096, every sliding layer reading its moving window.
    The speculative engine drafted unless the probe left it decoding plainly."""
    text = _document(spec.tokenizer, max(lengths))
    ids: list[int] = []
    drafted, done = 0, ""
    for n in lengths:
        part = text[len(done):len(_document(spec.tokenizer, n))]  # each length's document extends the last
        ids += spec.tokenizer.encode(part, add_special_tokens=not ids)
        done += part
        for q in questions:
            ids += spec.tokenizer.encode(f"Question: {q}\nAnswer:", add_special_tokens=False)
            reply = _greedy(spec, ids)
            drafted += spec.last_stats.drafted
            assert reply == _greedy(plain, ids), (len(ids), q)
            ids += reply + spec.tokenizer.encode("\n\n", add_special_tokens=False)
    assert (drafted > 0) is (spec.drafter_name is not None), (drafted, spec.opened.inexact_refusal)


@pytest.mark.parametrize("backend", list(LONG_BUNDLES))
def test_speculative_equals_plain_at_long_contexts(request, real_bundle, backend):
    """Greedy speculative == plain with replies at ~2k- and ~5k-token contexts, on every backend,
    with the probe asked to reach the context's end (by default it stops at 4096 keys, and the
    engine drafts only within what it checked): it checks every split point up to there, the
    window's edge and 4096 keys among them. The engines open with the options test_slow_exactness
    opens them with (tests/real.py), so the two share one probe per backend."""
    import edgespec
    from edgespec.runtimes import installed_backends

    if backend not in installed_backends():
        pytest.fail(f"{backend} is installed in this project's environment; it must run here")
    name = LONG_BUNDLES[backend]
    bundle = None if name is None else real_bundle(name)
    if bundle is None:  # the default bundle, which the session's first run builds (conftest.default_cache)
        request.getfixturevalue("default_cache")
    kw = {"backend": backend, **LONG_CONTEXT}
    with edgespec.load(bundle, **kw) as spec, edgespec.load(bundle, use_draft=False, **kw) as plain:
        speculative_equals_plain(spec, plain)
