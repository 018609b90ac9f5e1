"""What a caller of the Python API passes, checked before anything runs: a plain mistake (a number
where text goes, a lone surrogate, a stop string that is not a string) is a ConfigError naming
the argument, never an exception from deep inside the tokenizer or the decoder."""
from __future__ import annotations

from collections.abc import Sequence

from ..checks import is_int
from ..errors import ConfigError

__all__ = ["check_text", "check_stop", "check_token_ids"]


def check_text(value: object, name: str, *, argv: bool = False) -> str:
    """`value` if it is text that encodes as UTF-8, else a one-line ConfigError naming `name`.
    `argv`: the text came from the command line, where Python keeps a byte that was not UTF-8 as
    a lone surrogate U+DC80..U+DCFF; the error then names the byte the user gave."""
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be text (str), got {type(value).__name__}")
    if not value.isascii():
        try:  # a lone surrogate (from a bad byte in argv or a JSON escape) is not text
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            if argv:
                what = _escaped(value[e.start])
                raise ConfigError(f"{name} is not UTF-8 text ({what} at offset {e.start})") from None
            raise ConfigError(f"{name} is not valid Unicode text (a lone surrogate at offset {e.start})") from None
    return value


def _escaped(char: str) -> str:
    """What an unencodable character of argv stands for: the byte surrogateescape kept, else itself."""
    code = ord(char)
    return f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"


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
