"""What the server adds to an engine: one frozen value, validated when it is built.

    cfg = ServerConfig(model_id="my-model", api_key="secret", max_tokens_cap=1024)

Each field that `edgespec serve` exposes carries its flag, help text and metavar (an `Option`
in `OPTIONS`); the CLI generates its server flags from that table alone, and a bad value is a
ConfigError naming the field and its flag. Importing this module needs neither FastAPI nor
uvicorn, so `edgespec serve --help` works without the `serve` extra.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..checks import integer, is_int, number
from ..errors import ConfigError

__all__ = ["ServerConfig", "Option", "OPTIONS", "API_KEY_ENV", "DEFAULT_CHAT_MAX_TOKENS"]

API_KEY_ENV = "EDGESPEC_API_KEY"
# a chat reply without max_tokens stops here (or at the cap, if that is lower)
DEFAULT_CHAT_MAX_TOKENS = 512


@dataclass(frozen=True)
class Option:
    """How one ServerConfig field appears on the command line."""

    flags: tuple[str, ...]
    help: str
    type: Any = str
    metavar: str | None = None
    env: str | None = None  # an environment variable read when the flag is not given
    default_text: str | None = None  # the default as the help shows it (None: the field's default)
    default: Any = None  # filled in from the field

    def full_help(self) -> str:
        """The help text with the default appended, as argparse shows it."""
        if self.default_text is not None:
            shown = self.default_text
        else:
            shown = f"{self.default:g}" if isinstance(self.default, float) else str(self.default)
        return f"{self.help} (default: {shown})"


def _opt(*flags: str, help: str, **kw) -> dict:
    return {"cli": Option(flags, help, **kw)}


@dataclass(frozen=True)
class ServerConfig:
    """The server's settings; `max_tokens` None is DEFAULT_CHAT_MAX_TOKENS or the cap if lower,
    `max_request_bytes` may be given as a size such as "256KB" (stored in bytes)."""

    model_id: str = field(default="edgespec", metadata=_opt(
        "--model-name", metavar="ID", help="model id reported by /v1/models", default_text="the bundle's folder name"))
    host: str = field(default="127.0.0.1", metadata=_opt(
        "--host", help="address to listen on; 0.0.0.0 opens it to the network",
        default_text="127.0.0.1, this machine only"))
    port: int = field(default=8080, metadata=_opt("--port", type=int, help="port (0 picks a free one)"))
    # a key read from a file or an env var often ends in a newline: stripped here, once; the
    # header a client sends must then match exactly (guard.py)
    api_key: str | None = field(default=None, metadata=_opt(
        "--api-key", env=API_KEY_ENV, metavar="KEY", help="require 'Authorization: Bearer KEY' on /v1",
        default_text=f"${API_KEY_ENV} if set, else no key"))
    max_queue: int = field(default=64, metadata=_opt(
        "--max-queue", type=int, metavar="N", help="requests that may wait for the engine; more get a 503"))
    max_tokens: int | None = field(default=None, metadata=_opt(
        "--max-tokens", type=int, metavar="N", help="reply length for chat requests that give no max_tokens",
        default_text=f"{DEFAULT_CHAT_MAX_TOKENS}, or the cap if lower"))
    max_tokens_cap: int = field(default=4096, metadata=_opt(
        "--max-tokens-cap", type=int, metavar="N", help="most new tokens a request may ask for; more is a 400"))
    max_request_bytes: int = field(default=1 << 20, metadata=_opt(
        "--max-request-size", metavar="SIZE", help="largest request body, e.g. 256KB or 4MiB; larger is a 413",
        default_text="1MiB"))  # far more than the text of a full context
    client_timeout_s: float = field(default=30.0, metadata=_opt(
        "--client-timeout", type=float, metavar="S",
        help="seconds a client may take to send its request's headers, then its body, or to take each part "
             "of a reply"))
    template_timeout_s: float = field(default=5.0, metadata=_opt(
        "--template-timeout", type=float, metavar="S",
        help="seconds a chat prompt may take to render; a slower chat template is stopped"))
    shutdown_timeout_s: float = 10.0  # for the running generation to stop when the server stops
    disconnect_poll_s: float = 0.25  # how often a non-streamed request checks for its client

    def __post_init__(self) -> None:
        _check_text(self)
        if not is_int(self.max_request_bytes):
            object.__setattr__(self, "max_request_bytes", _parse_size(self.max_request_bytes))
        _check_ints(self)
        if self.max_tokens is None:
            object.__setattr__(self, "max_tokens", min(DEFAULT_CHAT_MAX_TOKENS, self.max_tokens_cap))
        if self.max_tokens > self.max_tokens_cap:
            raise ConfigError(f"max_tokens (--max-tokens, {self.max_tokens}) must not exceed max_tokens_cap "
                              f"(--max-tokens-cap, {self.max_tokens_cap})")
        _check_seconds(self)


def _name(name: str) -> str:
    """A field as an error message names it: with its flag, where it has one."""
    opt = OPTIONS.get(name)
    return f"{name} ({opt.flags[0]})" if opt is not None else name


def _check_text(cfg: ServerConfig) -> None:
    if not isinstance(cfg.model_id, str) or not cfg.model_id:
        raise ConfigError("the model id must not be empty")
    if not isinstance(cfg.host, str) or not cfg.host.strip():
        raise ConfigError(f"{_name('host')} must be an address such as 127.0.0.1, got {cfg.host!r}")
    if cfg.api_key is None:
        return
    if not isinstance(cfg.api_key, str):
        raise ConfigError(f"the API key must be text, got {type(cfg.api_key).__name__}")
    object.__setattr__(cfg, "api_key", cfg.api_key.strip())
    if not cfg.api_key:
        raise ConfigError("the API key must not be empty")
    if not cfg.api_key.isprintable() or not cfg.api_key.isascii() or " " in cfg.api_key:
        raise ConfigError("the API key must be printable ASCII without spaces (it travels in an HTTP header)")


def _parse_size(value: object) -> int:
    from ..memory import parse_bytes

    try:
        return parse_bytes(value)  # type: ignore[arg-type]
    except ConfigError:
        raise ConfigError(f"{_name('max_request_bytes')} must be a size like 256KB or 4MiB, got {value!r}") from None


# integer fields and their bounds (least, most)
_INT_BOUNDS = {"port": (0, 65535), "max_queue": (1, None), "max_tokens": (1, None), "max_tokens_cap": (1, None),
               "max_request_bytes": (64, None)}
_SECONDS = ("client_timeout_s", "template_timeout_s", "shutdown_timeout_s", "disconnect_poll_s")


def _check_ints(cfg: ServerConfig) -> None:
    for name, (least, most) in _INT_BOUNDS.items():
        value = getattr(cfg, name)
        if not (name == "max_tokens" and value is None):
            integer(value, _name(name), least=least, most=most)


def _check_seconds(cfg: ServerConfig) -> None:
    for name in _SECONDS:
        number(getattr(cfg, name), _name(name), above=0)


# field name -> its command-line form (with the field's default); `edgespec serve` builds its
# server flags from this table alone
OPTIONS: dict[str, Option] = {f.name: dataclasses.replace(f.metadata["cli"], default=f.default)
                              for f in dataclasses.fields(ServerConfig) if "cli" in f.metadata}
