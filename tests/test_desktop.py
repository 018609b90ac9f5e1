"""The desktop chat example (examples/desktop_chat.py) runs offscreen on a tiny bundle: a message
sent through the window gets a streamed reply, Stop ends a long reply, and the conversation
survives for the next message."""
from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("PySide6.QtWidgets", reason="the desktop example needs PySide6 (pip install 'edgespec[desktop]')")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # no display needed

from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtTest import QTest  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from edgespec.engine.engine import load  # noqa: E402
from tests.zoo import DISAGREEING  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "desktop_chat.py"


@pytest.fixture(scope="module")
def desktop():
    spec = importlib.util.spec_from_file_location("desktop_chat", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def window(zoo, desktop, monkeypatch):
    app = QApplication.instance() or QApplication([])
    with load(zoo.bundle("qwen2", DISAGREEING), k=3, drafter="model") as engine:
        w = desktop.ChatWindow(engine, max_tokens=12)
        w.show()
        yield w
        w.close()
    app.processEvents()


def wait_until(predicate, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the window"
        QTest.qWait(10)  # runs the Qt event loop, which delivers the worker's signals


def type_and_send(w, text: str) -> None:
    QTest.keyClicks(w.input, text)
    QTest.mouseClick(w.send_button, Qt.MouseButton.LeftButton)


def test_a_message_gets_a_streamed_reply(window):
    deltas: list[str] = []
    window.signals.delta.connect(deltas.append)
    type_and_send(window, "hello world")
    assert window.busy and window.stop_button.isEnabled() and not window.send_button.isEnabled()
    wait_until(lambda: not window.busy)
    reply = window.session.messages[-1]
    assert reply["role"] == "assistant" and reply["content"] and "".join(deltas) == reply["content"]
    shown = window.transcript.toPlainText()
    assert "You: hello world" in shown and ("Model: " + reply["content"]) in shown
    assert window.last_reason == "length" and "tok/s" in window.status.text()
    assert window.send_button.isEnabled() and not window.stop_button.isEnabled()


def test_stop_ends_a_long_reply_and_the_conversation_survives(window, monkeypatch):
    forward = window.engine.target.forward

    def slow(token_ids, n_logits=1):  # a reply of 400 tokens now takes seconds
        time.sleep(0.01)
        return forward(token_ids, n_logits)

    monkeypatch.setattr(window.engine.target, "forward", slow)
    window.max_tokens = 400
    def press_stop(_):
        window.stop_button.click()

    window.signals.delta.connect(press_stop)  # Stop at the first text
    type_and_send(window, "tell me a long story")
    wait_until(lambda: not window.busy)
    assert window.last_reason == "cancelled" and "[stopped]" in window.transcript.toPlainText()
    partial = window.session.messages[-1]
    assert partial["role"] == "assistant" and partial["content"]
    assert window.session.turn_stats[-1].new_tokens < 400
    # the next message continues the same conversation
    window.signals.delta.disconnect(press_stop)
    window.max_tokens = 6
    type_and_send(window, "and then")
    wait_until(lambda: not window.busy)
    roles = [m["role"] for m in window.session.messages]
    assert roles == ["user", "assistant", "user", "assistant"] and window.last_reason == "length"
    assert window.session.messages[1] == partial
    last_reply = "Model: " + window.session.messages[-1]["content"]
    assert window.transcript.toPlainText().rstrip().endswith(last_reply.rstrip())
