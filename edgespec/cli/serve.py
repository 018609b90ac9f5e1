"""`edgespec serve [BUNDLE]`: an OpenAI-compatible HTTP server (edgespec.server) on uvicorn."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import logging
import os
import socket
import sys

from .common import add_engine_args, cli_entry, engine_config_from_args, setup_logging

__all__ = ["main", "build_parser", "add_server_args", "server_config_from_args"]

logger = logging.getLogger(__name__)

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgespec serve",
                                description="Serve a bundle over an OpenAI-compatible HTTP API "
                                            "(/v1/chat/completions, /v1/completions, /v1/models, /health).")
    p.add_argument("bundle", nargs="?", default=None, help="bundle or .gguf file (default: the embedded Gemma 3 270M)")
    add_server_args(p)
    add_engine_args(p)
    return p


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The server flags, one per ServerConfig field that has one (edgespec.server.config.OPTIONS).
    Each defaults to None, "not given": ServerConfig's own default applies."""
    from ..server.config import OPTIONS

    g = p.add_argument_group("server")
    for name, opt in OPTIONS.items():
        g.add_argument(*opt.flags, dest=name, type=opt.type, default=None, metavar=opt.metavar,
                       help=opt.full_help())


def server_config_from_args(args: argparse.Namespace):
    """The ServerConfig of the parsed server flags (validated here, before any model loads); a
    flag not given falls back to its environment variable, then to the field's default."""
    from ..server.config import OPTIONS, ServerConfig

    given = {}
    for name, opt in OPTIONS.items():
        value = getattr(args, name)
        if value is None and opt.env is not None:
            value = os.environ.get(opt.env) or None
        if value is not None:
            given[name] = value
    return ServerConfig(**given)


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket, bound before the server starts, so the address printed is real
    (ServerConfig checked the port's range)."""
    from ..errors import ConfigError

    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ConfigError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(128)
    return sock


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _server(config, on_exit):
    """A uvicorn Server that tells the app when Ctrl-C (or SIGTERM) arrives, before it waits
    for the requests in flight."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            on_exit()
            super().handle_exit(sig, frame)

    return Server(config)


@contextlib.contextmanager
def _closing(engine, timeout_s: float):
    """Close the engine on the way out, waiting at most `timeout_s` for a generation stuck in
    a backend: stopping the server must not hang on the engine's lock."""
    try:
        yield engine
    finally:
        from ..errors import BusyError

        try:
            engine.close(timeout=timeout_s)
        except BusyError:
            logger.warning("a generation did not stop within %g s; exiting without closing the engine", timeout_s)


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def _announce(engine, cfg, sock: socket.socket) -> None:
    """What the user should know before the first request: the address, and any risk."""
    m = engine.bundle.manifest
    if m.base_model:
        from ..engine.session import chat_format_for

        print(f"note: a base model without a chat template; /v1/chat/completions chats through "
              f"{chat_format_for(m, engine.tokenizer).describe()}", file=sys.stderr)
    if not _is_loopback(cfg.host) and cfg.api_key is None:
        print(f"warning: listening on {cfg.host} without --api-key: anyone on the network can use it",
              file=sys.stderr)
    print(f"edgespec serve: {_url(sock)} (model {cfg.model_id}{', API key required' if cfg.api_key else ''}); "
          "Ctrl-C stops", flush=True)


@cli_entry
def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    from ..errors import ConfigError

    try:
        import uvicorn

        from ..server import begin_shutdown, create_app, http_protocol
    except ImportError as e:
        raise ConfigError(f"edgespec serve needs {e.name}: pip install 'edgespec[serve]'") from None
    # fails fast, before a model is loaded: the engine's options and the server's
    engine_cfg = engine_config_from_args(args)
    cfg = server_config_from_args(args)
    sock = _listen(cfg.host, cfg.port)
    try:
        from ..engine.engine import load

        with _closing(load(args.bundle, engine_cfg), cfg.shutdown_timeout_s) as engine:
            if args.model_id is None:
                cfg = dataclasses.replace(cfg, model_id=engine.bundle.path.name)
            app = create_app(engine, cfg)
            _announce(engine, cfg, sock)
            level = "warning" if args.verbose == 0 else "info" if args.verbose == 1 else "debug"
            # the client time limit covers a request's head too (a slowloris client), not only its body
            server = _server(uvicorn.Config(app, http=http_protocol(cfg.client_timeout_s), log_level=level,
                                            access_log=args.verbose > 0, timeout_graceful_shutdown=5),
                             on_exit=lambda: begin_shutdown(app))
            try:
                server.run(sockets=[sock])
            except KeyboardInterrupt:  # uvicorn shuts down gracefully, then re-raises Ctrl-C
                pass
            print("edgespec serve: stopped", file=sys.stderr)
    finally:
        sock.close()
    return 0
