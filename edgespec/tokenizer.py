"""Runtime tokenizer: HF `tokenizers` + a sandboxed Jinja chat template, no transformers/torch."""
from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .bundle import TokenizerInfo
from .errors import BundleError, ConfigError

__all__ = ["Tokenizer", "IncrementalDecoder"]

logger = logging.getLogger(__name__)


def _raise(msg: str):
    raise ConfigError(f"chat template: {msg}")


class Tokenizer:
    """Encode/decode text and render chat messages the way the model was trained."""

    def __init__(self, path: Path, info: TokenizerInfo) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust binding raises a bare Exception on bad JSON
            raise BundleError(f"cannot read tokenizer {path.name}: {e}") from None
        self.info = info
        self.stop_ids = frozenset(info.stop_token_ids)

    @functools.cached_property
    def _template(self):
        """The chat template, compiled on first use: jinja2 and a compiled template hold ~6 MiB
        that a completion, a benchmark or a base model's transcript chat never needs."""
        if not self.info.chat_template:
            return None
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.info.chat_template)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.info.chat_template)

    def token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.info.add_bos and self.info.bos_token_id is not None:
            ids = [self.info.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ConfigError("this model has no chat template; use `edgespec generate` for plain completion")
        bos = self.token(self.info.bos_token_id) if self.info.bos_token_id is not None else ""
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=bos or "", eos_token="")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # the template writes BOS itself, as transformers' apply_chat_template does
        return self.encode(self.render_chat(messages), add_special_tokens=False)


@dataclass
class IncrementalDecoder:
    """Turns a growing list of ids into text deltas without splitting multi-byte characters.

    Decodes a short window before the new ids and emits the difference, so merges and
    byte-fallback tokens come out right (the approach of vLLM and TGI)."""

    tokenizer: Tokenizer
    ids: list[int] = field(default_factory=list)
    _prefix: int = 0
    _read: int = 0

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self.tokenizer.decode(self.ids[self._prefix : self._read])
        text = self.tokenizer.decode(self.ids[self._prefix :])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            delta = text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end comes out as U+FFFD)."""
        prefix_text = self.tokenizer.decode(self.ids[self._prefix : self._read])
        text = self.tokenizer.decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return text[len(prefix_text) :]
