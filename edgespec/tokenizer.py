"""Runtime tokenizer: HF `tokenizers` + a sandboxed Jinja chat template, no transformers/torch.

The chat template is the bundle's code: it is rendered in a child process with a time and a
memory limit (models/templates.py), so a template that never ends or fills the memory is a
one-line error instead of a hung chat or a killed process."""
from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path

from .bundle import TokenizerInfo
from .errors import BundleError, ConfigError
from .models.templates import TEMPLATE_TIMEOUT_S, InProcessRenderer, TemplateRenderer

__all__ = ["Tokenizer", "IncrementalDecoder"]

logger = logging.getLogger(__name__)


def _rust_error(e: BaseException) -> bool:
    # a panic in the Rust binding is a pyo3 PanicException, a BaseException: it must not pass
    # as a KeyboardInterrupt or SystemExit would
    return isinstance(e, Exception) or type(e).__name__ == "PanicException"


class Tokenizer:
    """Encode/decode text and render chat messages the way the model was trained.

    template_timeout_s: the time limit of one chat template render, in a child process (None:
    rendered in this process with no bound, for a caller that is itself a bounded child)."""

    def __init__(self, path: Path, info: TokenizerInfo, *,
                 template_timeout_s: float | None = TEMPLATE_TIMEOUT_S) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except BaseException as e:  # the Rust binding raises a bare Exception on bad JSON
            if not _rust_error(e):
                raise
            raise BundleError(f"cannot read tokenizer {path.name}: {_first_line(e)}") from None
        _check_vocabulary(self._tok, info, path.name)
        self.info = info
        self.stop_ids = frozenset(info.stop_token_ids)
        if template_timeout_s is not None and not template_timeout_s > 0:
            raise ConfigError(f"the chat template time limit must be > 0 s, got {template_timeout_s!r}")
        self.template_timeout_s = template_timeout_s

    @functools.cached_property
    def _renderer(self) -> TemplateRenderer | InProcessRenderer:
        """Made on the first chat render: a completion, a benchmark or a base model's transcript
        chat never starts the child (nor imports jinja2)."""
        if self.template_timeout_s is None:
            return InProcessRenderer()
        return TemplateRenderer(self.template_timeout_s)

    def close(self) -> None:
        """End the chat template's child process, if one was started (it also ends when the
        tokenizer is collected, or at exit)."""
        renderer = self.__dict__.pop("_renderer", None)
        if renderer is not None:
            renderer.close()

    @property
    def has_chat_template(self) -> bool:
        return bool(self.info.chat_template)

    @property
    def hf(self):
        """The `tokenizers.Tokenizer` underneath (its decoder streams text: IncrementalDecoder)."""
        return self._tok

    def serialized(self) -> str:
        """The tokenizer as tokenizer.json text (a grammar engine builds its view of it from this)."""
        return self._tok.to_str()

    def token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except BaseException as e:  # a tokenizer.json the Rust side cannot apply ("Unk token not found")
            if not _rust_error(e):
                raise
            raise BundleError(f"the bundle's tokenizer cannot encode this text: {_first_line(e)}") from None
        if add_special_tokens and self.info.add_bos and self.info.bos_token_id is not None:
            ids = [self.info.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The chat template's text for `messages`, within the time and memory limit
        (models/templates.py: ChatTemplateError, TemplateLimitError, ConfigError, one line each).
        `tools`: OpenAI's tool objects, for a template that lists them (as transformers passes them)."""
        if not self.info.chat_template:
            raise ConfigError("this model has no chat template; use `edgespec generate` for plain completion")
        bos = self.token(self.info.bos_token_id) if self.info.bos_token_id is not None else ""
        context = {"messages": messages, "add_generation_prompt": add_generation_prompt, "bos_token": bos or "",
                   "eos_token": ""}
        if tools:
            context["tools"] = tools
        return self._renderer.render(self.info.chat_template, context)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        # the template writes BOS itself, as transformers' apply_chat_template does
        return self.encode(self.render_chat(messages, tools=tools), add_special_tokens=False)

    def special_token_id(self, text: str) -> int | None:
        """The id of the added token whose text is `text`, where the grammar engine holds it as a
        special token (None: it is text): a grammar names such a token by id, since it is no text
        to spell. llguidance holds as special every added token marked so, and every added
        token of the form <...> (Qwen's <tool_call>, say)."""
        for token_id, added in self._tok.get_added_tokens_decoder().items():
            if added.content == text and (added.special or (text.startswith("<") and text.endswith(">"))):
                return int(token_id)
        return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _check_vocabulary(tok, info: TokenizerInfo, name: str) -> None:
    """A tokenizer.json that loads but cannot tokenize (an empty vocabulary encodes every text to
    no tokens) or that lacks the manifest's special tokens is a broken bundle, refused here
    rather than as an empty prompt or an index error deep in a backend."""
    size = tok.get_vocab_size(with_added_tokens=True)
    # added (special) tokens alone cannot tokenize text: every prompt would be just its BOS
    if tok.get_vocab_size(with_added_tokens=False) < 1:
        raise BundleError(f"the bundle's {name} has an empty vocabulary (only {size} added tokens); "
                          "export the bundle again")
    named = [("bos_token_id", info.bos_token_id)] if info.bos_token_id is not None else []
    named += [("stop_token_ids", i) for i in info.stop_token_ids]
    for field_name, i in named:
        if tok.id_to_token(i) is None:
            raise BundleError(f"the bundle's {name} has no token {i} (tokenizer.{field_name} in the manifest; "
                              f"its vocabulary holds {size}); export the bundle again")


class IncrementalDecoder:
    """Turns a growing list of ids into text deltas without splitting multi-byte characters:
    tokenizers' `DecodeStream`, which decodes a short window before the new ids and emits the
    difference, so merges, byte-fallback tokens and SentencePiece's leading spaces come out as a
    full decode writes them.

    DecodeStream refuses (raises) when a run of byte tokens that is not UTF-8 changes text it
    already emitted (a full decode renders such a run as one U+FFFD per byte, including bytes it
    emitted as characters before the run was cut): a model with random weights writes such runs.
    That step's text is then the window's difference in characters, and the stream starts again
    after it: no error in the middle of a reply, and no text repeated."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        # the window DecodeStream compares against: ids[_prefix:_read] is text already emitted
        self._prefix = self._read = 0
        self._stream = _decode_stream(self.tokenizer)

    def push(self, new_ids: Sequence[int]) -> str:
        if not new_ids:
            return ""
        self.ids.extend(new_ids)
        try:
            delta = self._stream.step(self.tokenizer.hf, list(new_ids))
        except Exception:  # noqa: BLE001 -- the binding raises a bare Exception ("Invalid prefix ...")
            # the window's difference, then a stream that takes everything so far as emitted
            delta = self._window_delta()
            self._stream = _decode_stream(self.tokenizer, self.ids[self._read:])
            self._prefix, self._read = self._read, len(self.ids)
            return delta
        if delta is None:  # held back: an incomplete character, or no text yet
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return delta

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end comes out as U+FFFD)."""
        delta = self._window_delta()
        self._prefix = self._read = len(self.ids)
        self._stream = _decode_stream(self.tokenizer)
        return delta

    def _window_delta(self) -> str:
        prefix_text = self.tokenizer.decode(self.ids[self._prefix : self._read])
        text = self.tokenizer.decode(self.ids[self._prefix :])
        return text[len(prefix_text) :]


def _decode_stream(tokenizer: Tokenizer, emitted: Sequence[int] = ()):
    """A DecodeStream that takes `emitted` as text already given out, the context of the next
    token's leading space. DecodeStream takes ids whose text ends in U+FFFD as not given out yet
    (it would write them again), so such ids are left out: only a leading space can differ then."""
    from tokenizers.decoders import DecodeStream

    if emitted and tokenizer.decode(emitted).endswith("\ufffd"):
        emitted = ()
    return DecodeStream(list(emitted) or None, skip_special_tokens=True)
