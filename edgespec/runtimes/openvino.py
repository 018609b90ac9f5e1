"""OpenVINO Runtime backend (CPU, GPU, NPU, AUTO) for edgespec's OpenVINO IRs.

The IR has the buffer KV layout (exporters/onnx_graph.py, kv_layout="buffer"): it takes the past
KV, position ids and an attention mask, and returns logits plus only the new KV rows. Two ways to
hold the cache, from that one IR:

- buffer (the default): this runtime owns one numpy array per layer and K/V (slot j = position j),
  feeds the held prefix, writes the new rows after each forward, and rolls back by lowering its
  length. In the dynamic mode it is also the exact fast mode: every attention's keys are padded
  to whole blocks and its queries by one row (openvino_graph.pad_keys, pad_queries), so the CPU
  plugin's dynamic int8 quantization of activations stays on, decodes run one row, and a
  k-token verify still rounds bit for bit like k one-token decodes.
- state (`kv="state"`): the IR is made stateful (the past inputs become OpenVINO variables, as
  optimum-intel's stateful export does) and the plugin appends in place; a rollback writes the
  kept prefix back into each variable, 6-10 ms at 300 positions on Gemma 3 270M. The variables
  would keep padded keys, so activations stay f32 there.

Wide forwards (`wide=True`, the dynamic buffer mode on CPU): the CPU plugin prepares every node
again when a forward's width differs from the previous forward's: ~5 ms against a 16 ms one-token
decode of int4 Gemma 3 270M, the same bits either way. A speculative decoder alternates one-token
forwards (draft tokens, plain steps) with wider ones (verifies), so it would pay that twice per
step. With `wide`, the IR is compiled a second time and forwards of more than one token run there:
each compiled model mostly sees one width. The price is a second copy of the repacked weights
(`memory_bytes()["weights"]` counts it).

Static mode (NPUs need it; runs anywhere): the IR is reshaped at load time to a fixed KV capacity C
and a fixed width W (the verify width k+1). Every call feeds W tokens (padded), the whole buffer,
and a mask that admits the held positions and the real new tokens; rollback is the mask.
"""
from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..errors import BackendError, ContextFullError
from .base import Capabilities, Runtime
from .compile_cache import compile_cache_dir
from .openvino_graph import HIDDEN, cut_head, make_stateful, pad_keys, pad_queries, repacked_bytes

__all__ = ["OpenVinoRuntime", "available_devices", "DEFAULT_STATIC_CAPACITY", "KV_MODES",
           "OUTPUTS", "PRECISIONS", "check_device", "compile_model", "import_ov",
           "model_precision", "ov_reason", "read_ir", "DEFAULT_KV_CAPACITY"]

logger = logging.getLogger(__name__)

DEFAULT_STATIC_CAPACITY = 1024  # positions a static-shape model holds unless kv_capacity says otherwise
# the dynamic mode's limit unless kv_capacity says otherwise, as onnxruntime's and llama.cpp's:
# without one a 6000-token prompt ran (and took 6 GiB) where the other backends refuse it
DEFAULT_KV_CAPACITY = 4096
_FIRST_CAPACITY = 256  # the dynamic mode's first buffer; it doubles as the sequence grows
_VIRTUAL = ("AUTO", "HETERO", "MULTI")  # OpenVINO's meta devices, valid wherever a real one is
PRECISIONS = ("f32", "bf16", "f16")
KV_MODES = ("state", "buffer")
# what a forward returns: logits, or the final hidden rows the head would read (a body whose
# head runs apart, runtimes/shared_body.py)
OUTPUTS = ("logits", HIDDEN)
_INPUTS = ("input_ids", "position_ids", "attention_mask", "logits_index", "past_key_0")


def import_ov():
    try:
        import openvino as ov
    except ImportError as e:
        raise BackendError("OpenVINO is not installed: pip install 'edgespec[openvino]'") from e
    return ov


def available_devices() -> list[str]:
    """The devices OpenVINO sees here, e.g. ['CPU', 'GPU.0', 'NPU']."""
    return list(import_ov().Core().available_devices)


def check_device(device: str, available: list[str]) -> str:
    dev = device.upper()
    base = dev.split(":")[0]  # AUTO:GPU,CPU / HETERO:... name real devices after the colon
    names = set(available) | {a.split(".")[0] for a in available}
    wanted = [d.strip() for d in dev.split(":", 1)[1].split(",")] if ":" in dev and base in _VIRTUAL else [dev]
    if base not in _VIRTUAL and base.split(".")[0] not in names or any(
            w.split(".")[0] not in names for w in wanted if w not in _VIRTUAL):
        raise BackendError(f"OpenVINO: device '{device}' is not available (available: "
                           f"{', '.join([*available, 'AUTO'])})")
    return dev


def ov_reason(e: Exception) -> str:
    """OpenVINO's message on one line without its "Exception from src/...cpp:N:" lines, which
    say only where it was raised: the reason is on the lines after them."""
    lines = [ln.strip() for ln in str(e).splitlines()]
    lines = [ln for ln in lines if ln and not (ln.startswith("Exception from ") and ln.endswith(":"))]
    text = " ".join(lines) or type(e).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def read_ir(path: Path, device: str | None):
    """(core, model, device): the IR at `path`, read for `device` (default CPU), which must be one
    OpenVINO sees here."""
    if not path.is_file():
        raise BackendError(f"OpenVINO model not found: {path}")
    core = import_ov().Core()
    device = check_device(device or "CPU", list(core.available_devices))
    try:
        return core, core.read_model(str(path)), device
    except Exception as e:
        raise BackendError(f"cannot load {path.name}: {ov_reason(e)}") from e


def model_precision(model, device: str, asked: str | None, threads: int | None) -> str:
    """The inference precision: asked, else the IR's (the exporter writes f32), else f32."""
    prec = asked
    if prec is None and model.has_rt_info(["runtime_options", "INFERENCE_PRECISION_HINT"]):
        prec = str(model.get_rt_info(["runtime_options", "INFERENCE_PRECISION_HINT"])).lower()
    prec = prec if prec in PRECISIONS else "f32"
    # OpenVINO 2026.4's CPU plugin dies with SIGFPE compiling an fp32 IR for one thread in
    # bf16; a crash cannot be caught, so that combination runs in f32 instead
    if prec == "bf16" and threads == 1 and device.startswith("CPU"):
        logger.warning("OpenVINO: bf16 on one CPU thread crashes this OpenVINO build; using f32")
        prec = "f32"
    return prec


def compile_model(core, model, path: Path, device: str, precision: str, threads: int | None,
                  dynamic_quantization: bool):
    """`model` (read from `path`, perhaps rewritten) compiled for `device` as edgespec runs it."""
    config = {"PERFORMANCE_HINT": "LATENCY"}
    # in the user cache, not the bundle: a compiled blob is per device and OpenVINO version
    if (cache := compile_cache_dir(path, device)) is not None:
        config["CACHE_DIR"] = cache
    if device.split(":")[0].split(".")[0] in ("CPU", "GPU"):
        config["INFERENCE_PRECISION_HINT"] = precision
    if device.startswith("CPU") and not dynamic_quantization:
        # the CPU plugin quantizes activations to int8 on the fly for int8/int4 weights; one
        # ulp of difference upstream can cross a rounding step there, so it is batch-invariant
        # only with padded keys and queries (see openvino_graph.py)
        config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0
    if threads and device.startswith("CPU"):
        config["INFERENCE_NUM_THREADS"] = int(threads)
    try:
        return core.compile_model(model, device, config)
    except Exception as e:
        raise BackendError(f"OpenVINO could not compile {path.name} for {device}: {ov_reason(e)}") from e


class OpenVinoRuntime(Runtime):
    """One edgespec OpenVINO IR compiled for one device, with its KV cache (state or buffer).

    Forwards return logits, or with output="hidden" the final hidden rows the head would read:
    the IR's body alone, whose head runs apart (openvino_split.py)."""

    def __init__(self, model_path: str | os.PathLike, *, threads: int | None = None, device: str | None = None,
                 kv_capacity: int | None = None, static: bool = False, width: int | None = None,
                 precision: str | None = None, kv: str | None = None,
                 dynamic_quantization: bool | None = None, output: str = "logits", wide: bool = False,
                 pad_rows: bool = False) -> None:
        """wide: run forwards of more than one token on a second compiled copy (see the module
        docstring); only the dynamic buffer mode on CPU has one, elsewhere it is ignored.
        pad_rows: compute every forward one row wider and drop that row (the dynamic buffer mode
        only): the exact mode where one-row kernels round unlike taller ones, chosen by the
        exactness probe (runtimes/exactness.py); a decode then costs a two-row forward."""
        ov = import_ov()
        path = Path(model_path)
        if precision is not None and precision not in PRECISIONS:
            raise BackendError(f"OpenVINO: precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if kv_capacity is not None and kv_capacity < 1:
            raise BackendError(f"kv_capacity must be >= 1, got {kv_capacity}")
        if output not in OUTPUTS:
            raise BackendError(f"OpenVINO: output must be one of {', '.join(OUTPUTS)}, got {output!r}")
        core, model, device = read_ir(path, device)
        if device.startswith("NPU") and not static:
            logger.info("NPU compiles static shapes only: using the static-shape mode")
            static = True
        kv = kv or "buffer"
        if kv not in KV_MODES or (static and kv != "buffer"):
            raise BackendError(f"OpenVINO: kv must be one of {', '.join(KV_MODES)} ('buffer' with static shapes), "
                               f"got {kv!r}")
        names = {n for p in model.inputs for n in p.get_names()}
        if not set(_INPUTS) <= names:
            raise BackendError(f"{path.name} is not an edgespec OpenVINO IR (inputs: {', '.join(sorted(names)[:5])})")
        self._n_layers = sum(1 for n in names if n.startswith("past_key_"))
        past = model.input("past_key_0").get_partial_shape()  # (1, kvh, P, hd)
        self._kv_heads, self._head_dim = past[1].get_length(), past[3].get_length()
        vocab = model.output("logits").get_partial_shape()[2]
        if vocab.is_dynamic:
            raise BackendError(f"{path.name} is not an edgespec decoder IR (no fixed vocabulary size)")
        self.vocab_size = vocab.get_length()
        self._static = static
        self._width = max(int(width or 1), 1) if static else None
        cap = kv_capacity or (DEFAULT_STATIC_CAPACITY if static else DEFAULT_KV_CAPACITY)
        self._max_capacity = cap
        self._stateful = kv == "state"
        # the exact fast mode: keys padded to whole blocks, queries by a row (only the buffer
        # can leave padded keys out of the cache: OpenVINO's state would keep them)
        self._padded = not static and not self._stateful
        if self._padded:
            pad_keys(model)
            pad_queries(model)
        if self._stateful:
            make_stateful(model)
        if output == HIDDEN:
            cut_head(model)
        self.output = output
        if static:
            W, C = self._width, cap
            shapes = {"input_ids": [1, W], "position_ids": [1, W], "attention_mask": [1, C + W], "logits_index": [W]}
            shapes.update({f"past_{kind}_{j}": [1, self._kv_heads, C, self._head_dim]
                           for j in range(self._n_layers) for kind in ("key", "value")})
            model.reshape(shapes)
        self.precision = model_precision(model, device, precision, threads)
        if dynamic_quantization is None:
            dynamic_quantization = self._padded or self.precision != "f32"
        compile_ir = functools.partial(compile_model, core, model, path, device, self.precision, threads,
                                       dynamic_quantization)
        self._compiled = compile_ir()
        self._req = self._compiled.create_infer_request()
        self._wide_req, self._wide_bytes = None, 0
        # every forward one row wider (dynamic buffer mode only; see forward)
        self._pad_rows = pad_rows and self._padded
        if wide and self._padded and device.startswith("CPU"):  # the same model, compiled once more
            self._wide_req = compile_ir().create_infer_request()
            self._wide_bytes = repacked_bytes(model)
        self._tensor = ov.Tensor
        # inputs and outputs by index: binding by name costs ~0.5 ms per forward over 40 of them
        self._in = {n: i for i, p in enumerate(self._compiled.inputs) for n in p.get_names()}
        out = {n: i for i, p in enumerate(self._compiled.outputs) for n in p.get_names()}
        self._logits = out[output]
        self._new = [] if self._stateful else [(out[f"new_key_{j}"], out[f"new_value_{j}"])
                                               for j in range(self._n_layers)]
        self._weight_bytes = sum(p.stat().st_size for p in (path, path.with_suffix(".bin")) if p.is_file())
        self.device = device
        self._n_past = 0
        self._buf: list[np.ndarray] = []
        if not self._stateful:
            self._alloc(cap if static else min(cap or _FIRST_CAPACITY, _FIRST_CAPACITY))
        self.kv_bytes_per_token = 2 * self._n_layers * self._kv_heads * self._head_dim * 4
        self.kv_capacity = cap
        self.capabilities = Capabilities(
            backend="openvino", can_trim=True, static_shapes=static, max_batch_tokens=self._width,
            free_batch_tokens=self._width if static else 1,
            devices=(device,), batch_variance=self._batch_variance(device, dynamic_quantization),
            extra={"precision": self.precision, "kv_capacity": cap, "kv": kv,
                   "dynamic_quantization": dynamic_quantization, "wide": self._wide_req is not None,
                   "pad_rows": self._pad_rows})

    def _batch_variance(self, device: str, dynamic_quantization: bool) -> str | None:
        """Why a k-token forward may round unlike k one-token forwards (None: it does not, or only
        by float reassociation in f32, well below greedy near-ties: ~3e-5 on Gemma 3 270M logits)."""
        if not device.startswith("CPU"):
            return f"OpenVINO on {device} picks kernels by shape"
        if self.precision != "f32":
            return f"OpenVINO CPU computes in {self.precision}"
        if dynamic_quantization and not self._padded:
            return "OpenVINO CPU quantizes activations dynamically, and this KV holder cannot pad attention"
        return None

    # -- the KV buffer -------------------------------------------------------------------
    def _alloc(self, capacity: int) -> None:
        shape = (1, self._kv_heads, capacity, self._head_dim)
        old, n = self._buf, self._n_past
        self._buf = [np.zeros(shape, dtype=np.float32) for _ in range(2 * self._n_layers)]
        for new, prev in zip(self._buf, old):
            new[:, :, :n] = prev[:, :, :n]

    def _reserve(self, total: int) -> None:
        limit = self._max_capacity
        if limit is not None and total > limit:
            raise ContextFullError(f"the context is full: the KV cache holds at most {limit} positions "
                                   f"(kv_capacity); this sequence needs {total}")
        if self._stateful:
            return
        cap = self._buf[0].shape[2]
        if total > cap:
            grown = max(total, 2 * cap)
            self._alloc(min(grown, limit) if limit else grown)

    @property
    def n_past(self) -> int:
        return self._n_past

    def forward(self, token_ids: Sequence[int], n_logits: int = 1) -> np.ndarray:
        if not token_ids:
            raise ValueError("forward needs at least one token")
        S, n = len(token_ids), self._n_past
        n_logits = min(max(n_logits, 1), S)
        self._reserve(n + S)
        if self._static:
            feed = self._static_feed(token_ids)
        else:
            # pad_rows: the last token once more at the next position, its outputs dropped, so no
            # forward multiplies one row: on CPUs whose one-row FullyConnected kernel rounds unlike
            # the taller one (AVX2 with int8/int4 weights), a decode then rounds like a verify's rows
            fed = [*token_ids, token_ids[-1]] if self._pad_rows else token_ids
            feed = self._dynamic_feed(fed, n_logits, rows=S)
        req = self._wide_req if S > 1 and self._wide_req is not None else self._req
        try:
            for name, array in feed.items():  # shared, not copied: the arrays outlive the call
                req.set_input_tensor(self._in[name], self._tensor(array, shared_memory=True))
            req.infer()
        except Exception as e:
            if self._stateful:  # the variables must hold the sequence as before the call
                self._cut_state(n)
            raise BackendError(f"OpenVINO inference failed: {ov_reason(e)}") from e
        for j, (k, v) in enumerate(self._new):
            self._buf[2 * j][:, :, n:n + S] = req.get_output_tensor(k).data[:, :, :S]
            self._buf[2 * j + 1][:, :, n:n + S] = req.get_output_tensor(v).data[:, :, :S]
        logits = req.get_output_tensor(self._logits).data[0]
        self._n_past = n + S
        # static: one row per slot of the width, keep the real tokens' last n_logits; dynamic: the
        # requested rows. A view of the request's output, valid until the next forward (the
        # Runtime contract): no 1 MB copy per row
        logits = logits[S - n_logits:S] if self._static else logits[:n_logits]
        return logits if logits.dtype == np.float32 else logits.astype(np.float32)

    def _dynamic_feed(self, token_ids: Sequence[int], n_logits: int, rows: int) -> dict:
        """The inputs of a forward of `token_ids`, whose first `rows` are kept (the rest is padding)."""
        S, n = len(token_ids), self._n_past
        feed = {"input_ids": np.asarray([token_ids], dtype=np.int64),
                "position_ids": np.arange(n, n + S, dtype=np.int64)[None],
                "attention_mask": np.ones((1, n + S), dtype=np.int64),
                # a padded forward's head takes two rows where one is asked: its one-row kernel rounds apart too
                "logits_index": np.arange(rows - n_logits, rows + (S > rows and n_logits == 1), dtype=np.int64)}
        if self._stateful:  # the plugin holds the past
            return feed
        for j in range(self._n_layers):
            # with one KV head the prefix is contiguous and shared, else this copies it
            feed[f"past_key_{j}"] = np.ascontiguousarray(self._buf[2 * j][:, :, :n])
            feed[f"past_value_{j}"] = np.ascontiguousarray(self._buf[2 * j + 1][:, :, :n])
        return feed

    def _static_feed(self, token_ids: Sequence[int]) -> dict:
        S, n, W = len(token_ids), self._n_past, self._width
        if S > W:
            raise BackendError(f"OpenVINO static shapes take at most {W} tokens per forward, got {S}")
        C = self._buf[0].shape[2]
        ids = np.zeros((1, W), dtype=np.int64)
        ids[0, :S] = token_ids
        mask = np.zeros((1, C + W), dtype=np.int64)
        mask[0, :n] = 1  # rollback lives here: slots past n_past are simply not attended
        mask[0, C:C + S] = 1
        feed = {"input_ids": ids, "position_ids": np.arange(n, n + W, dtype=np.int64)[None],
                "attention_mask": mask, "logits_index": np.arange(W, dtype=np.int64)}
        for j in range(self._n_layers):
            feed[f"past_key_{j}"], feed[f"past_value_{j}"] = self._buf[2 * j], self._buf[2 * j + 1]
        return feed

    def trim(self, n_past: int) -> None:
        n_past = max(0, min(n_past, self._n_past))
        if self._stateful and n_past < self._n_past:
            self._cut_state(n_past)
        # a buffer keeps stale rows: dynamic calls pass only [:n_past], static ones mask the rest
        self._n_past = n_past

    def _cut_state(self, n: int) -> None:
        """Keep the first n positions in every variable (the plugin copies the prefix in)."""
        if n == 0:
            self._req.reset_state()
            return
        ov = import_ov()
        for st in self._req.query_state():
            shape = list(st.state.shape)
            if shape[2] > n:  # a view of the kept rows, not a copy of them
                st.state = ov.Tensor(st.state, [0] * len(shape), shape[:2] + [n] + shape[3:])

    def memory_bytes(self) -> dict[str, int]:
        weights = self._weight_bytes + self._wide_bytes
        if self._stateful:  # the plugin's variables hold exactly the sequence
            return {"weights": weights, "kv": self.kv_bytes_per_token * self._n_past}
        return {"weights": weights, "kv": sum(b.nbytes for b in self._buf)}

    def close(self) -> None:
        self._buf = []
        self._req = self._wide_req = None
        self._compiled = None
