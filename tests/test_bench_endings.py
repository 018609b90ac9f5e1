"""Where a bench run ends (edgespec/bench/endings.py): chat prompts as `edgespec chat` ends a reply,
raw text prompts as a labelled continuation class; every configuration and peer by the same rule."""
from __future__ import annotations

import pytest

from edgespec.bench import Prompt, load_prompts
from edgespec.bench.endings import CONTINUATION, Ending, render, watcher
from edgespec.bench.measure import PLAIN, BenchConfig, build_decoders, cut_at_ending, measure_run, run_bench
from edgespec.bench.peer import _timed
from edgespec.bench.server_peer import completion_body
from edgespec.decoding import SamplingParams
from edgespec.engine.engine import load
from edgespec.engine.session import TEMPLATE, ChatFormat, ChatSession
from edgespec.models.chat_formats import TRANSCRIPTS


def test_a_reply_ends_at_the_next_speaker_or_a_blank_line_after_its_text():
    qa = Ending((1,), ("\nQuestion:", "\nAnswer:"), blank_line_ends=True)
    assert not qa.ended(" Paris is the capital.")
    assert qa.ended(" Paris.\nQuestion: and Rome?")
    assert qa.ended(" Paris.\n\nIt is")  # a blank line after some text
    assert not qa.ended("\n\n  def f():")  # the reply's opening whitespace is not a blank line after text
    assert qa.server_stop() == ["\nQuestion:", "\nAnswer:", "\n\n"]
    assert Ending((1,)).server_stop() == [] and not Ending((1,)).by_text


def test_raw_text_prompts_are_their_own_continuation_class():
    code = load_prompts("code")
    assert {p.cls for p in code if p.is_chat} == {"code"}
    assert {p.cls for p in code if not p.is_chat} == {CONTINUATION}
    assert all(p.cls in ("chat", "grounded", "long") or p.cls == "code" and p.is_chat or p.cls == CONTINUATION
               for p in load_prompts("all"))


def test_chat_prompts_render_and_end_as_chat_does(zoo):
    prompt = Prompt("q", "chat", messages=(("user", "the cat and the dog"),))
    with load(zoo.bundle("llama"), drafter="model", k=2) as engine:
        tok = engine.tokenizer
        qa = ChatFormat("qa", TRANSCRIPTS["qa"])
        r = render(prompt, tok, qa, stop_at_eos=False)
        assert tok.decode(r.ids).endswith("Answer:") and r.ending.stop_text == TRANSCRIPTS["qa"].stop
        assert set(r.ending.stop_ids) == set(tok.stop_ids) and r.ending.blank_line_ends  # EOS ends a reply too
        if tok.has_chat_template:
            templ = render(prompt, tok, ChatFormat(TEMPLATE), stop_at_eos=False)
            assert templ.ending.stop_text == () and set(templ.ending.stop_ids) == set(tok.stop_ids)
        raw = render(Prompt("r", CONTINUATION, text="the dog and the"), tok, qa, stop_at_eos=False)
        assert raw.ending == Ending() and render(Prompt("r", "c", text="a"), tok, qa, True).ending.stop_ids


def test_a_run_stops_at_the_step_its_text_ends(zoo):
    """A stop string first complete after the 5th token of a greedy reply ends the run there: the
    engine's decoders and an in-process peer alike."""
    with load(zoo.bundle("llama"), drafter="model", k=2) as engine:
        tok = engine.tokenizer
        ids = tok.encode("the cat and the dog")
        plain = build_decoders(engine)[PLAIN]
        runtimes = [engine.target, engine.draft]
        full = measure_run(plain, runtimes, ids, 12, ()).tokens
        texts = [tok.decode(full[:i]) for i in range(1, 13)]
        end = next(i for i in range(4, 12) if len(texts[i]) > len(texts[i - 1]) + 1)  # a token that adds 2+ chars
        stop = texts[end][-2:]
        assert stop not in texts[end - 1]
        ending = Ending((), (stop,))
        cut = measure_run(plain, runtimes, ids, 12, (), ended=watcher(tok, ending)).tokens
        assert cut == full[:end + 1]
        # a speculative step may commit tokens past the end: the run still ends at that token
        spec = build_decoders(engine)["speculative"]
        assert measure_run(spec, runtimes, ids, 12, (), ended=watcher(tok, ending)).tokens == full[:end + 1]
        peer = _timed(len(ids), (t for t in full), 12, (), None, watcher(tok, ending))  # a generator, as a peer's loop
        assert peer.tokens == full[:end + 1]


def test_a_step_that_commits_past_the_end_is_cut_at_the_first_ending_token():
    ended = lambda new: 7 in new  # noqa: E731
    assert cut_at_ending([1, 2, 7, 8, 9], 1, ended) == [1, 2, 7]
    assert cut_at_ending([1, 2, 3], 1, ended) == [1, 2, 3]  # to the limit: nothing to cut
    assert cut_at_ending([7, 8], 0, ended) == [7]


def test_the_bench_ends_chat_runs_like_chat_and_runs_continuations_to_the_limit(zoo, monkeypatch):
    """run_bench renders chat prompts in chat's format and ends them by its rule; a continuation
    runs to --max-tokens. The sampled chat reply is what a ChatSession gives for the same seed."""
    import edgespec.bench.measure as measure

    qa = ChatFormat("qa", TRANSCRIPTS["qa"])
    monkeypatch.setattr(measure, "chat_format_for", lambda manifest, tokenizer: qa)
    prompts = [Prompt("q", "chat", messages=(("user", "the cat and the dog"),)),
               Prompt("r", CONTINUATION, text="the dog and the")]
    with load(zoo.bundle("llama"), drafter="model", k=2) as engine:
        runs = run_bench(engine, prompts, BenchConfig(repeat=1, max_tokens=24, warmup=0))
        chat = ChatSession(engine, chat_format="qa")
        reply = list(chat.send("the cat and the dog", max_tokens=24))
        made = chat.turn_stats[-1].new_tokens
    by = {(r.config, r.prompt): r for r in runs}
    assert len(by[(PLAIN, "r")].tokens) == 24  # a continuation: fixed length
    assert len(by[(PLAIN, "q")].tokens) == made  # ended where the chat session ended its reply
    assert by[(PLAIN, "q")].tokens == by[("speculative", "q")].tokens and reply


def test_llama_server_gets_the_same_stop_strings():
    body = completion_body([1, 2], 32, SamplingParams(), stop_at_eos=True, stop=["\nQuestion:", "\n\n"])
    assert body["stop"] == ["\nQuestion:", "\n\n"] and body["ignore_eos"] is False
    assert "stop" not in completion_body([1, 2], 32, SamplingParams(), stop_at_eos=False)


@pytest.mark.parametrize("blank", [True, False])
def test_watcher_is_none_without_a_text_rule(blank):
    assert (watcher(None, Ending((1,), blank_line_ends=blank)) is None) is not blank
