"""Load a source model offline: a GGUF file with gguf-py and numpy (no torch), a Hugging Face
folder with transformers (the `export` extra)."""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ExportError
from ..files import path_problem

__all__ = ["Source", "check_source", "load_source", "load_with_transformers", "sha256_of"]

logger = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".bin")


@dataclass
class Source:
    """A loaded model and tokenizer plus where they came from."""

    model: Any  # transformers PreTrainedModel, or gguf/source.GGUFModel for a GGUF read by gguf-py
    tokenizer: Any  # transformers PreTrainedTokenizerBase, or gguf/tokenizer.GGUFTokenizer
    kind: str  # "hf" or "gguf"
    path: Path
    sha256: str
    # a GGUF described, its tensors left in the file (gguf/reader.LazyTensor): for exports that copy
    # GGUF blocks as they are (the GGUF format), whatever their type
    lazy: bool = False

    def describe(self) -> dict[str, str]:
        return {"kind": self.kind, "name": self.path.name, "sha256": self.sha256}


def sha256_of(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def check_source(path: Path) -> str:
    """"hf" or "gguf" for a usable source path; a one-line ExportError otherwise."""
    problem = path_problem(path)
    if problem == "missing":
        raise ExportError(f"model path not found: {path}")
    if problem is not None:  # a FIFO would block the reads below, /dev/zero never end them
        raise ExportError(f"{path} is {problem}, not a model (give a Hugging Face model folder or a .gguf file)")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ExportError(f"{path} is neither a Hugging Face model folder nor a .gguf file")
        with path.open("rb") as fh:
            if fh.read(4) != b"GGUF":
                raise ExportError(f"{path} is not a GGUF file (bad magic bytes)")
        return "gguf"
    if not (path / "config.json").is_file():
        raise ExportError(f"{path} is not a Hugging Face model folder (no config.json)")
    if not any(p.suffix in _WEIGHT_SUFFIXES for p in path.iterdir()):
        raise ExportError(f"{path} has a config.json but no weights (*.safetensors or *.bin)")
    return "hf"


def load_source(path: str | os.PathLike, lazy: bool = False) -> Source:
    """Load `path`; every failure is a one-line ExportError. A GGUF keeps its quantized blocks
    (read with gguf-py, no torch), or with `lazy` only their names, types and shapes (nothing
    decoded: any block type); a Hugging Face folder loads in float32 with transformers."""
    path = Path(path).expanduser().resolve()
    kind = check_source(path)
    if kind == "gguf":
        return _load_gguf(path, lazy)
    return load_with_transformers(path)


def _load_gguf(path: Path, lazy: bool) -> Source:
    from .gguf.reader import lazy_tensor
    from .gguf.source import open_gguf, read_gguf
    from .gguf.tokenizer import GGUFTokenizer

    reader = open_gguf(path)
    model = read_gguf(path, reader, load=lazy_tensor) if lazy else read_gguf(path, reader)
    tokenizer = GGUFTokenizer(reader)
    return Source(model=model, tokenizer=tokenizer, kind="gguf", path=path, sha256=sha256_of([path]), lazy=lazy)


def load_with_transformers(path: str | os.PathLike) -> Source:
    """Load `path` (a folder, or a GGUF dequantized by transformers) in float32 with transformers."""
    path = Path(path).expanduser().resolve()
    kind = check_source(path)
    try:
        import torch  # noqa: F401 - fail early with the install hint
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ExportError("exporting needs the export extra: pip install 'edgespec[export]'") from e
    if kind == "gguf":
        from .gguf.reader import check_layout

        check_layout(path)  # before transformers' GGUF reader trusts its counts
        folder, extra = path.parent, {"gguf_file": path.name}
        files = [path]
    else:
        folder, extra = path, {}
        files = [p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES or p.name == "config.json"]
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **extra)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32", local_files_only=True, **extra)
    except Exception as e:  # transformers raises many types (OSError, ValueError, struct errors...)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(f"cannot load {path}: {msg}") from e
    model.eval()
    return Source(model=model, tokenizer=tokenizer, kind=kind, path=path, sha256=sha256_of(files))
