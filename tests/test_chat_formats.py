"""Chat formats: a base model chats through a plain-text transcript whose stop strings end the
reply; an instruction-tuned model keeps its template. Rendering, the choice of format and its
validation, stop strings cut from the reply while the conversation keeps reusing the cache,
the CLI (--chat-format, invalid UTF-8 on a pipe) and the server's /v1/chat/completions."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from edgespec.engine.engine import load
from edgespec.engine.session import ChatFormat, ChatPrompt, ReplyShaper, chat_format_for
from edgespec.errors import ConfigError
from edgespec.models.chat_formats import (
    CHAT_FORMAT_CHOICES,
    DEFAULT_TRANSCRIPT,
    TRANSCRIPTS,
    Transcript,
    pick_chat_format,
)
from edgespec.models.families import FAMILIES
from tests.tiny import PROMPTS
from tests.zoo import DISAGREEING

QA = TRANSCRIPTS["qa"]


# -- the formats as data -------------------------------------------------------------------

def test_qa_transcript_renders_turns_and_ends_at_the_answer_marker():
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": " What is the capital of France? "},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Italy?"}]
    assert QA.render(messages) == (f"{QA.preamble}\nBe brief.\n\n"
                                   "Question: What is the capital of France?\nAnswer: Paris.\n\n"
                                   "Question: And of Italy?\nAnswer:")
    no_blank = Transcript("t", "", "User:", "Assistant:", blank_line_ends=False)
    assert no_blank.render(messages[1:]) == ("User: What is the capital of France?\nAssistant: Paris.\n"
                                             "User: And of Italy?\nAssistant:")


def test_stop_strings_travel_with_the_format():
    assert QA.stop == ("\nQuestion:", "\nAnswer:") and QA.blank_line_ends
    assert TRANSCRIPTS["user-assistant"].stop == ("\nUser:", "\nAssistant:")
    assert ChatFormat("template").stop == ()  # the template's end-of-turn token is a stop id
    prompt = ChatFormat("qa", QA).prompt(_Chars(), [{"role": "user", "content": "hi"}], stop=["END"])
    assert prompt.stop == ("END", *QA.stop, "\n\n") and prompt.tokens == [ord(c) for c in QA.render(
        [{"role": "user", "content": "hi"}])]
    assert isinstance(prompt.shaper(), ReplyShaper) and ChatPrompt([1], ()).shaper() is None


class _Chars:
    """A tokenizer stand-in: one id per character."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def shape(chunks: list[str], blank_line_ends: bool = True) -> tuple[list[str], bool]:
    shaper, out = ReplyShaper(blank_line_ends), []
    for i, chunk in enumerate(chunks):
        text, ended = shaper.push(chunk, final=i == len(chunks) - 1)
        out.append(text)
        if ended:
            return out, True
    return out, False


def test_reply_shaper_drops_opening_whitespace_and_ends_at_a_blank_line_after_text():
    assert shape([" Paris", ".", "\n\n", "Question"]) == ([ "Paris", ".", ""], True)
    # a code block after a blank line is the reply, up to the next blank line
    out, ended = shape(["\n\n", "def f(s):", "\n", "    return s", "\n", "\n", "print(f(1))"])
    assert "".join(out) == "def f(s):\n    return s" and ended
    out, ended = shape(["\n\n", "def f(s):", "\n", "    return s", "\n", "\n", "print(f(1))"], blank_line_ends=False)
    assert "".join(out) == "def f(s):\n    return s\n\nprint(f(1))" and not ended
    assert shape([" a ", "b ", " "]) == (["a", " b", ""], False)  # trailing space held, then dropped


def test_transcripts_refuse_bad_markers_and_roles():
    with pytest.raises(ConfigError, match="speaker markers"):
        Transcript("t", "", "Q:", "Q:")
    with pytest.raises(ConfigError, match="role"):
        QA.render([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("requested, own, has, family, expected", [
    (None, True, True, "qa", "template"),  # instruction-tuned: its own template
    ("auto", False, True, "qa", "qa"),  # a base model with a family's template: the transcript
    (None, False, False, None, DEFAULT_TRANSCRIPT),  # no family transcript: the generic one
    ("user-assistant", True, True, "qa", "user-assistant"),  # asked for explicitly
    ("template", False, True, "qa", "template"),
])
def test_pick_chat_format(requested, own, has, family, expected):
    assert pick_chat_format(requested, has_template=has, template_is_models_own=own,
                            family_transcript=family) == expected


def test_pick_chat_format_rejects_what_cannot_work():
    with pytest.raises(ConfigError, match="choose from: " + ", ".join(CHAT_FORMAT_CHOICES)):
        pick_chat_format("chatml", has_template=True, template_is_models_own=True)
    with pytest.raises(ConfigError, match="no chat template"):
        pick_chat_format("template", has_template=False, template_is_models_own=False)


def test_every_family_names_a_known_transcript():
    assert FAMILIES["gemma3"].chat_transcript in TRANSCRIPTS
    assert all(f.chat_transcript in (None, *TRANSCRIPTS) for f in FAMILIES.values())


# -- sessions on tiny models ---------------------------------------------------------------

@pytest.fixture(scope="module")
def base_engine(zoo):
    """A llama base model (no chat template) with a draft that is often rejected."""
    with load(zoo.bundle("llama", DISAGREEING), k=3, drafter="model") as e:
        yield e


def test_bundles_get_the_right_format(base_engine, zoo):
    assert chat_format_for(base_engine.bundle.manifest, base_engine.tokenizer).name == DEFAULT_TRANSCRIPT
    with load(zoo.bundle("qwen2"), use_draft=False) as qwen:  # ships a ChatML template
        assert qwen.chat().format.name == "template"
        assert qwen.chat(chat_format="qa").format.transcript is QA
    with load(zoo.bundle("gemma3"), use_draft=False) as gemma:  # base; the bundle holds Gemma's template
        m = gemma.bundle.manifest
        assert m.base_model and m.tokenizer.chat_template_source == "family"
        assert gemma.chat().format.transcript is TRANSCRIPTS[FAMILIES["gemma3"].chat_transcript]
        assert gemma.chat(chat_format="template").format.transcript is None
    with pytest.raises(ConfigError, match="choose from"):
        base_engine.chat(chat_format="nonsense")


def test_a_base_model_chats_through_the_transcript(base_engine):
    session = base_engine.chat(system="Be brief.")
    reply = "".join(r.text for r in session.send("hello world", max_tokens=6))
    assert session.turn_stats[-1].prompt_tokens == len(base_engine.tokenizer.encode(
        f"{QA.preamble}\nBe brief.\n\nQuestion: hello world\nAnswer:"))
    assert reply == reply.lstrip()  # the space after "Answer:" belongs to the transcript
    assert reply.strip() and session.messages[-1] == {"role": "assistant", "content": reply}


@dataclass(frozen=True)
class _WordStop(Transcript):
    """The qa transcript, but its reply ends at `word`: a random tiny model writes no newlines."""

    word: str = ""

    @property
    def stop(self) -> tuple[str, ...]:
        return (self.word,)


def count_fed_tokens(engine, monkeypatch) -> list[int]:
    fed: list[int] = []
    forward = engine.target.forward

    def spy(token_ids, n_logits=1):
        fed.append(len(token_ids))
        return forward(token_ids, n_logits)

    monkeypatch.setattr(engine.target, "forward", spy)
    return fed


def _mid_reply_stop(text: str) -> int | None:
    """Where a 3-character stop string can form mid-reply (random weights write bytes, not words)."""
    return next((i for i in range(3, len(text) - 3) if "\ufffd" not in text[i:i + 3] and not text[i].isspace()
                 and text.find(text[i:i + 3]) == i), None)


def test_format_stop_strings_are_cut_and_the_next_turn_reuses_the_cache(base_engine, monkeypatch):
    fields = {f: getattr(QA, f) for f in ("name", "description", "user", "assistant")}
    for message in ("hello world", *PROMPTS):  # the first whose greedy reply has room for a stop string
        free = base_engine.chat()
        free.format = ChatFormat("qa", Transcript(**fields))
        full = "".join(r.text for r in free.send(message, max_tokens=16))
        at = _mid_reply_stop(full)
        if at is not None:
            break
    assert at is not None, f"the test needs a longer reply than {full!r}"
    stop_word, expected = full[at:at + 3], full[:at].rstrip()  # the shaper drops trailing whitespace

    session = base_engine.chat()
    session.format = ChatFormat("qa", _WordStop(**fields, word=stop_word))
    rs = list(session.send(message, max_tokens=16))
    reply = "".join(r.text for r in rs)
    assert reply == expected and stop_word not in reply
    assert rs[-1].finish_reason == "stop"
    assert session.messages[-1] == {"role": "assistant", "content": expected}

    # the next turn's transcript holds the cut reply, and its tokens extend the cached ones
    turn1 = session.turn_stats[-1].prompt_tokens
    fed = count_fed_tokens(base_engine, monkeypatch)
    list(session.send("one two three", max_tokens=1))  # one token: prefill + 1, no drafts
    rendered = session.format.transcript.render(session.messages[:-1])
    assert f"Question: {message}\nAnswer: {expected.strip()}\n\nQuestion: one two three\nAnswer:" in rendered
    turn2 = session.turn_stats[-1].prompt_tokens
    assert turn2 == len(base_engine.tokenizer.encode(rendered))
    assert 0 < sum(fed) <= turn2 - turn1  # the whole first prompt came from the cache


# -- the CLI -------------------------------------------------------------------------------

def run_chat(*args: str, stdin: bytes) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgespec", "chat", *args], input=stdin, capture_output=True,
                          timeout=300)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    err = proc.stderr.decode()
    # log warnings of the engine load (none by default) may come first; the error is one line
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("WARNING ")]
    assert proc.returncode != 0 and "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("edgespec: error:"), err
    return lines[0]


def test_cli_validates_the_chat_format(zoo):
    bundle = str(zoo.bundle("llama", DISAGREEING))
    line = one_line_error(run_chat(bundle, "--chat-format", "chatml", stdin=b"hi\n"))
    assert all(c in line for c in CHAT_FORMAT_CHOICES)
    assert "no chat template" in one_line_error(run_chat(bundle, "--chat-format", "template", stdin=b"hi\n"))


def test_cli_chat_on_a_base_model_says_which_format_and_survives_bad_utf8(zoo):
    bundle = str(zoo.bundle("llama", DISAGREEING))
    # a Latin-1 byte in a UTF-8 pipe: the chat goes on, the conversation is kept
    proc = run_chat(bundle, "--max-tokens", "6", "--temperature", "0",
                    stdin=b"caf\xe9 world\nthe cat\n/stats\n")
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "base model" in err and "Question:" in err and "--chat-format" in err
    assert "session: 2 replies" in proc.stdout.decode()


# -- the server ----------------------------------------------------------------------------

def test_server_chats_with_a_base_model_through_the_transcript(base_engine):
    for mod in ("fastapi", "uvicorn", "openai"):
        pytest.importorskip(mod, reason=f"the server test needs {mod} (pip install 'edgespec[serve,test]')")
    import openai

    from edgespec.server import create_app
    from tests.test_server import running

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}]
    fmt = chat_format_for(base_engine.bundle.manifest, base_engine.tokenizer)
    prompt = fmt.prompt(base_engine.tokenizer, messages)
    assert prompt.stop == (*QA.stop, "\n\n")  # a stop-strings-only caller ends at a blank line
    assert fmt.prompt(base_engine.tokenizer, messages, shaped=True).stop == QA.stop  # a shaper ends it
    # the reference: ChatSession's reply, shaped (no opening whitespace, ended at a blank line after text)
    expected = "".join(r.text for r in base_engine.chat(system="Be brief.").send("hello world", max_tokens=8))
    assert expected == expected.strip() and expected
    with running(create_app(base_engine)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model="edgespec", messages=messages, max_tokens=8, temperature=0)
        assert r.usage.prompt_tokens == len(prompt.tokens)
        assert r.choices[0].message.content == expected
        chunks = client.chat.completions.create(model="edgespec", messages=messages, max_tokens=8, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
