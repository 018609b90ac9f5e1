"""`edgespec distill`: add a trained draft head to a bundle (and `export --draft-head trained`).

Phases: check the bundle (an ONNX target and a draft of its body with a VocabTrim head) ->
make the data with the target (draft_head_data.py, onnxruntime, no torch) -> train under the
time budget (draft_head_train.py, torch on the CPU) -> write the head's ONNX into a staging
folder inside the bundle and check onnxruntime computes what torch did -> move it into place
and rewrite the manifest. Any error before the move leaves the bundle as it was.
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..bundle import MANIFEST, DraftHeadEntry, load_bundle
from ..checks import integer, number
from ..cpus import usable_cpu_count
from ..errors import BackendError, ConfigError
from ..exporters.vocabtrim import builtin_prompts, read_prompt_file
from ..progress import reporting, task
from .draft_head import FEATURE_LAYER, HEAD_DIR, HEAD_FILE, build_onnx, draft_index, reference
from .draft_head_data import collect, head_matrix, prompt_ids

if TYPE_CHECKING:
    from ..exporters.export import ExportConfig

__all__ = ["DEFAULT_TRAIN_MINUTES", "DistillConfig", "distill_bundle", "export_with_head"]

logger = logging.getLogger(__name__)

DEFAULT_TRAIN_MINUTES = 10.0
DEFAULT_GEN_TOKENS = 64  # greedy tokens the target adds to each calibration prompt


@dataclass(frozen=True)
class DistillConfig:
    bundle: Path
    train_minutes: float = DEFAULT_TRAIN_MINUTES
    calibration: Path | None = None  # extra prompts: one per line, or JSON lines (vocabtrim.read_prompt_file)
    gen_tokens: int = DEFAULT_GEN_TOKENS
    builtin: bool = True  # the built-in calibration prompts too (tests train on a file alone)
    threads: int | None = None
    seed: int = 0
    progress: bool | None = None  # False: silent; else progress.Console's bars or lines (progress.py)

    def __post_init__(self) -> None:
        number(self.train_minutes, "--train-minutes", above=0)
        integer(self.gen_tokens, "--gen-tokens", least=0)
        if not self.builtin and self.calibration is None:
            raise ConfigError("no calibration prompts: give a calibration file or keep the built-in prompts")
        if self.threads is not None:
            object.__setattr__(self, "threads", _bounded_threads(self.threads))


def _bounded_threads(threads) -> int:
    """--threads checked (an integer >= 1) and capped by the CPUs this process may use: more
    threads than cores only contend for them, and a huge count would make every pool spawn them."""
    threads = integer(threads, "--threads", least=1)
    usable = usable_cpu_count()
    if threads > usable:
        logger.warning("--threads %d is more than the %d CPUs this process may use; using %d", threads, usable,
                       usable)
        return usable
    return threads


def _files(bundle) -> tuple[Path, Path]:
    """(target .onnx, draft .onnx) of a bundle a head can be trained for, else a ConfigError."""
    m = bundle.manifest
    if "onnx" not in m.target.formats:
        raise ConfigError(f"{bundle.path}: the bundle has no ONNX target; a draft head is trained on one "
                          "(export with --format onnx)")
    if m.draft is None or "onnx" not in m.draft.formats or not m.self_draft:
        raise ConfigError(f"{bundle.path}: a draft head ends in the VocabTrim head of a draft on the target's "
                          "body; export the bundle with --draft self")
    if m.draft.id_map is None and m.draft.vocab_size != m.target.vocab_size:
        raise ConfigError(f"{bundle.path}: the draft's vocabulary ({m.draft.vocab_size}) does not match the "
                          f"target's ({m.target.vocab_size})")
    return bundle.file(m.target.formats["onnx"].file), bundle.file(m.draft.formats["onnx"].file)


def _prompts(cfg: DistillConfig) -> tuple[list[dict], str]:
    prompts = builtin_prompts() if cfg.builtin else []
    sources = ["built-in"] if cfg.builtin else []
    if cfg.calibration is not None:
        prompts += read_prompt_file(Path(cfg.calibration))  # a ConfigError when empty or missing
        sources.append(Path(cfg.calibration).name)
    return prompts, "+".join(sources)


def _check_onnx(path: Path, weights, threads: int | None) -> None:
    """onnxruntime must compute what the trained weights compute (numpy reference)."""
    from ..runtimes.onnxruntime.split import OnnxFeatureHead

    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((3, weights.hidden_size)).astype(np.float32)
    tokens = rng.integers(0, weights.k + 1, 3)
    head = OnnxFeatureHead(path, threads=threads)
    try:
        got = head(hidden, tokens)
    finally:
        head.close()
    want = reference(weights, hidden, tokens)
    if not np.allclose(got, want, rtol=1e-3, atol=1e-3 * float(np.abs(want).max())):
        raise BackendError("the exported draft head does not compute what was trained (onnxruntime differs)")


def _install(root: Path, stage: Path, entry: DraftHeadEntry) -> None:
    """Move the staged head into place, then rewrite the manifest (written aside, renamed over)."""
    manifest = load_bundle(root).manifest
    final, old = root / HEAD_DIR, None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{HEAD_DIR}.{os.getpid()}.old-", dir=root))
        os.replace(final, old / HEAD_DIR)
    os.replace(stage, final)
    text = replace(manifest, draft_head=entry).to_json()
    fd, tmp = tempfile.mkstemp(prefix=f".{MANIFEST}.", dir=root)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, root / MANIFEST)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def distill_bundle(cfg: DistillConfig) -> DraftHeadEntry:
    """Train a draft head for the bundle `cfg.bundle` and add it; its manifest entry."""
    from ..tokenizer import Tokenizer

    try:
        from .draft_head_train import train_head  # noqa: F401  (used in _train_into; checked before any work)
    except ImportError as e:  # the runtime install has no torch; training is an export-time job
        raise ConfigError(f"training a draft head needs torch ({e.name} is not installed): "
                          "pip install 'edgespec[export]'") from None

    bundle = load_bundle(cfg.bundle)
    target_path, draft_path = _files(bundle)
    prompts, source = _prompts(cfg)
    m = bundle.manifest
    tokenizer = Tokenizer(bundle.file(m.tokenizer.file), m.tokenizer)
    sequences = prompt_ids(tokenizer, prompts)
    if not sequences:
        raise ConfigError("the calibration prompts hold no text to train a draft head on")
    # made before the minutes of work (a bundle it cannot write to fails now), named before it is
    # made: a SIGTERM the moment it exists still finds it
    stage = bundle.path / f".{HEAD_DIR}.{os.getpid()}.stage-{secrets.token_hex(6)}"
    try:
        _make_stage(stage)
        entry = _train_into(cfg, bundle, stage, target_path, draft_path, sequences, source)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    logger.info("draft head written to %s: held-out agreement %.3f", bundle.path / HEAD_FILE, entry.held_out_agreement)
    return entry


def export_with_head(cfg: ExportConfig) -> Path:
    """`edgespec export --draft-head trained`: export the bundle `cfg` describes and train its draft
    head on the staged folder (exporters.export.export_bundle's `train_head`), so a failed training
    leaves no bundle; the bundle's folder. A `cfg` without a draft head exports as export_bundle does."""
    from ..exporters.export import export_bundle  # onnx and the graph builders: only when exporting

    if cfg.draft_head is None:
        return export_bundle(cfg)
    minutes = cfg.train_minutes if cfg.train_minutes is not None else DEFAULT_TRAIN_MINUTES

    def train(staged: Path) -> None:
        distill_bundle(DistillConfig(staged, train_minutes=minutes, calibration=cfg.calibration))

    return export_bundle(cfg, train_head=train)


def _make_stage(stage: Path) -> None:
    """Make the staging folder of the new head inside the bundle: making it is the one sure test
    that the bundle can be written (a read-only mount refuses root too); and check that its draft
    head, if it has one, can be moved aside."""
    root, old = stage.parent, stage.parent / HEAD_DIR
    try:
        if old.exists() and not os.access(old, os.W_OK):  # moving a folder rewrites its '..' entry
            raise PermissionError(13, "Permission denied", str(old))
        stage.mkdir(mode=0o755)  # readable by other users of a shared bundle
    except OSError as e:
        raise ConfigError(f"cannot write to the bundle {root} ({e.strerror or e}): distill adds the trained head "
                          "to it; copy the bundle somewhere writable") from None


def _train_into(cfg: DistillConfig, bundle, stage: Path, target_path: Path, draft_path: Path, sequences,
                source: str) -> DraftHeadEntry:
    """Make the data, train, write the head into `stage`, check it, and install it in the bundle."""
    from ..runtimes.onnxruntime.split import open_shared_pair
    from .draft_head_train import train_head

    m = bundle.manifest
    try:
        target, draft = open_shared_pair(target_path, draft_path, threads=cfg.threads)
    except BackendError as e:
        raise ConfigError(f"{bundle.path}: {e}") from None
    with target, draft, reporting(None) if cfg.progress is False else nullcontext():
        with task("draft-head data: the target writes after each prompt", total=len(sequences),
                  unit="prompt") as bar:
            data = collect(target, sequences, gen_tokens=cfg.gen_tokens, stop_ids=m.tokenizer.stop_token_ids,
                           draft=draft, id_map=bundle.id_map(), progress=bar.update)
        out_w = head_matrix(draft.head, draft.head.hidden_size)
    index = draft_index(bundle.id_map(), m.target.vocab_size)
    result = train_head(data, out_w, index, seconds=60 * cfg.train_minutes, seed=cfg.seed, progress=cfg.progress,
                        threads=cfg.threads)
    import onnx

    onnx.save(build_onnx(result.weights), stage / Path(HEAD_FILE).name)
    _check_onnx(stage / Path(HEAD_FILE).name, result.weights, cfg.threads)
    entry = DraftHeadEntry(
        file=HEAD_FILE, k=result.weights.k, hidden_size=result.weights.hidden_size, feature_layer=FEATURE_LAYER,
        inner_size=int(result.weights.w_gate.shape[1]), training_tokens=result.samples,
        held_out_tokens=result.held_out, train_minutes=float(cfg.train_minutes),
        train_seconds=round(float(result.seconds), 1), data_seconds=round(float(data.seconds), 1),
        held_out_agreement=round(result.agreement, 4),
        held_out_agreement_chained=round(result.agreement_chained, 4),
        calibration=source, peak_rss_mb=round(result.peak_rss_mb, 1))
    _install(bundle.path, stage, entry)
    return entry
