"""What a caller of the Python API passes, checked before anything runs: a plain mistake (a number
where text goes, a lone surrogate, a stop string that is not a string) is a ConfigError naming
the argument, never an exception from deep inside the tokenizer or the decoder."""
from __future__ import annotations

from collections.abc import Sequence

from ..checks import is_int
from ..errors import ConfigError

__all__ = ["check_text", "check_stop", "check_token_ids"]


def check_text(value: object, name: str) -> str:
    """`value` if it is text that encodes as UTF-8, else a one-line ConfigError naming `name`."""
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be text (str), got {type(value).__name__}")
    if not value.isascii():
        try:  # a lone surrogate (from a bad byte in argv or a JSON escape) is not text
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ConfigError(f"{name} is not valid Unicode text (a lone surrogate at offset {e.start})") from None
    return value


def check_stop(stop: object) -> tuple[str, ...]:
    """Stop strings as a tuple: one string, or a sequence of non-empty strings."""
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, Sequence):
        raise ConfigError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    for i, s in enumerate(stop):
        check_text(s, f"stop[{i}]")
        if not s:
            raise ConfigError(f"stop[{i}] is empty; an empty stop string would end every reply at once")
    return tuple(stop)


def check_token_ids(tokens: Sequence[object], vocab: int) -> None:
    """Refuse a token id that is not an integer (True and 5.0 are other mistakes than 10**9) or is
    outside the vocabulary: a negative one would index from the embedding's end, a large one crash
    the backend."""
    for i, t in enumerate(tokens):
        if not is_int(t):
            raise ConfigError(f"token ids must be integers; the prompt's item {i} is {t!r} ({type(t).__name__})")
        if not 0 <= t < vocab:
            raise ConfigError(f"token id {t!r} is out of range (vocabulary size {vocab})")
