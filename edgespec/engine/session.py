"""Multi-turn chat on an Engine: the conversation's tokens are kept, so each turn only
prefills what is new (the decoder reuses the cached common prefix).

The chat format (models/chat_formats.py) decides how messages become tokens: the bundle's
chat template for an instruction-tuned model, a plain-text transcript for a base model. The
server renders its requests through the same `chat_format_for` / `ChatFormat.prompt`."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..decoding import GenerationStats, SamplingParams, check_max_tokens
from ..errors import ConfigError, ContextFullError, EdgespecError
from ..models.chat_formats import TEMPLATE, TRANSCRIPTS, Transcript, pick_chat_format
from ..models.templates import ChatTemplateError
from ..models.tool_calls import Function, ToolSyntax, plain_messages, template_messages, tool_syntax_for
from .inputs import check_stop, check_text

if TYPE_CHECKING:
    import threading

    from ..bundle import Bundle, Manifest
    from ..decoding.grammar import Grammar, ResponseFormat
    from ..tokenizer import Tokenizer
    from .opened import Opened
    from .response import Response

__all__ = ["ChatEngine", "ChatSession", "ChatFormat", "ChatPrompt", "ReplyShaper", "chat_format_for"]

logger = logging.getLogger(__name__)


class ChatEngine(Protocol):
    """What a chat needs of its engine (engine.Engine is one): its bundle and tokenizer, what was
    opened (the context limit), grammars, and a stream of Responses over token ids."""

    bundle: Bundle
    tokenizer: Tokenizer
    opened: Opened

    def grammar(self, fmt: ResponseFormat | dict | None) -> Grammar | None: ...

    def stream_ids(self, tokens: list[int], params: SamplingParams, max_tokens: int, stop: Sequence[str] = (),
                   stats: GenerationStats | None = None, *, stop_event: threading.Event | None = None,
                   wait: bool | float = False, grammar: Grammar | None = None) -> Iterator[Response]: ...


@dataclass(frozen=True)
class ChatPrompt:
    """What one chat turn feeds the engine: the tokens and the strings that end the reply.

    A transcript reply is also shaped as it streams (ReplyShaper: its opening whitespace dropped,
    ended at a blank line after some text where the format says so): see `shaper()`."""

    tokens: list[int]
    stop: tuple[str, ...]
    transcript: bool = False
    blank_line_ends: bool = False
    tool_syntax: str = "plain"  # how the model writes tool calls (models/tool_calls.SYNTAXES)

    def shaper(self) -> ReplyShaper | None:
        return ReplyShaper(self.blank_line_ends) if self.transcript else None


@dataclass
class ReplyShaper:
    """Shapes a transcript reply as it streams: drops the whitespace that opens it (the space
    after "Answer:", the blank line before a code block), holds back trailing whitespace, and
    where the format says so ends the reply at its first blank line after some text. A plain
    stop string cannot say "after some text": a reply opening with a blank line would end empty."""

    blank_line_ends: bool
    _held: str = ""
    _started: bool = False

    def push(self, text: str, final: bool = False) -> tuple[str, bool]:
        """The text to emit now, and whether the reply ends here (a blank line)."""
        s, self._held = self._held + text, ""
        if not self._started:
            s = s.lstrip()
            self._started = bool(s)
        if self.blank_line_ends and "\n\n" in s:
            return s[:s.index("\n\n")].rstrip(), True
        if final:
            return s.rstrip(), False
        keep = len(s.rstrip())  # trailing whitespace: a blank line forming, or the reply's end
        self._held = s[keep:]
        return s[:keep], False

    def shape(self, r: Response) -> Response:
        """`r` with its text shaped; finish_reason "stop" where the reply ends here."""
        text, ended = self.push(r.text, final=r.finish_reason is not None)
        return dataclasses.replace(r, text=text, finish_reason="stop" if ended else r.finish_reason)


@dataclass(frozen=True)
class ChatFormat:
    """A resolved chat format: the bundle's template (transcript None) or a transcript."""

    name: str
    transcript: Transcript | None = None

    @property
    def stop(self) -> tuple[str, ...]:
        # a template's end-of-turn token is among the tokenizer's stop ids already
        return self.transcript.stop if self.transcript else ()

    def encode(self, tokenizer: Tokenizer, messages: Sequence[dict], tools: list[dict] | None = None) -> list[int]:
        if self.transcript is None:
            return tokenizer.encode_chat(list(messages), tools)
        return tokenizer.encode(self.transcript.render(messages))  # with BOS, as a plain prompt

    def tool_syntax(self, tokenizer: Tokenizer) -> ToolSyntax:
        """How the model writes tool calls: its own template's syntax, where it is chatted with
        through a template that has one; else edgespec's plain convention."""
        return tool_syntax_for(tokenizer.info.chat_template, uses_template=self.transcript is None)

    def tool_prompt(self, tokenizer: Tokenizer, messages: Sequence[dict], functions: Sequence[Function],
                    stop: Sequence[str] = (), shaped: bool = False) -> ChatPrompt:
        """`prompt` for a conversation with tools (`functions`, and earlier calls and results in
        `messages`): through the template that knows tools, or the plain convention's messages."""
        syntax = self.tool_syntax(tokenizer)
        if syntax.in_template:
            tokens = self.encode(tokenizer, template_messages(messages), [f.openai() for f in functions] or None)
        else:
            tokens = self.encode(tokenizer, plain_messages(messages, functions, syntax))
        return self._prompt(tokens, stop, shaped, syntax.name)

    def prompt(self, tokenizer: Tokenizer, messages: Sequence[dict], stop: Sequence[str] = (),
               shaped: bool = False) -> ChatPrompt:
        """Tokens for `messages` and the format's stop strings after the caller's `stop`.
        A caller that shapes the reply (`shaped`: ChatSession, the server; ReplyShaper) ends it at
        a blank line after some text. A caller that only has stop strings gets the plain stop
        string "\n\n" instead: the transcript's worked examples start a reply on the marker's
        line (all 18 of docs/chat-formats.md's questions did), so it rarely ends a reply before
        its text, but a reply that opens with a blank line would end empty."""
        return self._prompt(self.encode(tokenizer, messages), stop, shaped)

    def _prompt(self, tokens: list[int], stop: Sequence[str], shaped: bool, tool_syntax: str = "plain") -> ChatPrompt:
        t = self.transcript
        blank = t is not None and t.blank_line_ends
        plain_stop = ("\n\n",) if blank and not shaped else ()
        return ChatPrompt(tokens, tuple(stop) + self.stop + plain_stop, transcript=t is not None,
                          blank_line_ends=blank, tool_syntax=tool_syntax)

    def describe(self) -> str:
        """One phrase for notes: what the model is shown."""
        if self.transcript is None:
            return "its chat template"
        t = self.transcript
        return (f"the plain-text '{t.name}' transcript ('{t.user} ...' / '{t.assistant} ...'; a reply ends at the "
                f"next speaker{' or a blank line' if t.blank_line_ends else ''})")


def _room(max_tokens: int, limit: int) -> int:
    """Context positions a turn keeps for its reply (which may still end early with "length")."""
    return max(1, min(max_tokens, limit // 4))


def chat_format_for(manifest: Manifest, tokenizer: Tokenizer, requested: str | None = None) -> ChatFormat:
    """The chat format of a bundle: `requested` ("auto", "template" or a transcript name; None is
    "auto") checked against what the bundle has. "auto" uses a model's own template, and for a
    base model its family's transcript (or the default transcript): see pick_chat_format."""
    from ..models.families import FAMILIES

    family = FAMILIES.get(manifest.model_type)
    name = pick_chat_format(requested, has_template=tokenizer.has_chat_template,
                            template_is_models_own=manifest.tokenizer.chat_template_source == "model",
                            family_transcript=family.chat_transcript if family else None)
    return ChatFormat(name, None if name == TEMPLATE else TRANSCRIPTS[name])


class ChatSession:
    """Messages plus the token sequence the engine's caches hold for them."""

    def __init__(self, engine: ChatEngine, system: str | None = None, chat_format: str | None = None) -> None:
        self.format = chat_format_for(engine.bundle.manifest, engine.tokenizer, chat_format)
        self.engine = engine
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.tokens: list[int] = []  # what the last turn left in the caches
        self.turn_stats: list[GenerationStats] = []
        self.notices: list[str] = []  # one line per time old turns were dropped to fit the context
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (keeps the system prompt)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.tokens = []
        self.turn_stats = []

    def send(self, message: str, *, max_tokens: int = 512, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, min_p: float = 0.0, seed: int | None = None, stop: Sequence[str] = (),
             stop_event: threading.Event | None = None, wait: bool | float = False,
             response_format: ResponseFormat | dict | None = None) -> Iterator[Response]:
        """Add a user message and stream the reply. The reply is recorded in the history
        even when the stream is stopped early (a Stop button setting `stop_event`, leaving the
        loop, Ctrl-C); a turn refused before its first token (BusyError) leaves no trace.
        stop, stop_event, wait, response_format: as in Engine.stream; the chat format's stop
        strings are added, except under a response format, whose grammar decides where the reply
        ends (a transcript's markers and blank lines would cut it short).
        Greedy by default (reproducible); CLI chat samples with models.chat_formats.CHAT_SAMPLING."""
        if not check_text(message, "the message").strip():
            raise ConfigError("empty message")
        check_max_tokens(max_tokens)
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, min_p=min_p)
        grammar = self.engine.grammar(response_format)
        stop = check_stop(stop) + (self.format.stop if grammar is None else ())
        return self._turn(message, params, max_tokens, stop, stop_event, wait, grammar)

    def _turn(self, message: str, params: SamplingParams, max_tokens: int, stop: tuple[str, ...],
              stop_event, wait, grammar: Grammar | None = None) -> Iterator[Response]:
        self.messages.append({"role": "user", "content": message})
        reply, stats = [], GenerationStats()
        tokens = None
        try:
            # may drop the oldest turns; a message too long for the context raises ContextFullError
            tokens = self._fit_context(max_tokens)
            t = self.format.transcript
            shaper = ReplyShaper(t.blank_line_ends) if t is not None and grammar is None else None
            stream = self.engine.stream_ids(tokens, params, max_tokens, stop, stats=stats,
                                            stop_event=stop_event, wait=wait, grammar=grammar)
            try:
                for r in stream:
                    if shaper is not None:
                        r = shaper.shape(r)
                    reply.append(r.text)
                    yield r
                    if r.finish_reason is not None:
                        break
            finally:
                stream.close()  # ended by the shaper, or by the consumer: the engine rewinds its caches
        finally:
            if stats.steps:  # answered, fully or in part: keep what was said
                self.messages.append({"role": "assistant", "content": "".join(reply)})
                self.turn_stats.append(stats)
            else:  # refused, failed or stopped before the first token: the turn did not happen
                self.messages.pop()
            if tokens is not None and stats.steps:
                self.tokens = tokens

    def check_room(self, max_tokens: int) -> None:
        """Refuse, once and up front, a chat in which no message can fit: the chat format's own
        tokens (a transcript's worked examples, a template's markers) and the system prompt
        around an empty message, with the reply's room, already fill the context."""
        limit = self.engine.opened.context_limit
        if limit is None:
            return
        room = _room(check_max_tokens(max_tokens), limit)
        empty = self.messages[:1] if self.system else []  # the system prompt, kept first by reset()
        try:
            framing = len(self.format.encode(self.engine.tokenizer, [*empty, {"role": "user", "content": ""}]))
        except ChatTemplateError:  # invalid or unsafe: no turn can succeed
            raise
        except EdgespecError:  # past a render limit, or failing on these messages: each turn says so itself
            return
        if framing + room >= limit:
            what = f"the '{self.format.name}' chat format" + (" and the system prompt take" if self.system
                                                              else " takes")
            other = "" if self.format.transcript is None else " or pick a shorter --chat-format"
            raise ContextFullError(f"{what} {framing} tokens before any message, and the context holds {limit} "
                                   f"including {room} for the reply, so no message fits: raise --max-context{other}")

    def _fit_context(self, max_tokens: int) -> list[int]:
        """Tokens of the conversation, dropping its oldest turns (never the system prompt) while
        it leaves less than a reply's room in the context; says so once per drop."""
        def encode(messages: list[dict]) -> list[int]:
            return self.format.encode(self.engine.tokenizer, messages)

        tokens = encode(self.messages)
        limit = self.engine.opened.context_limit
        if limit is None:
            return tokens
        room = _room(max_tokens, limit)
        first = 1 if self.messages and self.messages[0]["role"] == "system" else 0
        kept = list(self.messages)
        dropped = 0
        while len(tokens) + room > limit and len(kept) - first > 1:
            n = 2 if len(kept) - first > 2 and kept[first + 1]["role"] == "assistant" else 1
            del kept[first:first + n]
            dropped += 1
            tokens = encode(kept)
        if len(tokens) + room > limit:
            self.check_room(max_tokens)  # no message at all fits: say why, not "the message is too long"
            raise ContextFullError(f"the message is too long: {len(tokens)} tokens, and the context holds "
                                   f"{limit} including {room} for the reply")
        if dropped:
            self.messages = kept
            note = (f"context full ({limit} tokens): dropped the {dropped} oldest turn{'s' * (dropped > 1)}"
                    f"{', kept the system prompt' if first else ''}")
            self.notices.append(note)
            logger.info(note)
        return tokens
