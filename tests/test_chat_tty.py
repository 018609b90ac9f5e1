"""`edgespec chat` on a real terminal (a pty): Ctrl-C stops a reply and keeps the conversation."""
from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import time

import pytest

from tests.test_cli import CHATML
from tests.tiny import make_model

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs a pty")


def _own_terminal() -> None:
    """In the child: a new session whose controlling terminal is the pty, so Ctrl-C is SIGINT."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    # a shell starts background jobs (`cmd &`, as CI runners may) with SIGINT ignored, and the
    # child would inherit that: a user's terminal delivers Ctrl-C
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Terminal:
    """A child process on a pseudo-terminal, read with timeouts."""

    def __init__(self, args: list[str]) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, preexec_fn=_own_terminal)
        os.close(slave)
        self.buf = ""

    def read_until(self, needle: str, timeout: float = 120.0) -> str:
        end = time.monotonic() + timeout
        while needle not in self.buf:
            if time.monotonic() > end:
                raise AssertionError(f"timed out waiting for {needle!r}; screen so far:\n{self.buf[-2000:]}")
            ready, _, _ = select.select([self.master], [], [], 0.2)
            if ready:
                try:
                    self.buf += os.read(self.master, 4096).decode(errors="replace")
                except OSError:  # child closed the terminal
                    break
        head, _, self.buf = self.buf.partition(needle)
        return head

    def wait_for_output(self, n_chars: int, timeout: float = 120.0) -> None:
        """Wait until at least `n_chars` unread characters arrived (a reply is streaming)."""
        end = time.monotonic() + timeout
        while len(self.buf) < n_chars:
            if time.monotonic() > end:
                raise AssertionError(f"timed out waiting for output; screen so far:\n{self.buf[-2000:]}")
            ready, _, _ = select.select([self.master], [], [], 0.2)
            if ready:
                self.buf += os.read(self.master, 4096).decode(errors="replace")

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=60)
        finally:
            self.kill()

    def kill(self) -> None:
        """Never leave the child behind, even when an assertion failed mid-conversation."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.master >= 0:
            os.close(self.master)
            self.master = -1

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


@pytest.fixture(scope="module")
def chat_bundle(tmp_path_factory):
    from edgespec.exporters.export import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("tty")
    src = make_model("llama", root / "src", chat_template=CHATML)
    return export_bundle(ExportConfig(output=root / "bundle", target=src, draft_precision="int4"))


def test_ctrl_c_stops_reply_and_keeps_conversation(chat_bundle):
    with Terminal([sys.executable, "-m", "edgespec", "chat", str(chat_bundle), "--max-tokens", "100000"]) as term:
        term.read_until(">>> ")
        stopped, screens = False, []
        for attempt in range(6):  # a reply may end on its own before Ctrl-C lands: try another
            term.send(f"tell me a long story number {attempt}\r")
            term.read_until("\n")  # the echoed input line
            term.wait_for_output(8)  # the reply has started (a turn stopped before its first token is no turn)
            term.send("\x03")  # Ctrl-C, delivered by the terminal as SIGINT
            screen = term.read_until(">>> ")
            screens.append(screen[-300:])
            if "[stopped]" in screen:
                stopped = True
                break
        assert stopped, "Ctrl-C never interrupted a reply; screens:\n" + "\n---\n".join(screens)
        assert term.proc.poll() is None  # still running: the chat went on
        term.send("/stats\r")
        stats = term.read_until(">>> ")
        assert f"session: {attempt + 1} replies" in stats
        term.send("one more question\r")  # the conversation goes on; stop this reply too
        term.read_until("\n")
        term.wait_for_output(8)
        term.send("\x03")
        term.read_until(">>> ")
        term.send("\x04")  # Ctrl-D quits
        assert term.close() == 0
