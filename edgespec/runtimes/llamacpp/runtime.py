"""llama.cpp backend (llama-cpp-python's low-level API) for GGUF models.

One `llama_decode` per forward: the batch marks the last `n_logits` positions as outputs,
so a verify pass returns logits for every drafted position at once. Rolling back removes
the tail of sequence 0 from llama.cpp's memory (`llama_memory_seq_rm`). Token ids are fed
directly: edgespec tokenizes and renders chat templates itself, so llama.cpp's own
tokenizer and chat formatting (its "llama-2" fallback for GGUFs without a template) are
never involved.

Exactness: built without llamafile and without repacked weights, a verify of up to 7 tokens
rounds bit for bit like one-token forwards on the CPUs measured so far; on some AVX2 CPUs 8+ rows
round apart by whole logits (not the thread count, not the KV dtype; cause not found; docs/exactness.md).
The engine does not assume either: its exactness probe (runtimes/exactness.py) measures the
widths and the decoder verifies within them.

A VocabTrim draft (exporters/gguf/export.py) is a GGUF whose vocabulary is the K kept
tokens; it is fed input *embeddings* through the batch's `embd` field, looked up here from
the full input embedding stored beside it, so its per-token head costs K rows, not V.
"""
from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ...checks import integer
from ...cpus import usable_cpu_count
from ...errors import BackendError, BundleError, ContextFullError
from ...models.gguf_layout import GGUFLayoutError, check_gguf_layout
from ..base import Capabilities, Runtime, Streamed

__all__ = ["LlamaCppRuntime", "available_devices", "load_library", "route_native_log", "system_info",
           "use_extra_buffer_types", "DEFAULT_KV_CAPACITY", "EMBD_KEYS", "EXTRA_BUFTS_ENV", "batch_variance"]

logger = logging.getLogger(__name__)
native_logger = logging.getLogger(__name__ + ".native")

DEFAULT_KV_CAPACITY = 4096
MAX_BATCH = 512  # tokens per llama_decode call; longer prompts are fed in chunks
# metadata the GGUF exporter writes into a VocabTrim draft (see exporters/gguf/export.py)
EMBD_KEYS = {"file": "edgespec.input_embedding.file", "tensor": "edgespec.input_embedding.tensor",
             "scale": "edgespec.input_embedding.scale"}
# "1" lets llama.cpp use extra weight buffer types (see use_extra_buffer_types)
EXTRA_BUFTS_ENV = "EDGESPEC_LLAMACPP_EXTRA_BUFTS"
EXACT_BUILD_HINT = ('CMAKE_ARGS="-DGGML_LLAMAFILE=OFF" pip install --no-cache-dir --force-reinstall '
                    '"llama-cpp-python==0.3.36"')

_init_lock = threading.Lock()
_state: dict = {}


def route_native_log(lib, log: logging.Logger):
    """Send llama.cpp's C log lines to `log` (shown only with -v); returns the ctypes callback,
    which the caller keeps alive as long as the library."""

    @lib.llama_log_callback
    def _log(level, text, _user):
        if log.isEnabledFor(logging.INFO):
            msg = text.decode("utf-8", "replace").rstrip()
            if msg:
                log.info("%s", msg)

    lib.llama_log_set(_log, ctypes.c_void_p(0))
    return _log


def load_library():
    """Import llama_cpp once: route its C logging to a Python logger, init the backend."""
    with _init_lock:
        if "lib" in _state:
            return _state["lib"]
        try:
            import llama_cpp as lib
        except ImportError as e:
            raise BackendError("llama-cpp-python is not installed: pip install 'edgespec[llamacpp]' "
                               "(compiles llama.cpp, see the README)") from e
        except OSError as e:  # the shared library failed to load
            raise BackendError(f"llama-cpp-python cannot load llama.cpp: {str(e).splitlines()[0]}") from e

        _state["log_cb"] = route_native_log(lib, native_logger)  # alive for the library's lifetime
        lib.llama_backend_init()
        _state["lib"] = lib
        return lib


def available_devices() -> list[str]:
    """CPU, plus GPU when this llama.cpp build offloads (Vulkan, Metal, CUDA, OpenCL...)."""
    lib = load_library()
    return ["CPU", "GPU"] if lib.llama_supports_gpu_offload() else ["CPU"]


def system_info() -> str:
    return load_library().llama_print_system_info().decode("utf-8", "replace")


def use_extra_buffer_types() -> bool:
    """Whether to let llama.cpp use extra weight buffer types (repacked and AMX matmuls).

    Off by default: the repacked kernels compute a one-token forward (gemv) and a multi-token
    one (gemm) differently, so verifying k drafts in one batch could round differently from
    plain decoding; and the AMX path crashes on multi-token batches (llama.cpp #20824).
    EDGESPEC_LLAMACPP_EXTRA_BUFTS=1 turns them on (faster Q4 decoding on some CPUs, not exact)."""
    return os.environ.get(EXTRA_BUFTS_ENV) == "1"


def batch_variance(extra_bufts: bool) -> str | None:
    """Why this build's multi-token forward may round differently from one-token forwards, or None.

    llamafile's sgemm (built in unless -DGGML_LLAMAFILE=OFF) serves only batches of 2+ tokens, so a
    verify pass and a decode step take different matmul kernels."""
    reasons = []
    if "LLAMAFILE = 1" in system_info():
        reasons.append("this llama.cpp build multiplies multi-token batches with llamafile's sgemm and single "
                       f"tokens with ggml's own kernels (reinstall with {EXACT_BUILD_HINT})")
    if extra_bufts:
        reasons.append(f"repacked weights use different kernels for one and several tokens ({EXTRA_BUFTS_ENV}=1)")
    return "; ".join(reasons) or None


def _threads(threads: int | None) -> int:
    return int(threads) if threads else usable_cpu_count()


def _chunks(n: int, cap: int, n_logits: int) -> list[tuple[int, int]]:
    """[start, end) spans of at most `cap` tokens, the last holding at least `n_logits`."""
    starts = list(range(0, n, cap))
    if len(starts) > 1 and n - starts[-1] < n_logits:
        starts[-1] = n - n_logits
    return list(zip(starts, starts[1:] + [n]))


def _embedding_scale(name: str, text: str | None) -> float:
    """The input embedding's scale a draft GGUF records (1 when it records none): a finite number
    > 0. A NaN or infinite scale would turn every drafted row into NaN and acceptance to 0 without
    a word; a zero or negative one is no embedding scale."""
    if text is None:
        return 1.0
    try:
        scale = float(text)
    except ValueError:
        scale = math.nan
    if not (math.isfinite(scale) and scale > 0):
        raise BackendError(f"{name}: its '{EMBD_KEYS['scale']}' must be a finite number > 0, got {text[:40]!r}; "
                           "export the bundle again")
    return scale


class _EmbeddingTable:
    """Rows of a (possibly quantized) GGUF tensor, dequantized on demand from a memory map."""

    def __init__(self, path: Path, tensor: str, scale: float) -> None:
        try:
            from gguf import GGUFReader
            from gguf.quants import dequantize
        except ImportError as e:
            raise BackendError("a VocabTrim GGUF draft needs the gguf package: pip install 'edgespec[llamacpp]'") from e
        if not path.is_file():
            raise BackendError(f"the draft's input embedding {path.name} is missing; export the bundle again")
        try:
            # bounds every count in the header by the file's size first: gguf-py would loop over a
            # hostile file's claimed 2^40 entries before failing
            check_gguf_layout(path)
        except GGUFLayoutError as e:
            raise BackendError(f"cannot read {path.name}: {e}") from None
        try:
            reader = GGUFReader(str(path))
        except Exception as e:  # gguf raises ValueError/struct errors on a bad file
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise BackendError(f"cannot read {path.name}: {reason}") from e
        t = next((t for t in reader.tensors if t.name == tensor), None)
        if t is None:
            raise BackendError(f"{path.name} has no tensor {tensor}")
        self._data, self._qtype, self._scale = t.data, t.tensor_type, np.float32(scale)
        self._dequantize = dequantize
        self.n_rows, self.n_embd = int(t.shape[-1]), int(t.shape[0])  # GGUF shapes are (cols, rows)
        self.nbytes = path.stat().st_size

    def rows(self, ids: Sequence[int]) -> np.ndarray:
        raw = self._data[np.asarray(ids, dtype=np.int64)]
        out = self._dequantize(raw, self._qtype).reshape(len(ids), self.n_embd).astype(np.float32)
        return out * self._scale if self._scale != 1 else out


class LlamaCppRuntime(Runtime):
    """One GGUF model in a llama.cpp context with a single sequence."""

    def __init__(self, model_path: str | os.PathLike, *, threads: int | None = None, device: str | None = None,
                 kv_capacity: int | None = None) -> None:
        lib = self._lib = load_library()
        path = Path(model_path)
        if not path.is_file():
            raise BackendError(f"GGUF model not found: {path}")
        gpu_layers = self._gpu_layers(lib, device)
        extra_bufts = self._load(lib, path, gpu_layers, threads, kv_capacity)
        self.capabilities = Capabilities(backend="llamacpp", can_trim=True, max_batch_tokens=MAX_BATCH,
                                         devices=tuple(available_devices()),
                                         batch_variance=batch_variance(extra_bufts) if gpu_layers == 0 else
                                         "GPU kernels are not checked for batch invariance",
                                         extra={"gpu_layers": gpu_layers, "kv_capacity": self.kv_capacity,
                                                "input_embeddings": self._embd is not None})

    # -- setup ---------------------------------------------------------------------------
    @staticmethod
    def _gpu_layers(lib, device: str | None) -> int:
        dev = (device or "").upper()
        gpu = bool(lib.llama_supports_gpu_offload())
        if dev in ("", "AUTO"):
            return -1 if gpu else 0  # -1: every layer on a GPU build
        if dev == "CPU":
            return 0
        if dev == "GPU" and gpu:
            return -1
        raise BackendError(f"llamacpp: device '{device}' is not available (available: "
                           f"{', '.join(available_devices())}; GPU needs a llama-cpp-python built with "
                           "Vulkan, Metal or CUDA)")

    def _load(self, lib, path: Path, gpu_layers: int, threads: int | None, kv_capacity: int | None,
              build: str = "llama.cpp") -> bool:
        """Load the model with `gpu_layers` offloaded and open its context (closing what was opened
        if that fails); returns whether repacked weight buffers are in use."""
        self._path = path  # both builds: what the roofline reads the tensors' sizes from
        self._check_header(path)
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = gpu_layers
        mparams.use_extra_bufts = extra_bufts = use_extra_buffer_types()
        self._model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._model:
            raise BackendError(f"{build} cannot load {path.name} (truncated or unsupported GGUF; run with -v "
                               "for llama.cpp's log)")
        self._ctx = None
        self._batch = None
        try:
            self._open(lib, path, threads, kv_capacity)
        except BaseException:
            self.close()
            raise
        return extra_bufts

    @staticmethod
    def _check_header(path: Path) -> None:
        with path.open("rb") as fh:
            if fh.read(4) != b"GGUF":
                raise BackendError(f"{path.name} is not a GGUF file (bad magic bytes)")

    def _open(self, lib, path: Path, threads: int | None, kv_capacity: int | None) -> None:
        n_train = lib.llama_model_n_ctx_train(self._model)
        if kv_capacity is not None:
            integer(kv_capacity, "kv_capacity", least=1, error=BackendError)
        cap = kv_capacity or min(DEFAULT_KV_CAPACITY, n_train if n_train > 0 else DEFAULT_KV_CAPACITY)
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = cap
        cparams.n_batch = cparams.n_ubatch = min(MAX_BATCH, cap)
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = _threads(threads)
        cparams.no_perf = True
        # a sliding-window cache reuses cells that left the window; after a rollback the
        # window reaches back into them, so keep a full-size cache (llama.cpp PR 13194)
        cparams.swa_full = True
        # no flash attention: its CPU kernel splits the KV of a one-token forward (>= 512 positions)
        # but not of a verify batch, so the two would round differently; for an fp32 model it
        # would also round Q and K to f16 (1e-3 logit errors). An fp32 model gets an fp32 cache.
        cparams.flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED
        self._kv_f32 = self._meta("general.file_type") == "0"
        if self._kv_f32:
            cparams.type_k = cparams.type_v = 0  # GGML_TYPE_F32
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise BackendError(f"llama.cpp cannot create a context for {path.name} (kv_capacity={cap}; "
                               "out of memory?)")
        self.kv_capacity = cap  # enforced as asked; llama.cpp pads its allocation (to 256)
        self._n_ctx = int(lib.llama_n_ctx(self._ctx))
        self._mem = lib.llama_get_memory(self._ctx)
        self._threads = cparams.n_threads
        vocab = lib.llama_model_get_vocab(self._model)
        self.vocab_size = int(lib.llama_vocab_n_tokens(vocab))
        self._n_embd = int(lib.llama_model_n_embd(self._model))
        self._embd = self._input_embedding(path)
        n = min(MAX_BATCH, cap)
        self._batch = lib.llama_batch_init(n, self._n_embd if self._embd is not None else 0, 1)
        self._batch_cap = n
        for i in range(n):  # every position belongs to sequence 0
            self._batch.n_seq_id[i] = 1
            self._batch.seq_id[i][0] = 0
        self._n_past = 0
        self._max_outputs = 1
        self._file_bytes = path.stat().st_size

    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = self._lib.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def _input_embedding(self, path: Path) -> _EmbeddingTable | None:
        name = self._meta(EMBD_KEYS["file"])
        if name is None:
            return None
        from ...bundle import inside_bundle

        # the name comes from the file: a hostile GGUF must not make us read outside the bundle
        try:
            inside_bundle(path.parent, name, "the draft's input embedding")
        except BundleError as e:
            raise BackendError(str(e)) from None
        table = _EmbeddingTable(path.parent / name, self._meta(EMBD_KEYS["tensor"]) or "token_embd.weight",
                                _embedding_scale(path.name, self._meta(EMBD_KEYS["scale"])))
        if table.n_embd != self._n_embd:
            raise BackendError(f"{name} has {table.n_embd}-wide embeddings, the model {self._n_embd}")
        return table

    def kernel_options(self) -> dict:
        # the same package version compiles to other kernels with other CMake flags
        return {**super().kernel_options(), "build": system_info(), "extra_bufts": use_extra_buffer_types()}

    # -- Runtime -------------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        return self._n_past

    def forward(self, token_ids: Sequence[int], n_logits: int = 1) -> np.ndarray:
        if not len(token_ids):
            raise ValueError("forward needs at least one token")
        ids = [int(t) for t in token_ids]
        n_logits = max(1, min(n_logits, len(ids)))
        if self._n_past + len(ids) > self.kv_capacity:
            raise ContextFullError(f"the context is full ({self._n_past} + {len(ids)} tokens > kv capacity "
                                   f"{self.kv_capacity}); start a new conversation or raise the capacity")
        limit = self._embd.n_rows if self._embd is not None else self.vocab_size
        if min(ids) < 0 or max(ids) >= limit:
            raise BackendError(f"token id out of range [0, {limit})")
        if n_logits > self._batch_cap:
            raise ValueError(f"n_logits must be <= {self._batch_cap}")
        self._max_outputs = max(self._max_outputs, n_logits)
        for start, end in _chunks(len(ids), self._batch_cap, n_logits):
            self._decode(ids[start:end], end - start - n_logits if end == len(ids) else end - start)
        ptr = self._lib.llama_get_logits(self._ctx)
        logits = np.ctypeslib.as_array(ptr, shape=(n_logits, self.vocab_size))
        return np.array(logits, dtype=np.float32)

    def _decode(self, chunk: list[int], out_from: int) -> None:
        b, n = self._batch, len(chunk)
        if self._embd is not None:
            rows = np.ascontiguousarray(self._embd.rows(chunk), dtype=np.float32)
            ctypes.memmove(b.embd, rows.ctypes.data, rows.nbytes)
        else:
            arr = np.asarray(chunk, dtype=np.int32)
            ctypes.memmove(b.token, arr.ctypes.data, arr.nbytes)
        pos = np.arange(self._n_past, self._n_past + n, dtype=np.int32)
        ctypes.memmove(b.pos, pos.ctypes.data, pos.nbytes)
        outs = (np.arange(n) >= out_from).astype(np.int8)
        ctypes.memmove(b.logits, outs.ctypes.data, outs.nbytes)
        b.n_tokens = n
        rc = self._lib.llama_decode(self._ctx, b)
        if rc == 1:  # llama.h: "could not find a KV slot for the batch", the context is full
            raise ContextFullError(f"the context is full: llama.cpp found no KV slot at position {self._n_past}")
        if rc != 0:
            # llama_decode leaves the memory as before the failed batch
            raise BackendError(f"llama_decode failed (code {rc}) at position {self._n_past}")
        self._n_past += n

    def trim(self, n_past: int) -> None:
        if n_past >= self._n_past:
            return
        n_past = max(0, n_past)
        if not self._lib.llama_memory_seq_rm(self._mem, 0, n_past, -1):
            raise BackendError("llama.cpp cannot roll this model's cache back (recurrent state)")
        self._n_past = n_past

    def reset(self) -> None:
        self._lib.llama_memory_clear(self._mem, True)
        self._n_past = 0

    def memory_bytes(self) -> dict[str, int]:
        lib = self._lib
        per_token = self._kv_bytes_per_token()
        out = {
            "weights": int(lib.llama_model_size(self._model)),
            "kv": per_token * self._n_ctx,  # llama.cpp allocates the whole cache up front
            "kv_used": per_token * self._n_past,
            "logits": 4 * self.vocab_size * self._max_outputs,  # llama.cpp grows it to the widest request
        }
        if self._embd is not None:
            out["input_embedding"] = self._embd.nbytes  # memory-mapped: resident only where read
        return out

    def streamed(self) -> Streamed | None:
        """Every tensor of the file but an input embedding that a separate output matrix leaves
        to row lookups; llama.cpp's graph size is not exposed."""
        try:
            from gguf import GGUFReader

            tensors = {t.name: int(t.n_bytes) for t in GGUFReader(self._path).tensors}
        except Exception as e:  # noqa: BLE001 - a roofline is a report: say nothing rather than fail
            logger.debug("no roofline figures for %s: %s", self._path.name, e)
            return None
        gathered = tensors.get("token_embd.weight", 0) if "output.weight" in tensors else 0
        return Streamed(sum(tensors.values()) - gathered)

    def _kv_bytes_per_token(self) -> int:
        """K and V per layer, f16 (llama.cpp's default) or f32 for fp32 models."""
        arch = self._meta("general.architecture") or ""
        kv_heads = int(self._lib.llama_model_n_head_kv(self._model))
        head = int(self._lib.llama_model_n_embd(self._model)) // max(1, int(self._lib.llama_model_n_head(self._model)))
        k = int(self._meta(f"{arch}.attention.key_length") or head)
        v = int(self._meta(f"{arch}.attention.value_length") or head)
        return int(self._lib.llama_model_n_layer(self._model)) * kv_heads * (k + v) * (4 if self._kv_f32 else 2)

    def close(self) -> None:
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        if getattr(self, "_batch", None) is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            lib.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            lib.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:  # a forgotten close() must not leak the model
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
