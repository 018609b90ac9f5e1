"""Opening a GGUF safely: its layout checked against its size first (models/gguf_layout.py),
then gguf-py's reader; metadata values read with one-line errors."""
from __future__ import annotations

from pathlib import Path

from ...errors import ExportError

__all__ = ["check_layout", "open_gguf", "field"]


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


