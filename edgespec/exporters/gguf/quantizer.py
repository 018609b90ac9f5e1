"""llama.cpp's file types and quantizer, shared by the GGUF writer (export.py) and the passthrough of
GGUF sources (passthrough.py)."""
from __future__ import annotations

import ctypes
from pathlib import Path

from ...checks import is_int
from ...cpus import usable_cpu_count
from ...errors import ExportError

__all__ = ["EMBD_FILE", "LLAMA_FTYPES", "precision_of_gguf", "quantize"]

# edgespec precision -> (llama.cpp file type name, llama_ftype value); fp32/fp16 need no quantizer
LLAMA_FTYPES = {"fp32": ("F32", 0), "fp16": ("F16", 1), "int8": ("Q8_0", 7), "int4": ("Q4_K_M", 15)}
EMBD_FILE = "model.embd.gguf"


def precision_of_gguf(path: Path, reader=None) -> tuple[str | None, str]:
    """(edgespec precision or None, llama.cpp file type name) of a GGUF file (or its open reader:
    opening one parses every metadata string, ~1 s per 10k vocabulary entries)."""
    from gguf import LlamaFileType

    from .reader import field as _field
    from .reader import open_gguf

    ftype = _field(reader or open_gguf(path), "general.file_type")
    if ftype is None:
        return None, "unknown"
    if not is_int(ftype):  # the value's text cut short: a broken file may hold anything there
        raise ExportError(f"the GGUF's 'general.file_type' must be an integer, got {str(ftype)[:40]!r}")
    name = LlamaFileType(ftype).name.replace("MOSTLY_", "").replace("ALL_", "") if ftype in set(
        t.value for t in LlamaFileType) else str(ftype)
    return next((p for p, (_, v) in LLAMA_FTYPES.items() if v == ftype), None), name


# -- llama.cpp quantizer ------------------------------------------------------------------
def quantize(src: Path, dst: Path, ftype: int, threads: int | None = None, allow_requantize: bool = False) -> None:
    """llama.cpp's own quantizer (the llama-quantize tool's code path), file to file: it reads,
    converts and writes one tensor at a time. allow_requantize: `src` holds quantized tensors."""
    try:
        from ...runtimes.llamacpp.runtime import load_library
        lib = load_library()
    except Exception as e:  # BackendError (not installed) or a broken build
        raise ExportError(f"quantizing a GGUF needs llama-cpp-python: pip install 'edgespec[llamacpp]' ({e})") from e
    params = lib.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = allow_requantize
    params.nthread = threads or usable_cpu_count()
    rc = lib.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        dst.unlink(missing_ok=True)
        raise ExportError(f"llama.cpp could not quantize {src.name} (code {rc}; run with -v for its log)")
