"""Chat formats, as data: how a conversation becomes the text a model continues.

An instruction-tuned model is chatted with through its own chat template (the bundle's Jinja
template, format "template"). A base model has learned no turn markers, so it is chatted with
through a plain-text transcript: a short preamble, then speaker markers it has seen in its
training text (`Question:` / `Answer:`), and its reply ends where the transcript would go on
(the next speaker marker, or a blank line where the format says so). Each family may name its
transcript; others use DEFAULT_TRANSCRIPT. Why these markers and stops: docs/chat-formats.md.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["Transcript", "TRANSCRIPTS", "DEFAULT_TRANSCRIPT", "TEMPLATE", "AUTO", "CHAT_FORMAT_CHOICES",
           "ChatSampling", "CHAT_SAMPLING", "pick_chat_format"]

TEMPLATE = "template"  # the bundle's own (or its family's) Jinja chat template
AUTO = "auto"  # the model's own template if it has one, else its family's transcript


@dataclass(frozen=True)
class Transcript:
    """A plain-text chat format for a base model; `stop` travels with it."""

    name: str
    description: str
    user: str  # speaker marker before a user message, e.g. "Question:"
    assistant: str  # speaker marker the reply follows, e.g. "Answer:"
    preamble: str = ""  # first paragraph of the transcript; a system prompt follows it
    blank_line_ends: bool = True  # a blank line after some text ends the reply (one paragraph, one code block)

    def __post_init__(self) -> None:
        if not self.user.strip() or not self.assistant.strip() or self.user == self.assistant:
            raise ConfigError(f"transcript {self.name!r}: needs two different, non-empty speaker markers")

    @property
    def stop(self) -> tuple[str, ...]:
        """Strings that end a reply: the next speaker's marker (either one, on a new line). EOS
        ends it too (the tokenizer's stop ids), and a blank line after some text where
        `blank_line_ends` says so (session.ReplyShaper: a reply may open with a blank line
        before a code block, so that is no plain stop string)."""
        return (f"\n{self.user}", f"\n{self.assistant}")

    def render(self, messages: Sequence[dict]) -> str:
        """The transcript of `messages`, ending with the assistant's marker for the reply.

        A reply is written back as `marker + " " + text`: the model wrote it after the marker
        with a leading space, so the next turn's tokens keep the cached ones (the same text)."""
        head = [self.preamble] if self.preamble else []
        turns: list[str] = []
        for m in messages:
            role, text = m["role"], str(m["content"]).strip()
            if role == "system":
                if text:
                    head.append(text)
            elif role == "user":
                turns.append(f"{self.user} {text}")
            elif role == "assistant":
                # a reply stopped before its first word is the bare marker
                turns.append(f"{self.assistant} {text}".rstrip() + ("\n" if self.blank_line_ends else ""))
            else:
                raise ConfigError(f"chat message role must be system, user or assistant, got {role!r}")
        preamble = "\n".join(head) + "\n\n" if head else ""
        return preamble + "\n".join(turns) + f"\n{self.assistant}"


TRANSCRIPTS: dict[str, Transcript] = {
    t.name: t for t in (
        # two worked examples anchor the answers' style (as llama.cpp's chat-with-bob prompt does):
        # without them a base model copies the style of the conversation's last answers
        Transcript("qa", "Question: ... / Answer: ... (a Q&A transcript)", "Question:", "Answer:",
                   preamble="Questions and correct, short answers.\n\n"
                            "Question: What is the capital of Spain?\nAnswer: The capital of Spain is Madrid.\n\n"
                            "Question: Write a Python function that adds two numbers.\n"
                            "Answer: def add(a, b):\n    return a + b"),
        Transcript("user-assistant", "User: ... / Assistant: ... (a dialogue transcript)", "User:", "Assistant:",
                   preamble="A conversation between a user and a helpful, knowledgeable assistant."),
    )
}
DEFAULT_TRANSCRIPT = "qa"  # the measured best on the default model: docs/chat-formats.md
CHAT_FORMAT_CHOICES = (AUTO, TEMPLATE, *TRANSCRIPTS)


def pick_chat_format(requested: str | None, *, has_template: bool, template_is_models_own: bool,
                     family_transcript: str | None = None) -> str:
    """The chat format to use: `requested` checked against what the model has, or for
    None / "auto" the model's own template, else the family's transcript, else the default one.

    A template a family lends a base model (e.g. Gemma's turn markers) is not used by "auto":
    a base model was never trained on it and answers it with babble."""
    if requested is None or requested == AUTO:
        if has_template and template_is_models_own:
            return TEMPLATE
        return family_transcript or DEFAULT_TRANSCRIPT
    if requested not in CHAT_FORMAT_CHOICES:
        raise ConfigError(f"unknown chat format {requested!r} (choose from: {', '.join(CHAT_FORMAT_CHOICES)})")
    if requested == TEMPLATE and not has_template:
        raise ConfigError("this model has no chat template; choose a transcript chat format "
                          f"({', '.join(TRANSCRIPTS)}) or auto")
    return requested


@dataclass(frozen=True)
class ChatSampling:
    """Default sampling of `edgespec chat`, as llama.cpp and LM Studio users expect (reasons in
    docs/chat-formats.md). Sampling stays exact under speculative decoding (rejection sampling)."""

    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.0  # off, as before min_p existed


CHAT_SAMPLING = ChatSampling()
