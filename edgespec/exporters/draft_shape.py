"""Cheaper drafts derived from a model without training: a subset of its layers
(SWIFT / Kangaroo / DEL style self-speculation) and a VocabTrim-pruned LM head."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checks import integer, is_int
from ..errors import ConfigError
from ..models.templates import TemplateRenderer
from ..progress import task
from .vocabtrim import (
    always_kept_ids,
    builtin_prompts,
    calibrate,
    calibrate_runtime,
    chat_text,
    choose_vocab,
    coverage,
    read_prompt_file,
)

__all__ = ["DraftShape", "select_layers", "shape_draft"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftShape:
    layers: tuple[int, ...] | None  # kept decoder layers (None: all)
    vocab_keep: np.ndarray | None  # kept target ids, sorted (None: full head)
    vocab_info: dict | None  # K, coverage, calibration source, for the manifest


def select_layers(n_layers: int, keep: int | tuple[int, ...]) -> tuple[int, ...]:
    """Layer indices to keep: explicit indices, or `keep` layers spread evenly from the
    first to the last (the first and last layers matter most for the output distribution)."""
    if not isinstance(keep, tuple | list):  # a count of layers
        keep = integer(keep, "--draft-layers", least=1, most=n_layers)
        return tuple(sorted({int(round(x)) for x in np.linspace(0, n_layers - 1, keep)}))
    if not keep or not all(is_int(i) and 0 <= i < n_layers for i in keep):
        raise ConfigError(f"--draft-layers indices must be in 0..{n_layers - 1}, got {list(keep)}")
    return tuple(sorted({int(i) for i in keep}))


def shape_draft(source, spec, chat_template: str | None, *, vocab: int | None,
                layers: int | tuple[int, ...] | None, calibration: Path | None,
                runtime=None, stop_ids=()) -> DraftShape:
    """Work out the layer subset and kept vocabulary of a draft derived from `source`.

    runtime: a callable returning an edgespec Runtime on the exported target, which generates the
    VocabTrim calibration text when the source has no transformers model (a GGUF source)."""
    kept_layers = select_layers(spec.n_layers, layers) if layers is not None else None
    if vocab is None:
        return DraftShape(kept_layers, None, None)
    prompts, label = builtin_prompts(), "built-in"
    if calibration is not None:
        prompts = prompts + read_prompt_file(Path(calibration))
        label = f"built-in + {Path(calibration).name}"
    template_ids = ()
    if chat_template:
        demo = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        with TemplateRenderer() as renderer:  # the source's template code: bounded in time and memory
            text = chat_text(renderer, source.tokenizer, demo, chat_template)
        template_ids = source.tokenizer(text, add_special_tokens=False).input_ids
    always = always_kept_ids(source.tokenizer, spec.family, template_ids)
    always = {i for i in always if i < spec.vocab_size}
    if vocab < len(always):  # checked before the (slow) calibration run
        raise ConfigError(f"--draft-vocab {vocab} is smaller than the {len(always)} special and chat tokens "
                          "that must be kept")
    if vocab >= spec.vocab_size:
        raise ConfigError(f"--draft-vocab {vocab} is not smaller than the vocabulary ({spec.vocab_size}); "
                          "drop the flag to keep the full head")
    # the target writes a few dozen tokens after every prompt: minutes on a slow backend
    with task("VocabTrim: the target generates calibration text", total=len(prompts), unit="prompt") as t:
        if runtime is not None:
            rt = runtime()
            try:
                cal = calibrate_runtime(rt, source.tokenizer, prompts, label, chat_template=chat_template,
                                        stop_ids=stop_ids, progress=t.update)
            finally:
                rt.close()
        else:
            cal = calibrate(source.model, source.tokenizer, prompts, label, chat_template=chat_template,
                            progress=t.update)
    keep = choose_vocab(cal.counts, vocab, always)
    cov = coverage(cal.counts, keep)
    logger.info("VocabTrim: K=%d keeps %.1f%% of %d calibration tokens", vocab, 100 * cov, cal.n_tokens)
    info = {"k": int(vocab), "coverage": round(cov, 4), "calibration": cal.source,
            "calibration_tokens": cal.n_tokens, "always_kept": len(always)}
    return DraftShape(kept_layers, keep, info)
