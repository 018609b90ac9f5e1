"""A small desktop chat window on the edgespec Python API (PySide6).

    pip install 'edgespec[onnx,desktop]'
    python examples/desktop_chat.py [BUNDLE] [--system "You are terse."] [--max-tokens 512]

The model runs in-process. Each reply is generated in a worker thread and streamed into the
window through Qt signals (Qt queues them to the GUI thread), so the window never freezes;
Stop sets the reply's stop event, the engine ends the reply after its current step and
rewinds its caches, and the partial reply stays in the conversation.
"""
from __future__ import annotations

import argparse
import sys
import threading

from PySide6.QtCore import QObject, Qt, Signal, Slot
from PySide6.QtGui import QCloseEvent, QTextCursor
from PySide6.QtWidgets import (
    QApplication,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMainWindow,
    QPushButton,
    QTextEdit,
    QVBoxLayout,
    QWidget,
)

import edgespec

__all__ = ["ChatWindow", "main"]


class ReplySignals(QObject):
    """Emitted from the worker thread, delivered in the GUI thread."""

    delta = Signal(str)  # new text of the reply
    status = Signal(str)  # speed and memory line
    finished = Signal(str)  # finish reason: "stop", "length", "cancelled"
    failed = Signal(str)  # an error message


class ChatWindow(QMainWindow):
    def __init__(self, engine: edgespec.Engine, system: str | None = None, max_tokens: int = 512) -> None:
        super().__init__()
        self.engine, self.max_tokens = engine, max_tokens
        self.session = engine.chat(system=system)
        self.signals = ReplySignals()
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self.last_reason: str | None = None

        self.setWindowTitle(f"edgespec chat - {engine.bundle.path.name}")
        self.transcript = QTextEdit(readOnly=True)
        self.input = QLineEdit(placeholderText="Type a message and press Enter")
        self.send_button = QPushButton("Send")
        self.stop_button = QPushButton("Stop", enabled=False)
        self.reset_button = QPushButton("New chat")
        self.status = QLabel("ready")
        row = QHBoxLayout()
        for w in (self.input, self.send_button, self.stop_button, self.reset_button):
            row.addWidget(w)
        col = QVBoxLayout()
        col.addWidget(self.transcript)
        col.addLayout(row)
        col.addWidget(self.status)
        central = QWidget()
        central.setLayout(col)
        self.setCentralWidget(central)
        self.resize(720, 520)

        self.input.returnPressed.connect(self.send)
        self.send_button.clicked.connect(self.send)
        self.stop_button.clicked.connect(self._stop.set)
        self.reset_button.clicked.connect(self.reset)
        self.signals.delta.connect(self._on_delta, Qt.ConnectionType.QueuedConnection)
        self.signals.status.connect(self.status.setText, Qt.ConnectionType.QueuedConnection)
        self.signals.finished.connect(self._on_finished, Qt.ConnectionType.QueuedConnection)
        self.signals.failed.connect(self._on_failed, Qt.ConnectionType.QueuedConnection)

    @property
    def busy(self) -> bool:
        return self._worker is not None

    @Slot()
    def send(self) -> None:
        text = self.input.text().strip()
        if not text or self.busy:
            return
        self.input.clear()
        self._append(f"\nYou: {text}\nModel: ")
        self._stop.clear()
        self._set_busy(True)
        self._worker = threading.Thread(target=self._generate, args=(text,), daemon=True)
        self._worker.start()

    def _generate(self, text: str) -> None:
        """Worker thread: stream the reply into the window through signals."""
        reason = None
        try:
            for r in self.session.send(text, max_tokens=self.max_tokens, stop_event=self._stop):
                if r.text:
                    self.signals.delta.emit(r.text)
                self.signals.status.emit(f"{r.tokens_per_s:.1f} tok/s, {r.memory_bytes / 2**20:.0f} MiB")
                reason = r.finish_reason
        except edgespec.EdgespecError as e:  # e.g. BusyError when another window holds the engine
            self.signals.failed.emit(str(e))
            return
        except Exception as e:  # keep the window usable whatever happened
            self.signals.failed.emit(f"{type(e).__name__}: {e}")
            return
        self.signals.finished.emit(reason or "stop")

    @Slot(str)
    def _on_delta(self, text: str) -> None:
        self._append(text)

    @Slot(str)
    def _on_finished(self, reason: str) -> None:
        self.last_reason = reason
        if reason == "cancelled":
            self._append(" [stopped]")
        self._done()

    @Slot(str)
    def _on_failed(self, message: str) -> None:
        self._append(f"\n[error: {message}]")
        self._done()

    def _done(self) -> None:
        if self._worker is not None:
            self._worker.join()
            self._worker = None
        self._append("\n")
        self._set_busy(False)

    @Slot()
    def reset(self) -> None:
        if not self.busy:
            self.session.reset()
            self.transcript.clear()
            self.status.setText("new conversation")

    def _append(self, text: str) -> None:
        cursor = self.transcript.textCursor()
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertText(text)
        self.transcript.setTextCursor(cursor)
        self.transcript.ensureCursorVisible()

    def _set_busy(self, busy: bool) -> None:
        self.send_button.setEnabled(not busy)
        self.reset_button.setEnabled(not busy)
        self.stop_button.setEnabled(busy)
        self.input.setFocus()

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt's name
        self._stop.set()  # the reply ends after its current step
        if self._worker is not None:
            self._worker.join()
        super().closeEvent(event)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="edgespec desktop chat (PySide6)")
    p.add_argument("bundle", nargs="?", default=None, help="bundle folder (default: the embedded Gemma 3 270M)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=512)
    args = p.parse_args(argv)
    app = QApplication(sys.argv[:1])
    with edgespec.load(args.bundle) as engine:
        window = ChatWindow(engine, system=args.system, max_tokens=args.max_tokens)
        window.show()
        return app.exec()


if __name__ == "__main__":
    edgespec.share_threads()  # the app builds no onnxruntime sessions of its own (docs/api.md)
    sys.exit(main())
