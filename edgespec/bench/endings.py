"""How a bench prompt is shown to the model and where its run ends: as `edgespec chat` would.

A chat prompt (messages) is rendered in the chat format `edgespec chat` picks for the bundle (the
model's template, or a base model's plain-text transcript: engine/session.chat_format_for), and
its run ends where chat ends a reply: at an end-of-turn or EOS token, at the transcript's next
speaker, or, where the transcript says so, at a blank line after some text (session.ReplyShaper).
So a chat class measures replies as a user gets them, not a base model rambling on to
--max-tokens. A raw text prompt is a base-model continuation, its own class (`CONTINUATION`,
unless its file names another): it runs to --max-tokens, or to EOS with --stop-at-eos.

Every configuration, the peers included, ends its run by the same `Ending`; a peer that runs in
another process is given its stop strings (server_peer.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .suites import CONTINUATION, Prompt

__all__ = ["CONTINUATION", "Ending", "Rendered", "render", "watcher"]


@dataclass(frozen=True)
class Ending:
    """Where a run ends: a token of `stop_ids`, a string of `stop_text` in its text, or, with
    `blank_line_ends`, a blank line once the reply's opening whitespace is past."""

    stop_ids: tuple[int, ...] = ()
    stop_text: tuple[str, ...] = ()
    blank_line_ends: bool = False

    @property
    def by_text(self) -> bool:
        return bool(self.stop_text) or self.blank_line_ends

    def ended(self, text: str) -> bool:
        """Whether a reply whose text so far is `text` has ended (its stop ids aside)."""
        if any(s in text for s in self.stop_text):
            return True
        return self.blank_line_ends and "\n\n" in text.lstrip()

    def server_stop(self) -> list[str]:
        """The stop strings a server takes for this ending (a blank line as the plain string: a
        server has no notion of the reply's opening whitespace)."""
        return [*self.stop_text, *(["\n\n"] if self.blank_line_ends else [])]


@dataclass(frozen=True)
class Rendered:
    """A prompt's token ids and where its runs end."""

    ids: list[int]
    ending: Ending


def render(prompt: Prompt, tokenizer, chat_format, stop_at_eos: bool) -> Rendered:
    """`prompt` as the model sees it under `chat_format` (a session.ChatFormat) and its ending."""
    if not prompt.is_chat:
        return Rendered(tokenizer.encode(prompt.text), Ending(tuple(sorted(tokenizer.stop_ids)) if stop_at_eos else ()))
    chat = chat_format.prompt(tokenizer, [{"role": r, "content": c} for r, c in prompt.messages], shaped=True)
    return Rendered(chat.tokens, Ending(tuple(sorted(tokenizer.stop_ids)), tuple(chat.stop), chat.blank_line_ends))


def watcher(tokenizer, ending: Ending):
    """A callable on a run's new token ids that says whether its reply has ended by its text; None
    where the ending has no text rule (only stop ids, or none)."""
    if not ending.by_text:
        return None

    def ended(new_ids: Sequence[int]) -> bool:
        return ending.ended(tokenizer.decode(new_ids))

    return ended
