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

__all__ = ["main", "build_parser"]

logger = logging.getLogger(__name__)

API_KEY_ENV = "EDGESPEC_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgespec serve",
                                description="Serve a bundle over an OpenAI-compatible HTTP API "
                                            "(/v1/chat/completions, /v1/completions, /v1/models, /health).")
    p.add_argument("bundle", nargs="?", default=None, help="bundle or .gguf file (default: the embedded Gemma 3 270M)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 opens it to the network)")
    g.add_argument("--port", type=int, default=8080, help="port (default: 8080; 0 picks a free one)")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV} if set, else no key)")
    g.add_argument("--model-name", default=None,
                   help="model id reported by /v1/models (default: the bundle's folder name)")
    g.add_argument("--max-queue", type=int, default=64, help="requests that may wait for the engine (default: 64)")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="reply length for chat requests that give no max_tokens (default: 512, or the cap if lower)")
    g.add_argument("--max-tokens-cap", type=int, default=4096,
                   help="most new tokens a request may ask for; more is a 400 (default: 4096)")
    g.add_argument("--max-request-size", default="1MiB", metavar="SIZE",
                   help="largest request body, e.g. 256KB or 4MiB; larger is a 413 (default: 1MiB)")
    g.add_argument("--client-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a client may take to send its request, or to take each part of a reply "
                        "(default: 30)")
    g.add_argument("--template-timeout", type=float, default=5.0, metavar="S",
                   help="seconds a chat prompt may take to render; a slower chat template is stopped (default: 5)")
    add_engine_args(p)
    return p


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket, bound before the server starts, so the address printed is real."""
    from ..errors import ConfigError

    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be 0..65535, got {port}")
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


@cli_entry
def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    from ..errors import ConfigError

    try:
        import uvicorn

        from ..server import ServerConfig, begin_shutdown, create_app
    except ImportError as e:
        raise ConfigError(f"edgespec serve needs {e.name}: pip install 'edgespec[serve]'") from None
    from ..memory import parse_bytes

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    try:
        max_request = parse_bytes(args.max_request_size)
    except ConfigError:
        raise ConfigError(f"--max-request-size must be a size like 256KB or 4MiB, got {args.max_request_size!r}") \
            from None
    # fails fast, before a model is loaded: the engine's options and the server's
    engine_cfg = engine_config_from_args(args)
    cfg = ServerConfig(model_id=args.model_name or "edgespec", api_key=api_key, max_queue=args.max_queue,
                       max_tokens=args.max_tokens if args.max_tokens is not None else min(512, args.max_tokens_cap),
                       max_tokens_cap=args.max_tokens_cap, max_request_bytes=max_request,
                       client_timeout_s=args.client_timeout, template_timeout_s=args.template_timeout)
    sock = _listen(args.host, args.port)
    try:
        from ..engine.engine import load

        with _closing(load(args.bundle, engine_cfg), cfg.shutdown_timeout_s) as engine:
            cfg = dataclasses.replace(cfg, model_id=args.model_name or engine.bundle.path.name)
            app = create_app(engine, cfg)
            m = engine.bundle.manifest
            if m.base_model:
                from ..engine.session import chat_format_for

                print(f"note: a base model without a chat template; /v1/chat/completions chats through "
                      f"{chat_format_for(m, engine.tokenizer).describe()}", file=sys.stderr)
            if not _is_loopback(args.host) and api_key is None:
                print(f"warning: listening on {args.host} without --api-key: anyone on the network can use it",
                      file=sys.stderr)
            print(f"edgespec serve: {_url(sock)} (model {cfg.model_id}{', API key required' if api_key else ''}); "
                  "Ctrl-C stops", flush=True)
            level = "warning" if args.verbose == 0 else "info" if args.verbose == 1 else "debug"
            server = _server(uvicorn.Config(app, log_level=level, access_log=args.verbose > 0,
                                            timeout_graceful_shutdown=5), on_exit=lambda: begin_shutdown(app))
            try:
                server.run(sockets=[sock])
            except KeyboardInterrupt:  # uvicorn shuts down gracefully, then re-raises Ctrl-C
                pass
            print("edgespec serve: stopped", file=sys.stderr)
    finally:
        sock.close()
    return 0
