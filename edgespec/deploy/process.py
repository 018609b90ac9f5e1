"""llama.cpp's servers as child processes: `llama-server` started and waited on until it answers
`/health`, `rpc-server` workers until their port accepts, each stopped on `close()` (or at the end
of a `with` block). Their output goes to a log file whose last lines any start-up error quotes.

The child's environment drops llama.cpp's `LLAMA_ARG_*` variables: each is a flag in disguise (an
`LLAMA_ARG_SPEC_TYPE` left in a shell would change what a benchmark measures), and edgespec spells
out on the command line every flag it means.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from ..errors import DeployError

__all__ = ["free_port", "child_env", "ServerProcess", "RpcWorker", "http_json", "wait_for_port"]

logger = logging.getLogger(__name__)

ENV_PREFIX = "LLAMA_ARG_"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def child_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) without llama.cpp's LLAMA_ARG_* flags."""
    env = dict(os.environ if base is None else base)
    dropped = sorted(k for k in env if k.startswith(ENV_PREFIX))
    if dropped:
        logger.warning("not passing %s to llama.cpp: edgespec spells out its flags", ", ".join(dropped))
    return {k: v for k, v in env.items() if not k.startswith(ENV_PREFIX)}


def http_json(url: str, body: dict | None = None, timeout: float = 600.0) -> tuple[int, dict]:
    """GET (or POST `body` as JSON) and read a JSON answer: (status, document); an HTTP error
    status is returned with its body, a refused connection raises OSError."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            doc = json.loads(e.read() or b"{}")
        except ValueError:
            doc = {}
        return e.code, doc


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            time.sleep(0.1)
    return False


class _Child:
    """A child process whose output goes to a log file, stopped on close()."""

    what = "process"

    def __init__(self, argv: Sequence[str], *, log: Path | None = None) -> None:
        self.argv = [str(a) for a in argv]
        # a log of its own is removed on a clean close; one that a failure quotes stays
        self._own_log = log is None
        if log is None:
            fd, name = tempfile.mkstemp(prefix=f"edgespec-{Path(self.argv[0]).name}-", suffix=".log")
            os.close(fd)
            log = Path(name)
        self.log = log
        with self.log.open("wb") as sink:
            try:
                self.proc = subprocess.Popen(self.argv, stdout=sink, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=child_env())
            except OSError as e:
                raise DeployError(f"cannot start {self.argv[0]}: {e.strerror or e}") from None

    def last_line(self) -> str:
        """The log's last line that says something (an error, usually)."""
        try:
            lines = [ln.strip() for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1] if lines else ""

    def _failed(self, why: str) -> DeployError:
        self._own_log = False
        self.close()
        return DeployError(f"{self.what} {why}: {self.last_line() or 'no output'} (log: {self.log})")

    def close(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if getattr(self, "_own_log", False):
            self.log.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ServerProcess(_Child):
    """A running llama-server: `argv` must hold its --host and --port (`host`, `port` here); ready
    when /health answers 200 (the model loaded), else a DeployError quoting its log."""

    what = "llama-server"

    def __init__(self, argv: Sequence[str], *, host: str, port: int, timeout: float = 300.0,
                 log: Path | None = None) -> None:
        super().__init__(argv, log=log)
        self.url = f"http://{host}:{port}"
        self._wait_healthy(timeout)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._failed(f"exited with {self.proc.returncode} before it was ready")
            try:
                status, _ = http_json(self.url + "/health", timeout=5)
            except OSError:
                status = 0
            if status == 200:
                return
            time.sleep(0.2)
        raise self._failed(f"was not ready after {timeout:.0f} s")

    def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        """POST `body` to `path` and return the answer; an error status is a DeployError."""
        status, doc = http_json(self.url + path, body, timeout=timeout)
        if status != 200:
            err = doc.get("error", doc) if isinstance(doc, dict) else doc
            raise DeployError(f"llama-server {path} answered {status}: {err}")
        return doc


class RpcWorker(_Child):
    """A running rpc-server on `host:port` (llama.cpp's RPC backend worker), ready when the port accepts."""

    what = "rpc-server"

    def __init__(self, binary: str | Path, *, host: str = "127.0.0.1", port: int | None = None,
                 threads: int | None = None, timeout: float = 60.0, log: Path | None = None) -> None:
        self.host, self.port = host, port or free_port(host)
        argv = [str(binary), "--host", host, "--port", str(self.port)]
        if threads:
            argv += ["--threads", str(threads)]
        super().__init__(argv, log=log)
        if not wait_for_port(self.host, self.port, timeout):
            raise self._failed(f"did not listen on {self.address} within {timeout:.0f} s")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
