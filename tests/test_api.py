"""The library API on real tiny bundles: generate/stream/stop strings, abandoned and concurrent
streams, multi-turn chat reusing the KV cache, seeded sampling, option validation."""
from __future__ import annotations

import json
import math

import pytest

from edgespec.bundle import load_bundle
from edgespec.decoding import SamplingParams
from edgespec.engine.engine import Engine, GenerationStats, Response, load
from edgespec.errors import BusyError, ConfigError, EngineClosedError
from tests.tiny import LONG_PROMPT, PROMPTS
from tests.zoo import DISAGREEING

PROMPT = PROMPTS[1]


@pytest.fixture
def engine(zoo):
    """llama target with the int4 draft (it rolls back often), k=3."""
    with load(zoo.bundle("llama", DISAGREEING), k=3, drafter="model") as e:
        yield e


@pytest.fixture
def fresh(zoo):
    """Greedy text of a never-used engine: the reference for cache-state tests."""
    def run(prompt: str = PROMPT, max_tokens: int = 24, **kw) -> str:
        with load(zoo.bundle("llama", DISAGREEING), k=3, drafter="model") as e:
            return e.generate(prompt, max_tokens=max_tokens, **kw)

    return run


def collect(responses) -> tuple[str, list[int], list[Response]]:
    rs = list(responses)
    return "".join(r.text for r in rs), [t for r in rs for t in r.token_ids], rs


# -- generate / stream ---------------------------------------------------------------------

def test_generate_returns_the_streamed_text(engine):
    text = engine.generate(PROMPT, max_tokens=16)
    assert isinstance(text, str) and text.strip()
    streamed, ids, _ = collect(engine.stream(PROMPT, max_tokens=16))
    assert streamed == text == engine.tokenizer.decode(ids)
    assert engine.generate(engine.tokenizer.encode(PROMPT), max_tokens=16) == text  # ids work too


def test_stream_reports_length_on_the_last_response(engine):
    _, ids, rs = collect(engine.stream(PROMPT, max_tokens=12))
    assert all(isinstance(r, Response) for r in rs)
    assert [r.finish_reason for r in rs] == [None] * (len(rs) - 1) + ["length"]
    assert len(ids) == 12
    st = rs[-1].stats
    assert isinstance(st, GenerationStats) and st is engine.last_stats
    assert st.new_tokens == 12 and st.steps == len(rs) < 12  # drafts made some steps commit several tokens
    assert st.prompt_tokens == len(engine.tokenizer.encode(PROMPT))
    assert 0 < st.accepted < st.drafted and sum(st.k_history) == st.drafted
    assert all(0 <= r.from_draft < len(r.token_ids) for r in rs)
    assert sum(r.from_draft for r in rs) <= st.accepted


def test_stream_reports_stop_at_an_end_token(zoo):
    # this target continues LONG_PROMPT up to an EOS
    with load(zoo.bundle("qwen2", DISAGREEING), k=3, drafter="model") as e:
        _, ids, rs = collect(e.stream(LONG_PROMPT, max_tokens=64))
        assert rs[-1].finish_reason == "stop" and ids[-1] in e.tokenizer.stop_ids
        assert len(ids) < 64 and not any(t in e.tokenizer.stop_ids for t in ids[:-1])


def test_stop_strings_cut_the_text(engine):
    full, _, rs = collect(engine.stream(PROMPT, max_tokens=24))
    assert rs[-1].finish_reason == "length" and len(full) > 12
    stop = full[8:11]
    cut, _, rs = collect(engine.stream(PROMPT, max_tokens=24, stop=[stop]))
    assert cut == full[: full.find(stop)]
    assert rs[-1].finish_reason == "stop"
    later = full[10:14]  # the earliest of several stop strings wins
    cut2 = engine.generate(PROMPT, max_tokens=24, stop=[later, stop])
    assert cut2 == full[: min(full.find(stop), full.find(later))]
    absent = "\u2603never"
    assert engine.generate(PROMPT, max_tokens=24, stop=[absent]) == full  # held-back text is flushed


# -- cache state across streams ------------------------------------------------------------

def test_abandoned_stream_rewinds_the_caches(engine, fresh):
    for r in engine.stream(PROMPT, max_tokens=24):
        assert r.finish_reason is None
        break  # a Stop button after the first Response
    assert engine.generate(PROMPT, max_tokens=24) == fresh()

    tokens = engine.tokenizer.encode(LONG_PROMPT)
    gen = engine.stream_ids(tokens, SamplingParams(temperature=0.8, seed=3), 24)
    next(gen)
    gen.close()
    # the caches hold a prefix of the committed tokens, never a rejected draft
    assert engine.target.n_past < len(tokens) and engine.draft.n_past < len(tokens)
    assert engine.generate(PROMPT, max_tokens=24) == fresh()
    assert engine.generate(LONG_PROMPT, max_tokens=24) == fresh(LONG_PROMPT)


def test_a_second_concurrent_stream_is_refused(engine, fresh):
    first = engine.stream(PROMPT, max_tokens=24)
    head = next(first)
    with pytest.raises(BusyError):
        next(engine.stream(LONG_PROMPT, max_tokens=4))
    with pytest.raises(BusyError):
        next(engine.stream_ids(engine.tokenizer.encode(LONG_PROMPT), SamplingParams(), 4))
    rest = "".join(r.text for r in first)
    assert head.text + rest == fresh()
    assert engine.generate(PROMPT, max_tokens=24) == fresh()  # the lock was released


# -- chat ----------------------------------------------------------------------------------

@pytest.fixture
def chat_engine(zoo):
    """qwen2 target whose source ships a ChatML template, with the int4 draft."""
    with load(zoo.bundle("qwen2", DISAGREEING), k=3, drafter="model") as e:
        assert load_bundle(zoo.bundle("qwen2")).manifest.tokenizer.chat_template_source == "model"
        yield e


def count_fed_tokens(engine: Engine, monkeypatch) -> list[int]:
    """Spy on the target runtime: the length of every forward call."""
    fed: list[int] = []
    forward = engine.target.forward

    def spy(token_ids, n_logits=1):
        fed.append(len(token_ids))
        return forward(token_ids, n_logits)

    monkeypatch.setattr(engine.target, "forward", spy)
    return fed


def test_chat_reuses_the_cache_across_turns(chat_engine, monkeypatch):
    fed = count_fed_tokens(chat_engine, monkeypatch)
    session = chat_engine.chat(system="You are terse.")
    reply1 = "".join(r.text for r in session.send("hello world", max_tokens=8))
    turn1 = session.turn_stats[-1].prompt_tokens
    assert sum(fed) >= turn1  # the first turn prefills its whole prompt
    assert session.messages == [{"role": "system", "content": "You are terse."},
                                {"role": "user", "content": "hello world"},
                                {"role": "assistant", "content": reply1}]
    fed.clear()
    list(session.send("one two three", max_tokens=1))  # one token: no drafts, only prefill + 1
    turn2 = session.turn_stats[-1].prompt_tokens
    rendered = chat_engine.tokenizer.render_chat(session.messages[:-1])
    assert "<|im_start|>assistant\n" + reply1 + "<|im_end|>" in rendered
    assert turn2 > turn1
    assert sum(fed) <= turn2 - turn1  # the whole first turn came from the cache


def test_stopping_a_reply_early_keeps_the_conversation(chat_engine, zoo):
    session = chat_engine.chat()
    list(session.send("hello world", max_tokens=6))
    for r in session.send("one two three", max_tokens=30):
        assert r.finish_reason is None, "the reply ended on its first step; the test needs a longer one"
        break
    partial = r.text
    assert session.messages[-2:] == [{"role": "user", "content": "one two three"},
                                     {"role": "assistant", "content": partial}]
    history = [dict(m) for m in session.messages]
    reply = "".join(r.text for r in session.send("and then", max_tokens=10))
    assert session.messages[-1] == {"role": "assistant", "content": reply}
    assert len(session.messages) == 6 and len(session.turn_stats) == 3

    # the caches were left consistent: a fresh engine given the same history says the same
    with load(zoo.bundle("qwen2", DISAGREEING), k=3, drafter="model") as other:
        again = other.chat()
        again.messages = history
        assert "".join(r.text for r in again.send("and then", max_tokens=10)) == reply


def test_chat_template_format_needs_a_chat_template(engine):
    # a base model without a template chats through a transcript (tests/test_chat_formats.py)
    with pytest.raises(ConfigError, match="chat template"):
        engine.chat(chat_format="template")


# -- sampling and options ------------------------------------------------------------------

def test_seeded_sampling_is_reproducible(engine, fresh):
    kw = dict(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50)
    a = engine.generate(PROMPT, seed=123, **kw)
    assert engine.generate(PROMPT, seed=123, **kw) == a == fresh(seed=123, **kw)
    outs = {engine.generate(PROMPT, seed=s, **kw) for s in range(4)}
    assert len(outs) > 1


@pytest.mark.parametrize("use_draft", [True, False])
@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_sampling_with_and_without_a_draft(zoo, use_draft, max_tokens):
    # steps that draft nothing (no draft, or one token left) must sample too
    drafting = dict(k=3, drafter="model") if use_draft else dict(use_draft=False)
    with load(zoo.bundle("llama", DISAGREEING), **drafting) as e:
        _, ids, rs = collect(e.stream(PROMPT, max_tokens=max_tokens, temperature=1.0, seed=1))
        assert len(ids) == max_tokens and rs[-1].finish_reason == "length"
        assert collect(e.stream(PROMPT, max_tokens=max_tokens, temperature=1.0, seed=1))[1] == ids


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-1), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(top_p=1.5), "top-p"),
    (dict(top_p=0.0), "top-p"),
    (dict(top_k=-1), "top-k"),
    (dict(seed=-5), "seed"),
    (dict(max_tokens=0), "max-tokens"),
])
def test_bad_sampling_options_raise_config_error(engine, kw, match):
    with pytest.raises(ConfigError, match=match):
        list(engine.stream(PROMPT, **kw))


def test_an_empty_prompt_is_refused(engine):
    with pytest.raises(ConfigError, match="empty"):
        list(engine.stream([]))


@pytest.mark.parametrize("kw, match", [
    (dict(backend="tensorrt"), "unknown backend"),
    (dict(policy="psychic"), "policy"),
    (dict(k=-1), "k must be"),
])
def test_bad_engine_options_raise_config_error(zoo, kw, match):
    with pytest.raises(ConfigError, match=match):
        load(zoo.bundle("llama"), **kw)


def test_backend_is_picked_from_bundle_formats_and_devices_are_checked():
    from edgespec.runtimes import BACKENDS, pick_backend

    assert pick_backend({"onnx": None}) == "onnxruntime"
    with pytest.raises(ConfigError, match="no installed backend runs"):
        pick_backend({"no-such-format": None})
    with pytest.raises(ConfigError, match="unknown backend"):
        pick_backend({"onnx": None}, "tensorrt")
    assert "onnxruntime" in BACKENDS


def test_onnxruntime_threads_spin_only_without_a_draft_model(zoo):
    # a draft and its target take turns on the cores: neither session may spin-wait between runs
    with load(zoo.bundle("llama", DISAGREEING), drafter="model") as e:
        assert e.target.spin is False and e.draft.spin is False
    for kw in (dict(use_draft=False), dict(drafter="ngram")):
        with load(zoo.bundle("llama", DISAGREEING), **kw) as e:
            assert e.draft is None and e.target.spin is True


def test_unknown_device_names_the_available_ones(zoo):
    from edgespec.errors import BackendError

    with pytest.raises(BackendError, match="device 'NPU' is not available.*CPU"):
        load(zoo.bundle("llama"), device="NPU")


# -- threads, cancellation and closing -------------------------------------------------------

def test_responses_carry_memory_and_speed(engine):
    rs = list(engine.stream(PROMPT, max_tokens=12))
    for r in rs:
        assert set(r.memory) == {"target", "draft"} and r.memory["target"]["weights"] > 0
        assert r.memory_bytes == sum(v for m in r.memory.values() for k, v in m.items() if k != "kv_used")
    used = "kv_used" if "kv_used" in rs[0].memory["target"] else "kv"  # preallocated caches report both
    assert rs[-1].memory["target"][used] > rs[0].memory["target"][used] > 0  # the cache filled up
    assert rs[-1].memory["target"]["kv"] >= rs[-1].memory["target"][used]
    assert rs[-1].tokens_per_s > 0


def test_a_stop_event_cancels_and_rewinds(engine, fresh):
    import threading

    stop = threading.Event()
    rs = []
    for r in engine.stream(PROMPT, max_tokens=24, stop_event=stop):
        rs.append(r)
        if len(rs) == 2:
            stop.set()  # a Stop button; the stream ends after this step
    assert [r.finish_reason for r in rs] == [None, None, "cancelled"]
    assert rs[-1].token_ids == [] and rs[-1].stats.new_tokens < 24
    text = "".join(r.text for r in rs)
    assert fresh().startswith(text) and text  # what was said so far, held-back text included
    assert not engine.busy
    assert engine.generate(PROMPT, max_tokens=24) == fresh()  # caches rewound
    # an event already set: nothing is generated
    assert [r.finish_reason for r in engine.stream(PROMPT, stop_event=stop)] == ["cancelled"]


def test_other_threads_wait_or_are_refused(engine, fresh):
    import threading

    first = engine.stream(PROMPT, max_tokens=24)
    head = next(first)
    assert engine.busy
    errors: list = []

    def try_(wait):
        try:
            engine.generate(PROMPT, max_tokens=4, wait=wait)
        except BusyError as e:
            errors.append(str(e))

    for wait in (False, 0.05):
        t = threading.Thread(target=try_, args=(wait,))
        t.start()
        t.join(10)
    assert len(errors) == 2 and "already generating" in errors[0] and "after waiting 0.05 s" in errors[1]
    with pytest.raises(BusyError, match="this thread"):  # waiting on ourselves would never end
        engine.generate(PROMPT, max_tokens=4, wait=True)
    with pytest.raises(ConfigError, match="wait"):
        engine.generate(PROMPT, wait=-1)
    out: dict = {}
    waiter = threading.Thread(
        target=lambda: out.setdefault("text", engine.generate(LONG_PROMPT, max_tokens=8, wait=True)))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and "text" not in out  # it waits for its turn
    rest = "".join(r.text for r in first)
    waiter.join(30)
    assert out["text"] == fresh(LONG_PROMPT, max_tokens=8)
    assert head.text + rest == fresh()


def test_close_cancels_a_generation_in_another_thread(zoo):
    import threading
    import time

    e = load(zoo.bundle("llama", DISAGREEING), k=3, drafter="model")
    started, reasons = threading.Event(), []

    def consume():
        for r in e.stream(PROMPT, max_tokens=400):
            started.set()
            reasons.append(r.finish_reason)
            time.sleep(0.01)  # a slow consumer, e.g. a GUI

    worker = threading.Thread(target=consume)
    worker.start()
    assert started.wait(30)
    e.close()
    worker.join(30)
    assert reasons[-1] == "cancelled" and len(reasons) < 400 and e.closed
    with pytest.raises(EngineClosedError):
        e.generate(PROMPT)
    e.close()  # idempotent


def test_close_ends_a_suspended_stream_of_the_same_thread(zoo):
    with load(zoo.bundle("llama", DISAGREEING), k=3, drafter="model") as e:
        stream = e.stream(PROMPT, max_tokens=24)
        next(stream)
    assert e.closed and not e.busy  # __exit__ did not wait for ourselves
    assert list(stream) == []


def test_chat_stop_event_keeps_the_conversation_and_a_refused_turn_leaves_no_trace(chat_engine):
    import threading

    session = chat_engine.chat()
    stop = threading.Event()
    for i, r in enumerate(session.send("hello world", max_tokens=30, stop_event=stop)):  # noqa: B007 - r, the last Response, is read after the loop
        if i == 1:
            stop.set()
    assert r.finish_reason == "cancelled"
    assert [m["role"] for m in session.messages] == ["user", "assistant"] and session.messages[1]["content"]
    busy = chat_engine.stream(PROMPT, max_tokens=8)
    next(busy)
    with pytest.raises(BusyError):
        list(session.send("one two three"))
    busy.close()
    assert [m["role"] for m in session.messages] == ["user", "assistant"] and len(session.turn_stats) == 1
    reply = "".join(r.text for r in session.send("one two three", max_tokens=6))
    assert session.messages[-1] == {"role": "assistant", "content": reply}


def test_the_server_says_when_the_engine_decodes_plainly_for_inexactness(zoo, monkeypatch, tmp_path):
    """Where no verify width rounds like plain decoding here, /health and every response's usage
    block say the engine decodes plainly and why; OpenAI's client keeps that usage key as an extra."""
    # the faked verdict is cached: in a cache of its own, so later tests probe this bundle afresh
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    import numpy as np
    from fastapi.testclient import TestClient

    from edgespec.engine.opened import DRAFTING_REFUSED
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime
    from edgespec.server import ServerConfig, create_app

    bundle = zoo.bundle("qwen2", DISAGREEING)
    with load(bundle, k=3, drafter="model") as e, TestClient(create_app(e, ServerConfig(model_id="m"))) as http:
        health = http.get("/health").json()
        assert health["speculative"] is True and health["reason"] is None
        usage = http.post("/v1/completions", json={"model": "m", "prompt": PROMPTS[0], "max_tokens": 4}).json()["usage"]
        assert "edgespec" not in usage  # nothing to say where it drafts
    forward = OnnxRuntime.forward

    def rounded(self, token_ids, n_logits=1):  # every verify width rounds apart from one-token forwards
        out = forward(self, token_ids, n_logits)
        return out + np.float32(1e-3) if len(token_ids) > 1 else out

    monkeypatch.setattr(OnnxRuntime, "forward", rounded)
    note = {"speculative": False, "reason": DRAFTING_REFUSED}
    with load(bundle, k=3, drafter="model", retune=True) as e, \
            TestClient(create_app(e, ServerConfig(model_id="m"))) as http:
        assert e.drafter_name is None
        health = http.get("/health").json()
        assert health["status"] == "ok" and {k: health[k] for k in note} == note
        for path, body in (("/v1/completions", {"prompt": PROMPTS[0]}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            # greedy: a sampled reply may end early at a drawn end of turn
            reply = http.post(path, json={"model": "m", "max_tokens": 4, "temperature": 0, **body}).json()
            assert reply["usage"]["edgespec"] == note, path
            usage = openai.types.CompletionUsage.model_validate(reply["usage"])
            assert usage.model_extra["edgespec"] == note and usage.completion_tokens == 4
        stream = http.post("/v1/completions", json={"model": "m", "prompt": PROMPTS[0], "max_tokens": 4,
                                                    "stream": True, "stream_options": {"include_usage": True}})
        chunks = [json.loads(ln[6:]) for ln in stream.text.splitlines() if ln.startswith("data: {")]
        assert chunks[-1]["usage"]["edgespec"] == note
