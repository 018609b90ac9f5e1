"""Opening a GGUF safely: its layout checked against its size first (models/gguf_layout.py),
then gguf-py's reader; metadata values read with one-line errors. A LazyTensor stands for a
tensor whose bytes stay in the file, for exports that copy GGUF tensors rather than read them."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import ExportError

__all__ = ["LazyTensor", "check_layout", "field", "lazy_tensor", "open_gguf"]


@dataclass(frozen=True)
class LazyTensor:
    """A GGUF tensor's name, type and shape (numpy order), its bytes left unread in the file, so a
    model of any block type can be described without decoding it. Indexing rows (read_gguf's
    q/k reordering, fused-weight splits) gives another LazyTensor of those rows' shape."""

    name: str
    qtype: int
    shape: tuple[int, ...]

    def __getitem__(self, rows) -> LazyTensor:
        n = len(np.arange(self.shape[0])[rows])
        return LazyTensor(self.name, self.qtype, (n, *self.shape[1:]))


def lazy_tensor(raw, qtype, shape: tuple[int, ...], name: str) -> LazyTensor:
    """read_gguf's `load` for a model whose weights are copied from the file, never decoded."""
    return LazyTensor(name, int(qtype), tuple(int(x) for x in shape))


def field(reader, key: str, default=None):
    """The value of metadata `key` (`default` when absent); text that is not UTF-8 is a one-line
    ExportError (gguf-py decodes strings only when asked for them)."""
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except UnicodeDecodeError:
        raise ExportError(f"the GGUF's '{key}' holds text that is not UTF-8") from None


def check_layout(path: Path) -> None:
    """Every count and size of the GGUF's header checked against the file's size (a one-line
    ExportError): gguf-py iterates whatever an array claims (2^40 entries: a hang) and trusts
    tensor sizes, so this runs before any reader opens the file."""
    from ...models.gguf_layout import GGUFLayoutError, check_gguf_layout

    try:
        check_gguf_layout(path)
    except GGUFLayoutError as e:
        raise ExportError(f"cannot read {path.name}: {e}") from None
    except (OSError, ValueError) as e:  # unreadable, or empty (mmap refuses a 0-byte file)
        raise ExportError(f"cannot read {path.name}: {getattr(e, 'strerror', None) or e}") from None


def open_gguf(path: Path):
    """A gguf.GGUFReader on `path` (open it once: it parses every metadata string)."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ExportError("reading a GGUF needs gguf-py: pip install 'edgespec[onnx]'") from e
    check_layout(path)
    try:
        return GGUFReader(str(path))
    except Exception as e:  # gguf-py raises ValueError/struct errors on a damaged file
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(f"cannot read {path.name}: {msg}") from e


