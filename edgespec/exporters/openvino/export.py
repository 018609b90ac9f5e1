"""`--format openvino`: edgespec's decoder graph → OpenVINO IR, weights compressed with NNCF.

Why not optimum-intel: optimum-intel 2.2.0 requires transformers < 5.6 (and torchvision),
while only transformers >= 5.23 reads the default Gemma 3 GGUF and its tokenizer; pip cannot
resolve both in one environment. So the same graph the ONNX path builds from the weights
transformers loaded (trimmed VocabTrim head and layer cut already applied by GraphOptions) is
converted with OpenVINO's own converter (`openvino.convert_model`), and NNCF — the library
optimum-intel itself calls — compresses its weights to int8 / int4.

The IR uses the graph's buffer KV layout (see onnx/graph.py): position ids, an attention
mask and only the new KV rows as outputs, with every size a shape. The runtime keeps the KV
buffer, so one IR serves the dynamic mode and the static-shape (NPU) mode, where it is
reshaped to a fixed KV capacity and verify width at load time.

A GGUF source in its own precision ("source") keeps its blocks: the graph is built on the
GGUF's BlockWeights (gguf/transcode) as onnxruntime's MatMulNBits, and OpenVINO's ONNX frontend
turns each MatMulNBits into the compressed-weight pattern NNCF writes and the CPU plugin fuses
into its compressed FullyConnected: Constant u4/u8 (N, K/block, block) -> Convert f32 ->
Subtract zero point -> Multiply scale -> Reshape (N, K) -> MatMul. The codes are the GGUF's
own; zero points that are not integers (4-bit Q4_K/Q4_1, and Q5_K/Q5_1/Q2_K whose block mins
fold_mins turns into zero points) stay the Subtract's float operand, which OpenVINO takes with any
bit width (onnxruntime's fast kernels do not: the ONNX path rewrites them). The tied embedding
stays one table: its Gather reads the head's codes and dequantizes the gathered rows only.
Nothing goes through NNCF or fp32.
"""
from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ...bundle import Artifact
from ...errors import ExportError
from ..gguf.deferred import LazyTensors
from ..gguf.transcode import BlockWeight, fold_mins
from ..onnx.external import ExternalData, save_streamed
from ..onnx.graph import build_decoder
from ..onnx.masks import window_align

__all__ = ["OVScheme", "OV_SCHEMES", "INFERENCE_PRECISION", "write_openvino", "compress", "convert_graph",
           "source_weights", "window_info", "set_window_info"]

logger = logging.getLogger(__name__)

# The precision the runtime asks the CPU plugin to compute in, stored in the IR's rt_info (the
# runtime applies it at compile time) and in the manifest. f32, because on CPUs with AMX or
# AVX512-BF16 the plugin defaults to bf16, whose rounding flips greedy near-ties against the
# fp32 reference; `precision="bf16"` at load time trades that for speed.
INFERENCE_PRECISION = "f32"


@dataclass(frozen=True)
class OVScheme:
    """One NNCF weight-compression scheme."""

    mode: str  # nncf.CompressWeightsMode member name
    group_size: int = -1  # -1: per output channel
    ratio: float = 1.0  # share of layers in `mode`; the rest stay int8
    all_layers: bool = False  # also the embedding and the head in `mode` (else int8)

    def describe(self) -> dict:
        return {"method": "nncf.compress_weights", "mode": self.mode.lower(), "group_size": self.group_size,
                "ratio": self.ratio, "all_layers": self.all_layers}


OV_SCHEMES: dict[str, OVScheme] = {
    "int8": OVScheme("INT8_ASYM"),
    # group 64 divides every hidden size we know (640 for Gemma 3 270M); NNCF keeps the
    # embedding and the head in int8 unless all_layers
    "int4": OVScheme("INT4_SYM", group_size=64),
}


def _import_ov():
    try:
        import openvino as ov
    except ImportError as e:
        raise ExportError("--format openvino needs OpenVINO and NNCF: pip install 'edgespec[openvino-export]'") from e
    return ov


def compress(model, precision: str, group_size: int | None = None):
    """Compress `model`'s weights with NNCF (int8 / int4); the scheme's description."""
    scheme = OV_SCHEMES[precision]
    if group_size is not None:
        scheme = replace(scheme, group_size=group_size)
    try:
        import nncf
    except ImportError as e:
        raise ExportError("int8/int4 OpenVINO weights need NNCF: pip install 'edgespec[openvino-export]'") from e
    kw = dict(mode=getattr(nncf.CompressWeightsMode, scheme.mode))
    if scheme.mode.startswith("INT4"):
        kw.update(group_size=scheme.group_size, ratio=scheme.ratio, all_layers=scheme.all_layers)
    _quiet_nncf()
    return nncf.compress_weights(model, **kw), scheme.describe()


def _quiet_nncf() -> None:
    # NNCF prints a statistics table and progress at INFO; keep the export's own bar readable
    logging.getLogger("nncf").setLevel(logging.WARNING)


def _group_size(hidden: int, wanted: int) -> int:
    """The largest of wanted, wanted/2, ... that divides the hidden size (NNCF needs that)."""
    g = wanted
    while g > 8 and hidden % g:
        g //= 2
    return g if hidden % g == 0 else -1


def _fold(value):
    return fold_mins(value) if isinstance(value, BlockWeight) else value


def source_weights(weights):
    """A GGUF job's weights as the OpenVINO graph takes them: BlockWeights with mins folded into
    float zero points (the codes untouched), float tensors as they are; tensors left in the GGUF
    file (gguf/deferred.LazyTensors) are folded as they are read."""
    if isinstance(weights, LazyTensors):
        return weights.mapped(_fold)
    return {k: _fold(v) for k, v in weights.items()}


def _exact_shifts(model) -> int:
    """Rewrite the ONNX frontend's BitShift (Divide(x, Power(2, n)) on unsigned integers) as
    BitwiseRightShift(x, n); returns how many. The CPU plugin computes that Power and Divide in
    floating point (measured: 155 / Power(2, 4) gave 10), which corrupts the high nibbles a
    4-bit table's Gather unpacks (onnx/blocks.BlockOps.gather_blocks)."""
    import openvino.opset15 as ops

    ov = _import_ov()
    n = 0
    for node in model.get_ordered_ops():
        if node.get_type_name() != "Divide" or node.get_output_element_type(0) not in (ov.Type.u8, ov.Type.u16,
                                                                                          ov.Type.u32, ov.Type.u64):
            continue
        power = node.input_value(1).get_node()
        args = [power.input_value(i).get_node() for i in range(power.get_input_size())]
        if power.get_type_name() != "Power" or any(a.get_type_name() != "Constant" for a in args):
            continue
        base, exp = (np.asarray(a.get_data()) for a in args)
        if base.size != 1 or int(base.reshape(-1)[0]) != 2:
            continue
        shift = ops.bitwise_right_shift(node.input_value(0), ops.constant(exp.astype(node.get_output_element_type(0)
                                                                                   .to_dtype())))
        node.output(0).replace(shift.output(0))
        n += 1
    return n


def convert_graph(spec, weights: dict, opts, scratch_dir: Path, what: str = "model"):
    """edgespec's decoder graph (onnx/graph.build_decoder) as an OpenVINO model, through a
    scratch ONNX file in `scratch_dir` (OpenVINO's ONNX frontend reads files)."""
    ov = _import_ov()
    with tempfile.TemporaryDirectory(dir=scratch_dir) as scratch:
        path = Path(scratch) / "model.onnx"
        # 4-bit float zero points (Q4_K, Q4_1) stay the Subtract's operand of the compressed pattern;
        # each weight goes to the scratch file as it is made (onnx/external.py)
        with ExternalData(path) as data:
            graph = build_decoder(spec, weights, replace(opts, nbits_float_zero_points=True), data=data)
        save_streamed(graph, path)
        del graph
        try:
            model = ov.convert_model(str(path))
        except Exception as e:  # OpenVINO raises its own types; keep one line
            raise ExportError(f"OpenVINO could not convert the {what} graph: {str(e).splitlines()[0]}") from e
    _exact_shifts(model)
    return model


def window_info(spec, layers: tuple[int, ...] | None, align: int | None = None) -> dict[str, str]:
    """The IR's record of its sliding-window layers, for the runtime to bind their pasts from an
    aligned start (runtimes/openvino/kv.window_of): the window, the alignment of the first bound
    position and which past_key_<j>/past_value_<j> slide ({} where none may: no window, or no
    full-attention layer kept to say where the context ends)."""
    kept = tuple(range(spec.n_layers)) if layers is None else tuple(layers)
    if not spec.sliding_window:
        return {}
    sliding = [j for j, li in enumerate(kept) if spec.layer_types[li] == "sliding_attention"]
    if not sliding or len(sliding) == len(kept):
        return {}
    return {"window": str(spec.sliding_window), "window_align": str(align or window_align(spec.head_dim)),
            "window_layers": ",".join(map(str, sliding))}


def set_window_info(model, info: dict[str, str]) -> None:
    """Write `window_info` into `model`'s rt_info, under "edgespec"."""
    for key, value in info.items():
        model.set_rt_info(value, ["edgespec", key])


def _source_quantization(job) -> tuple[str, dict]:
    """Manifest precision and quantization of a GGUF's blocks as compressed constants."""
    m = job.source.model
    return m.precision, {"method": "gguf-transcode", "op": "openvino compressed constants (u4/u8)",
                         "gguf_file_type": m.file_type, "gguf_block_types": m.block_types}


def write_openvino(job, bar) -> Artifact:
    """Build the buffer-layout graph, convert it, compress its weights (or keep a GGUF's), save the IR."""
    ov = _import_ov()
    source = job.precision == "source"
    job = replace(job, precision=job.precision or "fp32")  # None: as the source, which is float here
    out = job.bundle_dir / job.role / "openvino" / "model.xml"
    out.parent.mkdir(parents=True, exist_ok=True)
    # the graph computes in fp32; weights go to the IR as fp32 or fp16 (save_model compresses), or
    # as a GGUF's own blocks
    # OpenVINO verifies chains: its graph has no tree inputs (onnx/tree.py is onnxruntime's)
    opts = replace(job.opts, weight_dtype="fp32", kv_layout="buffer", tree=False)
    bar.set_postfix_str(f"{'transcoding' if source else 'converting'} {job.role} to OpenVINO")
    weights = source_weights(job.weights) if source else job.weights
    model = convert_graph(job.spec, weights, opts, job.bundle_dir, job.role)
    quant = None
    precision = job.precision
    if source:
        precision, quant = _source_quantization(job)
    elif job.precision in OV_SCHEMES:
        bar.set_postfix_str(f"compressing {job.role} to {job.precision} (NNCF)")
        gs = _group_size(job.spec.hidden_size, OV_SCHEMES[job.precision].group_size) \
            if OV_SCHEMES[job.precision].group_size > 0 else None
        model, quant = compress(model, job.precision, gs)
    quant = dict(quant or {}, inference_precision=INFERENCE_PRECISION, kv_layout="buffer")
    model.set_rt_info(INFERENCE_PRECISION, ["runtime_options", "INFERENCE_PRECISION_HINT"])
    model.set_rt_info("buffer", ["edgespec", "kv_layout"])
    # a runtime that finds no record binds every past whole (the IRs written before it)
    set_window_info(model, window_info(job.spec, opts.layers, opts.window_align))
    bar.set_postfix_str(f"writing {job.role} IR")
    ov.save_model(model, str(out), compress_to_fp16=job.precision == "fp16")
    return Artifact(file=str(out.relative_to(job.bundle_dir)), precision=precision, quantization=quant)
