"""OpenVINO Runtime backend (CPU, GPU, NPU, AUTO) for edgespec's OpenVINO IRs.

`OpenVinoRuntime` compiles one IR for one device and runs its forwards; how the KV cache is held
is a holder of runtimes/openvino/kv.py, chosen once when the runtime is built (`plan_kv`): the dynamic
buffer by default (the exact fast mode, with padded attention and optionally padded rows), static
shapes where asked or on an NPU.

Wide forwards (`wide=True`, the dynamic buffer on CPU): the CPU plugin prepares every node again
when a forward's width differs from the previous forward's: a large share of a one-token decode
on a small model, the same bits either way. A speculative decoder alternates one-token
forwards (draft tokens, plain steps) with wider ones (verifies), so it would pay that twice per
step. With `wide`, the IR is compiled a second time and forwards of more than one token run there:
each compiled model mostly sees one width. The price is a second copy of the repacked weights
(`memory_bytes()["weights"]` counts it).

Sliding-window layers (an IR with the exporter's window record, kv.window_of): the dynamic buffer
binds their pasts from an aligned start, and a forward whose rows would start their windows in two
places runs as consecutive forwards cut where the start moves (kv.window_pieces), so each row rounds
as its position decoded alone. Their buffers are window-sized where that is smaller than the
capacity (kv.KVPlan.sliding_rows): forwards are cut at multiples of WINDOW_FORWARD as well, and a
trim further back than those buffers hold leaves n_past at 0, so the caller feeds the prefix again
(docs/long-context.md).
"""
from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ...checks import integer, one_of
from ...errors import BackendError
from ..base import Capabilities, Runtime, Streamed
from ..window import sliding_kv
from .compile_cache import compile_cache_dir
from .graph import HIDDEN, cut_head, repacked_bytes
from .kv import DEFAULT_KV_CAPACITY, DEFAULT_STATIC_CAPACITY, KV_KINDS, KVLayout, KVPlan, plan_kv, window_of

__all__ = ["OpenVinoRuntime", "available_devices", "DEFAULT_STATIC_CAPACITY", "KV_KINDS",
           "OUTPUTS", "PRECISIONS", "check_device", "compile_model", "import_ov",
           "model_precision", "ov_reason", "read_ir", "sliding_kv_of", "streamed_of", "DEFAULT_KV_CAPACITY"]

logger = logging.getLogger(__name__)

_VIRTUAL = ("AUTO", "HETERO", "MULTI")  # OpenVINO's meta devices, valid wherever a real one is
PRECISIONS = ("f32", "bf16", "f16")
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


def sliding_kv_of(path) -> tuple[float, int]:
    """KVPlan.sliding_kv of the IR at `path` as the dynamic buffer would hold it, read without
    compiling (the memory planner's estimate before loading): (0.0, 0) for none."""
    try:
        model = import_ov().Core().read_model(str(path))
    except Exception as e:  # OpenVINO raises plain exceptions: one line with the reason
        raise BackendError(f"cannot read {path}: {ov_reason(e)}") from e
    window = window_of(model)
    return sliding_kv(window, KVLayout.of(model).n_layers, window.rows(0) if window is not None else None)


def read_ir(path: Path, device: str | None):
    """(core, model, device): the IR at `path`, read for `device` (default CPU), which must be one
    OpenVINO sees here."""
    if not path.is_file():
        raise BackendError(f"OpenVINO model not found: {path}")
    if path.suffix == ".onnx":  # a draft head: its external data must stay inside its folder
        from ..onnxruntime.wire import read_model  # plain-Python ONNX reading; no onnxruntime import

        read_model(path)
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
        # only with padded keys and queries (see openvino/graph.py)
        config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0
    if threads and device.startswith("CPU"):
        config["INFERENCE_NUM_THREADS"] = int(threads)
    try:
        return core.compile_model(model, device, config)
    except Exception as e:
        raise BackendError(f"OpenVINO could not compile {path.name} for {device}: {ov_reason(e)}") from e


def _check_options(precision: str | None, kv_capacity: int | None, output: str) -> None:
    if precision is not None:
        one_of(precision, "OpenVINO: precision", PRECISIONS, error=BackendError)
    if kv_capacity is not None:
        integer(kv_capacity, "kv_capacity", least=1, error=BackendError)
    one_of(output, "OpenVINO: output", OUTPUTS, error=BackendError)


def _vocab_size(model, name: str) -> int:
    """The vocabulary of an edgespec decoder IR (a BackendError if `model` is not one)."""
    names = {n for p in model.inputs for n in p.get_names()}
    if not set(_INPUTS) <= names:
        raise BackendError(f"{name} is not an edgespec OpenVINO IR (inputs: {', '.join(sorted(names)[:5])})")
    vocab = model.output("logits").get_partial_shape()[2]
    if vocab.is_dynamic:
        raise BackendError(f"{name} is not an edgespec decoder IR (no fixed vocabulary size)")
    return vocab.get_length()


def batch_variance(device: str, precision: str, plan: KVPlan) -> str | None:
    """Why a k-token forward may round unlike k one-token forwards (None: it does not, or only
    by float reassociation in f32, well below greedy near-ties: ~3e-5 on Gemma 3 270M logits)."""
    if not device.startswith("CPU"):
        return f"OpenVINO on {device} picks kernels by shape"
    if precision != "f32":
        return f"OpenVINO CPU computes in {precision}"
    if plan.quantize and not plan.kind.padded:
        return "OpenVINO CPU quantizes activations dynamically, and this KV holder cannot pad attention"
    return None


def streamed_of(model, compiled) -> Streamed:
    """What one forward of the compiled `model` reads whole (its matrix weights: a table only
    Gathers read is read by rows) and the nodes the plugin runs."""
    return Streamed(repacked_bytes(model), len(compiled.get_runtime_model().get_ordered_ops()))


def _weight_bytes(path: Path, model, plan: KVPlan) -> int:
    """The IR's files, and the second compiled copy's repacked weights where forwards run wide."""
    files = sum(p.stat().st_size for p in (path, path.with_suffix(".bin")) if p.is_file())
    return files + (repacked_bytes(model) if plan.wide else 0)


def _capabilities(device: str, precision: str, plan: KVPlan) -> Capabilities:
    return Capabilities(
        backend="openvino", can_trim=True, static_shapes=plan.kind.static, max_batch_tokens=plan.width,
        free_batch_tokens=plan.width or 1, devices=(device,),
        batch_variance=batch_variance(device, precision, plan),
        extra={"precision": precision, "kv_capacity": plan.capacity, "kv": plan.kind.name,
               "dynamic_quantization": plan.quantize, "wide": plan.wide, "pad_rows": plan.pad_rows,
               "window": plan.window.size if plan.window else None})


class OpenVinoRuntime(Runtime):
    """One edgespec OpenVINO IR compiled for one device, with its KV holder (runtimes/openvino/kv.py).

    Forwards return logits, or with output="hidden" the final hidden rows the head would read:
    the IR's body alone, whose head runs apart (openvino/split.py)."""

    # the dynamic buffer commits memory as it fills (full-attention layers grow by doubling,
    # sliding layers hold their window), so an engine may give it the model's trained context by
    # default (engine/assembly.py); static shapes, fixed at their capacity, never get it
    lazy_kv = True

    def __init__(self, model_path: str | os.PathLike, *, threads: int | None = None, device: str | None = None,
                 kv_capacity: int | None = None, static: bool = False, width: int | None = None,
                 precision: str | None = None, kv: str | None = None, output: str = "logits",
                 wide: bool = False, pad_rows: bool = False) -> None:
        """static, width: fixed shapes, `width` tokens per forward (an NPU turns them on itself).
        kv: a name in KV_KINDS (default "buffer": the dynamic buffer, StaticKV with static shapes).
        wide: run forwards of more than one token on a second compiled copy (see
        the module docstring); only a dynamic holder on CPU has one, elsewhere it is ignored.
        pad_rows: compute every forward one row wider and drop that row (a dynamic holder only):
        the exact mode where one-row kernels round unlike taller ones, chosen by the exactness
        probe (runtimes/exactness.py); a decode then costs a two-row forward."""
        path = Path(model_path)
        _check_options(precision, kv_capacity, output)
        core, model, device = read_ir(path, device)
        self.vocab_size = _vocab_size(model, path.name)
        layout = KVLayout.of(model)
        self.precision = model_precision(model, device, precision, threads)
        if device.startswith("NPU") and not static:
            logger.info("NPU compiles static shapes only: using the static-shape mode")
        plan = plan_kv(device, self.precision, static=static, kv=kv, width=width, capacity=kv_capacity,
                       pad_rows=pad_rows, wide=wide, window=window_of(model))
        plan.kind.prepare(model, layout, plan)
        if output == HIDDEN:
            cut_head(model)
        compile_ir = functools.partial(compile_model, core, model, path, device, self.precision, threads,
                                       plan.quantize)
        self._compiled = compile_ir()
        self._req = self._compiled.create_infer_request()
        self._wide_req = compile_ir().create_infer_request() if plan.wide else None  # the same model once more
        # per request: input index -> (the holder's buffer, the Tensor set on it), see _bind
        self._bound: dict[int, tuple[np.ndarray, object]] = {}
        self._wide_bound: dict[int, tuple[np.ndarray, object]] = {}
        self._weight_bytes = _weight_bytes(path, model, plan)
        self.kv = plan.kind(layout, plan, self._req)
        self._streamed = streamed_of(model, self._compiled)
        self._tensor = import_ov().Tensor
        # inputs and outputs by index: binding dozens of them by name costs measurably more per forward
        self._in = {n: i for i, p in enumerate(self._compiled.inputs) for n in p.get_names()}
        out = {n: i for i, p in enumerate(self._compiled.outputs) for n in p.get_names()}
        self._logits = out[output]
        self._new = [(out[f"new_key_{j}"], out[f"new_value_{j}"]) for j in range(layout.n_layers)
                     ] if plan.kind.new_rows else []
        self.output, self.device = output, device
        self.kv_bytes_per_token, self.kv_capacity = layout.bytes_per_token, plan.capacity
        # (share of kv_bytes_per_token on window-sized buffers, rows they hold): the memory planner's
        # footprint counts those layers' KV once, not per position
        self.kv_sliding = plan.sliding_kv(layout.n_layers)
        self.capabilities = _capabilities(device, self.precision, plan)

    @property
    def n_past(self) -> int:
        return self.kv.n_past

    def forward(self, token_ids: Sequence[int], n_logits: int = 1) -> np.ndarray:
        if not token_ids:
            raise ValueError("forward needs at least one token")
        S = len(token_ids)
        n_logits = min(max(n_logits, 1), S)
        pieces = self.kv.pieces(S)
        if len(pieces) > 1:
            return self._forward_pieces(token_ids, n_logits, pieces)
        return self._forward(token_ids, n_logits)

    def _forward_pieces(self, token_ids: Sequence[int], n_logits: int, pieces: list[int]) -> np.ndarray:
        """One forward run as consecutive forwards of `pieces` tokens (the holder's cut: each
        piece's rows bind the same window start as each of those positions decoded alone); the
        logits of the last `n_logits` rows, copied out of each piece's."""
        n, S = self.kv.n_past, len(token_ids)
        self.kv.reserve(n + S)  # past the capacity: ContextFullError before any piece runs
        out, start = [], 0
        try:
            for size in pieces:
                end = start + size
                want = min(size, n_logits - (S - end))  # this piece's rows among the last n_logits
                rows = self._forward(token_ids[start:end], max(want, 1))
                if want > 0:
                    out.append(rows[-want:].copy())
                start = end
        except BaseException:
            self.kv.trim(n)  # as before the call: the earlier pieces' rows are let go
            raise
        return np.concatenate(out)

    def _forward(self, token_ids: Sequence[int], n_logits: int) -> np.ndarray:
        S, n = len(token_ids), self.kv.n_past
        feed = self.kv.feed(token_ids, n_logits)  # past the capacity: ContextFullError, nothing run
        wide = S > 1 and self._wide_req is not None
        req, bound = (self._wide_req, self._wide_bound) if wide else (self._req, self._bound)
        try:
            self._bind(req, bound, feed)
            outs = req.infer(share_outputs=True).to_tuple()  # views: no copy of the logits
        except Exception as e:
            self.kv.abort(n)
            raise BackendError(f"OpenVINO inference failed: {ov_reason(e)}") from e
        self.kv.commit([(outs[k], outs[v]) for k, v in self._new], S)
        # a view of the request's output, valid until the next forward (the Runtime contract):
        # no copy of a full vocabulary's logits per row
        logits = self.kv.rows(outs[self._logits][0], S, n_logits)
        return logits if logits.dtype == np.float32 else logits.astype(np.float32)

    def _bind(self, req, bound: dict[int, tuple[np.ndarray, object]], feed: dict) -> None:
        """Set a forward's inputs on `req`. A buffer the holder keeps ((buffer, shape)) is wrapped
        in a Tensor and set once; later forwards only reshape that Tensor (~1 us, where a new
        Tensor set on the request costs ~15 us, 40 inputs a forward). An array is shared, not
        copied: it outlives the call."""
        for name, value in feed.items():
            i = self._in[name]
            if type(value) is tuple:
                buf, shape = value
                held = bound.get(i)
                if held is not None and held[0] is buf:
                    held[1].shape = shape
                    continue
                tensor = self._tensor(buf, shared_memory=True)
                tensor.shape = shape
                bound[i] = (buf, tensor)
            else:
                bound.pop(i, None)
                tensor = self._tensor(value, shared_memory=True)
            req.set_input_tensor(i, tensor)

    def streamed(self) -> Streamed:
        return self._streamed

    def trim(self, n_past: int) -> None:
        self.kv.trim(max(0, min(n_past, self.kv.n_past)))

    def memory_bytes(self) -> dict[str, int]:
        return {"weights": self._weight_bytes, "kv": self.kv.nbytes()}

    def close(self) -> None:
        self.kv.close()
        self._bound, self._wide_bound = {}, {}
        self._req = self._wide_req = None
        self._compiled = None
