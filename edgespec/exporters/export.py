"""`edgespec export`: source model(s) → one bundle folder with a manifest."""
from __future__ import annotations

import importlib
import importlib.util
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from ..bundle import MANIFEST, SCHEMA_VERSION, Artifact, Manifest, ModelEntry
from ..checks import integer, number, one_of
from ..errors import ConfigError, ExportError
from ..models.catalog import DEFAULT_PRESET, preset_source
from ..staging import staged_bundle_dir
from .build_memory import CALIBRATION_KV_TOKENS, BuildBudget
from .context import trained_context
from .draft_shape import DraftShape, shape_draft
from .onnx.external import ExternalData, save_streamed
from .onnx.graph import GraphOptions, build_decoder
from .onnx.quantize import SCHEMES, quantize_model
from .sources import Source, check_source, load_source
from .spec import ModelSpec, spec_from_hf
from .tokenizer_export import export_tokenizer

__all__ = ["ExportConfig", "ModelJob", "export_bundle", "auto_draft_vocab", "lazy_gguf", "FORMATS", "FORMAT_WRITERS",
           "TARGET_PRECISIONS", "DRAFT_PRECISIONS"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelJob:
    """One model (target or draft) to write in some format; what every format writer gets."""

    role: str  # "target" or "draft": the artifact goes in bundle_dir / role
    spec: ModelSpec
    # name -> float32 numpy array, transformers' state-dict names; with precision "source" the
    # GGUF's own blocks (gguf/transcode.BlockWeight) for the quantized tensors
    weights: dict
    precision: str | None  # fp32 | fp16 | int8 | int4 | source (None: as the source, fp32 if it must convert)
    opts: GraphOptions  # layers kept, VocabTrim rows kept (vocab_keep), tied or untied head
    source: Source
    bundle_dir: Path  # the staging folder; artifacts are named relative to it
    share_source: bool = False  # ExportConfig.share_source


# format -> "module:function(job, bar) -> Artifact", imported only when that format is asked for
FORMAT_WRITERS: dict[str, str] = {
    "onnx": "edgespec.exporters.export:write_onnx",
    "gguf": "edgespec.exporters.gguf.export:write_gguf",
    "openvino": "edgespec.exporters.openvino.export:write_openvino",
}
FORMATS = tuple(FORMAT_WRITERS)
# format -> (import name, pip extra) its writer needs, checked before any work
FORMAT_PACKAGES: dict[str, tuple[str, str]] = {"openvino": ("nncf", "openvino-export")}
# "source": a GGUF's own quantized blocks, transcoded (onnx, openvino) or copied (gguf); fp32 for other sources
TARGET_PRECISIONS = ("source", "fp32", "fp16", "int8", "int4")
DRAFT_PRECISIONS = ("source", "fp32", "int8", "int4")
# formats whose writer takes GGUF blocks as they are (onnx: MatMulNBits, openvino: compressed u4/u8
# constants); the others get gguf-py's dequantized weights
BLOCK_FORMATS = ("onnx", "openvino")
# MatMulNBits' accuracy_level for transcoded GGUF weights. 4: activations quantized to int8 per block,
# as llama.cpp's own CPU kernels do against these blocks; onnxruntime's CPU kernels have no fp32
# path for 8-bit codes (Q5_0/Q8_0/Q6_K here): with level 0 they dequantize the whole matrix on every
# call (orders of magnitude slower), and 4-bit level 0 is slower than level 4 too (docs/lean-bundles.md)
SOURCE_ACCURACY_LEVEL = 4


@dataclass(frozen=True)
class ExportConfig:
    """What to export; validated when built so bad flags fail before any work."""

    output: Path
    target: Path | None = None  # None: the default preset's GGUF
    draft: str | Path | None = "self"  # "self": a quantized copy of the target; None: no draft
    formats: tuple[str, ...] = ("onnx",)
    # None: as the source ("source": a GGUF's own blocks, transcoded or copied), fp32 for a folder
    target_precision: str | None = None
    # None: a GGUF source's draft uses the target's blocks (its body is the target's), else int8
    draft_precision: str | None = None
    # VocabTrim: keep K tokens in the draft's head; "auto" trims large vocabularies (see auto_draft_vocab)
    draft_vocab: int | str | None = "auto"
    draft_layers: tuple[int, ...] | int | None = None  # layer-cut draft: a count or explicit indices
    calibration: Path | None = None  # extra calibration prompts for VocabTrim (and a trained draft head)
    force: bool = False
    # "trained": add a trained draft head (export_bundle's train_head, training/distill.py)
    draft_head: str | None = None
    train_minutes: float | None = None  # its training budget (None: distill's default)
    # the target's ONNX graph takes draft trees (exporters/onnx/tree.py): one forward verifies a tree
    tree: bool = False
    # bytes the whole process may hold while building (build_memory.py): each costly phase is
    # checked before it runs, and one that would not fit stops the build (None: no budget)
    memory_budget: int | str | None = None
    # a GGUF kept as it is may be a hard link to the source rather than a copy (the direct-GGUF
    # cache: no second copy on disk); the bundle records it and refuses to load once it changed
    share_source: bool = False

    def __post_init__(self) -> None:
        _check_formats(self.formats)
        _check_values(self)
        conflict = next((why for wrong, why in _CONFLICTS if wrong(self)), None)
        if conflict is not None:
            raise ConfigError(conflict)
        if self.memory_budget is not None:
            from ..memory.budget import parse_bytes

            object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget))  # bytes once built


def _check_formats(formats: tuple[str, ...]) -> None:
    """Formats edgespec writes, each with the packages its writer needs (checked before any work)."""
    if not formats:
        raise ConfigError("--format needs at least one format")
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise ConfigError(f"format '{bad[0]}' is not supported yet (available: {', '.join(FORMATS)})")
    for fmt in formats:
        package, extra = FORMAT_PACKAGES.get(fmt, (None, None))
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"--format {fmt} needs {package}: pip install 'edgespec[{extra}]'")


def _check_values(cfg: ExportConfig) -> None:
    """Each option on its own: one of its choices, or a number in its range."""
    if cfg.target_precision is not None:
        one_of(cfg.target_precision, "--target-precision", TARGET_PRECISIONS)
    if cfg.draft_precision is not None:
        one_of(cfg.draft_precision, "--draft-precision", DRAFT_PRECISIONS)
    if isinstance(cfg.draft_vocab, str) and cfg.draft_vocab != "auto":
        raise ConfigError(f"--draft-vocab takes a number, 'auto' or 'full', got {cfg.draft_vocab!r}")
    if cfg.draft_vocab not in (None, "auto"):
        integer(cfg.draft_vocab, "--draft-vocab", least=1)
    if cfg.draft_head not in (None, "trained"):
        raise ConfigError(f"--draft-head takes 'trained' or 'none', got {cfg.draft_head!r}")
    if cfg.train_minutes is not None:
        number(cfg.train_minutes, "--train-minutes", above=0)  # the rule of `edgespec distill`'s flag


def _shapes_draft(cfg: ExportConfig) -> bool:
    """Whether the options make the draft other than the target's body and head (trimmed or cut)."""
    return cfg.draft_vocab not in (None, "auto") or cfg.draft_layers is not None


# Options that cannot go together: (whether a config has the conflict, what to tell the user),
# checked in this order once each option is valid on its own
_CONFLICTS: tuple[tuple[Callable[[ExportConfig], bool], str], ...] = (
    (lambda c: c.draft == "self" and not _shapes_draft(c) and c.draft_precision == "fp32"
     and c.target_precision in (None, "fp32"),
     "a 'self' draft in fp32 is the target itself; give --draft-precision int8 or int4"),
    (lambda c: c.draft is None and (_shapes_draft(c) or c.calibration is not None),
     "--draft-vocab, --draft-layers and --calibration shape a draft; drop --draft none"),
    (lambda c: c.calibration is not None and c.draft_vocab is None and c.draft_head is None,
     "--calibration only matters with --draft-vocab or --draft-head trained"),
    (lambda c: c.tree and "onnx" not in c.formats,
     "--tree writes the ONNX target's graph for tree verification: add --format onnx"),
    (lambda c: c.draft_head is None and c.train_minutes is not None,
     "--train-minutes is the draft head's budget; add --draft-head trained"),
    (lambda c: c.draft_head is not None and (c.draft != "self" or c.draft_layers is not None),
     "--draft-head trained runs on the target's body: it needs --draft self without --draft-layers"),
    (lambda c: c.draft_head is not None and "onnx" not in c.formats,
     "--draft-head trained is trained on the ONNX target: add --format onnx"),
)


# Measured on Gemma 3 270M (dev/sweep_vocabtrim.py, docs/LOG.md): K = 16k keeps the full head's
# acceptance and makes the int8 draft markedly cheaper per token.
AUTO_DRAFT_VOCAB = 16384


def auto_draft_vocab(vocab_size: int) -> int | None:
    """The default VocabTrim K: trim only vocabularies big enough for the head to dominate."""
    return AUTO_DRAFT_VOCAB if vocab_size >= 4 * AUTO_DRAFT_VOCAB else None


def _save(model: onnx.ModelProto, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)


def write_streamed(spec: ModelSpec, weights, opts: GraphOptions, path: Path) -> None:
    """Build and save a decoder graph whose initializers go to `path`'s data file as they are made
    (onnx/external.py): the weights are never all in memory, in the source's form or the graph's."""
    with ExternalData(path) as data:
        model = build_decoder(spec, weights, opts, data=data)
    save_streamed(model, path)


def _weights(source: Source) -> dict[str, np.ndarray]:
    """float32 weights under transformers' names (a GGUF's dequantized by gguf-py)."""
    if source.kind == "gguf":
        return source.model.dequantized()
    return {k: v.detach().float().numpy() for k, v in source.model.state_dict().items()}


def _spec(source: Source) -> ModelSpec:
    return source.model.spec if source.kind == "gguf" else spec_from_hf(source.model)


def _resolve(source: Source, precision: str | None, role: str) -> str | None:
    """The precision a job is written in: None and "source" keep a GGUF's own blocks; another
    precision re-encodes them, which changes the model (said once, here)."""
    if source.kind != "gguf":
        return None if precision == "source" else precision
    if precision in (None, "source"):
        return "source"
    if role == "target":
        logger.warning("re-encoding the %s GGUF (%s) as %s: the exported model differs from the GGUF's; "
                       "drop --target-precision to keep its own weights", role, source.model.file_type, precision)
    return precision


def _job_weights(source: Source, precision: str | None, dequantized: dict | None = None):
    if precision == "source" or source.lazy:  # a lazy GGUF's writer reads its file, not these
        return source.model.tensors
    return dequantized if dequantized is not None else _weights(source)


def _source_quantization(job: ModelJob) -> tuple[str, dict]:
    """Manifest precision and quantization of a GGUF transcoded into MatMulNBits."""
    m = job.source.model
    return m.precision, {"method": "gguf-transcode", "op": "com.microsoft.MatMulNBits",
                         "gguf_file_type": m.file_type, "gguf_block_types": m.block_types,
                         "accuracy_level": job.opts.nbits_accuracy}


def _for_format(fmt: str, job: ModelJob) -> ModelJob:
    """A job as its format's writer takes it: the GGUF writer copies a GGUF source's own blocks
    from its file (gguf/passthrough.py), the block formats transcode them."""
    if job.precision != "source" or fmt in BLOCK_FORMATS or (fmt == "gguf" and job.source.kind == "gguf"):
        return job
    raise ExportError(f"--format {fmt} cannot take a GGUF's blocks; give --target-precision")


def lazy_gguf(formats: tuple[str, ...]) -> bool:
    """Whether a GGUF source is only described, its tensors left in the file: when no format asked
    transcodes its blocks, so any block type llama.cpp runs exports as GGUF."""
    return not set(formats) & set(BLOCK_FORMATS)


def write_onnx(job: ModelJob, bar) -> Artifact:
    """Build, optionally quantize, and save one decoder graph; return its manifest entry."""
    path = job.bundle_dir / job.role / "model.onnx"
    if job.precision == "source":  # the GGUF's blocks as MatMulNBits, nothing re-encoded
        bar.set_postfix_str(f"transcoding {job.role}")
        opts = replace(job.opts, weight_dtype="fp32", kv_layout="append", nbits_accuracy=SOURCE_ACCURACY_LEVEL)
        write_streamed(job.spec, job.weights, opts, path)
        precision, quant = _source_quantization(replace(job, opts=opts))
        return Artifact(file=str(path.relative_to(job.bundle_dir)), precision=precision, quantization=quant)
    job = replace(job, precision=job.precision or "fp32")
    # "append" KV: the runtime keeps fixed preallocated cache buffers (edgespec/memory)
    opts = replace(job.opts, weight_dtype="fp16" if job.precision == "fp16" else "fp32", kv_layout="append")
    model = build_decoder(job.spec, job.weights, opts)
    quant = None
    if job.precision in SCHEMES:
        bar.set_postfix_str(f"quantizing {job.role} to {job.precision}")
        model = quantize_model(model, SCHEMES[job.precision])
        quant = SCHEMES[job.precision].describe()
    bar.set_postfix_str(f"writing {job.role}")
    _save(model, path)
    return Artifact(file=str(path.relative_to(job.bundle_dir)), precision=job.precision, quantization=quant)


def _write_formats(formats: tuple[str, ...], job: ModelJob, bar) -> dict[str, Artifact]:
    out = {}
    for fmt in formats:
        module, fn = FORMAT_WRITERS[fmt].split(":")
        out[fmt] = getattr(importlib.import_module(module), fn)(_for_format(fmt, job), bar)
    return out


def _entry(spec: ModelSpec, artifacts: dict[str, Artifact], source: Source, shape: DraftShape | None = None,
           id_map: str | None = None) -> ModelEntry:
    layers = shape.layers if shape and shape.layers is not None else None
    vocab = len(shape.vocab_keep) if shape and shape.vocab_keep is not None else spec.vocab_size
    return ModelEntry(formats=artifacts, n_layers=len(layers) if layers else spec.n_layers,
                      n_kv_heads=spec.n_kv_heads, head_dim=spec.head_dim, vocab_size=vocab,
                      source=source.describe(), layers=list(layers) if layers else None, id_map=id_map,
                      vocab_info=shape.vocab_info if shape else None, context_length=trained_context(source.model))


def _check_draft_vocab(target: Source, draft: Source) -> None:
    """Two GGUFs: llama.cpp's own pairing rule (gguf/vocab_check.py); otherwise equal vocabularies."""
    if target.kind == draft.kind == "gguf":
        from .gguf.reader import open_gguf
        from .gguf.vocab_check import check_compatible, vocab_facts

        check_compatible(vocab_facts(open_gguf(target.path)), vocab_facts(open_gguf(draft.path)), draft.path.name)
        return
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise ExportError("the draft's tokenizer differs from the target's; pick a draft of the same family")


def _calibration_runtime(source: Source, spec: ModelSpec, tmp: Path, target_onnx: Path | None,
                         budget: BuildBudget | None = None):
    """A factory of an onnxruntime Runtime on the exported target, for VocabTrim calibration
    without torch; None for a transformers source (its model generates). Without an ONNX target
    in the bundle, a scratch one is built (and removed with the staging folder's scratch)."""
    if source.kind != "gguf":
        return None

    def make():
        if source.lazy:  # nothing decoded: the GGUF itself runs on llama.cpp
            from ..errors import BackendError
            from ..runtimes.llamacpp.runtime import LlamaCppRuntime

            try:
                return LlamaCppRuntime(source.path, kv_capacity=CALIBRATION_KV_TOKENS)
            except BackendError as e:
                raise ExportError(f"VocabTrim calibration for --format gguf runs llama.cpp ({e}); "
                                  "or give --draft-vocab full") from e
        from ..runtimes.onnxruntime.runtime import OnnxRuntime

        path = target_onnx
        if path is None:
            path = tmp / ".calibration" / "model.onnx"
            write_streamed(spec, source.model.tensors,
                           GraphOptions(kv_layout="append", nbits_accuracy=SOURCE_ACCURACY_LEVEL), path)
        if budget is not None:
            budget.check_session(path.with_name(path.name + ".data"), spec)
        return OnnxRuntime(path, kv_capacity=CALIBRATION_KV_TOKENS)
    return make


def _draft_precision(cfg: ExportConfig, source: Source, shaped: bool) -> str | None:
    """None (default): a GGUF draft keeps its own blocks (a self-draft's body is the target's, its
    trimmed head the embedding's own rows); an unshaped self-draft would be the target, so int8."""
    if cfg.draft_precision is not None:
        return cfg.draft_precision
    return "source" if source.kind == "gguf" and (cfg.draft != "self" or shaped) else "int8"


def _export_draft(cfg: ExportConfig, tmp: Path, bar, source: Source, spec: ModelSpec, weights,
                  chat_template: str | None, target_onnx: Path | None = None, stop_ids=()) -> ModelEntry:
    """Write the draft: a separate model, or the target itself made cheaper (quantized,
    layer-cut, VocabTrim head)."""
    target_vocab = spec.vocab_size
    if cfg.draft != "self":
        bar.set_postfix_str(f"loading draft {Path(cfg.draft).name}")
        draft = load_source(cfg.draft, lazy=lazy_gguf(cfg.formats))
        _check_draft_vocab(source, draft)
        source, spec, weights = draft, _spec(draft), None
        target_onnx = None  # calibrate on the draft's own model
        bar.update()
    vocab = auto_draft_vocab(spec.vocab_size) if cfg.draft_vocab == "auto" else cfg.draft_vocab
    bar.set_postfix_str("calibrating VocabTrim" if vocab else "shaping draft")
    budget = BuildBudget(cfg.memory_budget)
    shape = shape_draft(source, spec, chat_template, vocab=vocab, layers=cfg.draft_layers,
                        calibration=cfg.calibration,
                        runtime=_calibration_runtime(source, spec, tmp, target_onnx, budget), stop_ids=stop_ids)
    shutil.rmtree(tmp / ".calibration", ignore_errors=True)  # a scratch target, if one was built
    shaped = shape.layers is not None or shape.vocab_keep is not None
    top = int(shape.vocab_keep.max()) + 1 if shape.vocab_keep is not None else spec.vocab_size
    if top > target_vocab:  # a draft id the target's head has no row for
        raise ExportError(f"the draft's head reaches token {top - 1}, past the target's {target_vocab} rows: give "
                          "--draft-vocab K to keep tokens both have")
    precision = _resolve(source, _draft_precision(cfg, source, shaped), "draft")
    weights = _job_weights(source, precision, weights if precision != "source" else None)
    # an untied head lets the quantizer shrink the LM head too, the draft's costliest matmul
    opts = GraphOptions(layers=shape.layers, vocab_keep=shape.vocab_keep, tie_head=False)
    budget.check_matrices(weights, "draft")
    arts = _write_formats(cfg.formats, ModelJob("draft", spec, weights, precision, opts, source, tmp,
                                                cfg.share_source), bar)
    id_map = None
    if shape.vocab_keep is not None:
        id_map = "draft/id_map.npy"
        np.save(tmp / id_map, shape.vocab_keep)
    bar.update()
    return _entry(spec, arts, source, shape, id_map)


def _checked_sources(cfg: ExportConfig) -> tuple[Path, Path | None]:
    """The target's and the draft's source paths (None: no draft model of its own), checked before
    any work with the calibration file and the memory budget, so a bad input writes nothing."""
    target_path = Path(cfg.target) if cfg.target is not None else preset_source(DEFAULT_PRESET)
    draft_path = Path(cfg.draft) if cfg.draft not in (None, "self") else None
    for path in filter(None, (target_path, draft_path)):
        check_source(path)
    if cfg.calibration is not None:
        from .vocabtrim import read_prompt_file

        read_prompt_file(Path(cfg.calibration))  # read again when used: here only checked
    BuildBudget(cfg.memory_budget).check_source(target_path)  # the build's costliest phase, from the file's size
    return target_path, draft_path


def export_bundle(cfg: ExportConfig, *, train_head: Callable[[Path], object] | None = None) -> Path:
    """Export `cfg.target` (and its draft) into the bundle folder `cfg.output`; return it.

    `train_head(staged)` adds the draft head `cfg.draft_head` asks for to the staged bundle before it
    is moved into place, so a failed training leaves no bundle. The training is torch's side, which
    uses the exporters and not the reverse: its caller passes it (training.distill.export_with_head).
    """
    from ..progress import task

    if cfg.draft_head is not None and train_head is None:
        raise ConfigError(f"--draft-head {cfg.draft_head} is trained by edgespec.training: export with "
                          "edgespec.training.distill.export_with_head")
    target_path, draft_path = _checked_sources(cfg)
    steps = 4 + (cfg.draft is not None) + (draft_path is not None)
    budget = BuildBudget(cfg.memory_budget)
    with staged_bundle_dir(Path(cfg.output), force=cfg.force) as tmp, task("export", total=steps) as bar:
        bar.set_postfix_str(f"loading {Path(target_path).name}")
        source = load_source(target_path, lazy=lazy_gguf(cfg.formats))
        spec = _spec(source)
        precision = _resolve(source, cfg.target_precision, "target")
        weights = _job_weights(source, precision)
        bar.update()
        # the target keeps a tied embedding as one tensor (Gather and Gemm share it)
        opts = GraphOptions(tie_head=True, tree=cfg.tree)
        budget.check_matrices(weights, "target")
        target_arts = _write_formats(cfg.formats, ModelJob("target", spec, weights, precision, opts, source, tmp,
                                                           cfg.share_source), bar)
        bar.update()
        bar.set_postfix_str("tokenizer")
        tok_info = export_tokenizer(source, spec.family, tmp)
        bar.update()
        draft_entry = None
        if cfg.draft is not None:
            target_onnx = tmp / target_arts["onnx"].file if "onnx" in target_arts else None
            draft_entry = _export_draft(cfg, tmp, bar, source, spec, weights if precision != "source" else None,
                                        tok_info.chat_template, target_onnx, tok_info.stop_token_ids)
        manifest = Manifest(
            schema_version=SCHEMA_VERSION,
            model_type=spec.model_type,
            family=spec.family.name,
            base_model=tok_info.chat_template_source != "model",
            tokenizer=tok_info,
            target=_entry(spec, target_arts, source),
            draft=draft_entry,
        )
        (tmp / MANIFEST).write_text(manifest.to_json())
        if cfg.draft_head is not None:  # on the staged bundle: a failed training leaves no bundle
            bar.set_postfix_str("training the draft head")
            train_head(tmp)
        bar.set_postfix_str("done")
        bar.update()
    logger.info("bundle written to %s", cfg.output)
    return Path(cfg.output)
