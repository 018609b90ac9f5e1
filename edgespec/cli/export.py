"""`edgespec export`: parse flags, call exporters.export.export_bundle."""
from __future__ import annotations

import argparse
from pathlib import Path

from .common import cli_entry, setup_logging

__all__ = ["build_parser", "default_output", "main"]


def _vocab(text: str) -> int | str | None:
    if text in ("auto", "full"):
        return None if text == "full" else text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, 'auto' or 'full', got '{text}'") from None


def _layers(text: str) -> int | tuple[int, ...]:
    try:
        return int(text) if "," not in text else tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or comma-separated layer indices, got '{text}'") from None


def _formats(known: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        out = [f.strip() for f in text.split(",") if f.strip()]
        bad = [f for f in out if f not in known]
        if bad or not out:
            raise argparse.ArgumentTypeError(f"unknown format '{bad[0] if bad else text}' "
                                             f"(available: {', '.join(known)})")
        return out
    return parse


def build_parser() -> argparse.ArgumentParser:
    from ..exporters.export import DRAFT_PRECISIONS, FORMATS, TARGET_PRECISIONS

    p = argparse.ArgumentParser(prog="edgespec export", description="Export a target and its draft into a bundle.")
    p.add_argument("--target", type=Path, default=None,
                   help="Hugging Face model folder or .gguf file (default: the embedded Gemma 3 270M)")
    p.add_argument("--draft", default="self",
                   help="'self' (a quantized copy of the target, default), 'none', or a model folder/.gguf of the "
                        "target's tokenizer (two GGUFs are paired by llama.cpp's rule: same vocabulary type, "
                        "BOS/EOS, sizes within 128, token texts)")
    p.add_argument("--format", dest="formats", action="extend", type=_formats(FORMATS), default=None,
                   metavar="|".join(FORMATS),
                   help="output format(s): repeat the flag or separate with commas; one bundle may hold "
                        "several (default: onnx)")
    p.add_argument("--target-precision", default=None, choices=TARGET_PRECISIONS,
                   help="default 'source': a GGUF keeps its own quantized weights (transcoded to ONNX "
                        "MatMulNBits and OpenVINO u4/u8 compressed weights, copied as GGUF whatever their type); "
                        "another precision re-encodes it (GGUF: llama.cpp's quantizer, file to file), which "
                        "changes the model; a model folder defaults to fp32")
    p.add_argument("--draft-precision", default=None, choices=DRAFT_PRECISIONS,
                   help="default: a GGUF's self-draft keeps the target's weights (its body is the "
                        "target's), other drafts int8")
    p.add_argument("--draft-vocab", type=_vocab, default="auto", metavar="K|auto|full",
                   help="VocabTrim: keep the K tokens the target generates most often in the draft's head "
                        "(default auto: 16384 for vocabularies of 64k and more; full keeps the whole head)")
    p.add_argument("--draft-layers", type=_layers, default=None, metavar="N|I,J,...",
                   help="layer-cut draft: keep N of the target's layers (spread evenly) or these indices")
    p.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                   help="extra VocabTrim calibration prompts: one per line, or JSON lines with messages")
    p.add_argument("--draft-head", choices=("none", "trained"), default="none",
                   help="trained: also train a light draft head on the target (torch, on this CPU) for the "
                        "drafter 'head' (as `edgespec distill` does on a bundle)")
    p.add_argument("--train-minutes", type=float, default=None, metavar="N",
                   help="the draft head's training budget in minutes (default 10)")
    p.add_argument("--tree", action="store_true",
                   help="write the ONNX target's graph so one forward verifies a draft tree (onnxruntime; "
                        "its attention sums in blocks, so plain decoding with it rounds as a tree verify)")
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="bundle folder to write (default with --target: ./NAME.bundle in the working directory, "
                        "NAME the target's file or folder name without .gguf; without --target: the embedded "
                        "default's bundle in the user cache, which only this or an explicit -o rewrites)")
    p.add_argument("--force", action="store_true", help="replace an existing bundle")
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="memory the export may use, e.g. 900MB: it streams the weights, and stops before a "
                        "step that would pass the budget (a GGUF source)")
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


def default_output(target: Path | None, cwd: Path) -> Path | None:
    """Where a bundle goes without -o: beside the working directory for a model the user names
    (as mlx-lm's convert writes ./mlx_model), so a user's model never lands in the embedded
    default's cache folder and runs as the default; None (that folder) for the embedded default."""
    if target is None:
        return None
    name = Path(target).expanduser().resolve().name
    if name.lower().endswith(".gguf"):
        name = name[: -len(".gguf")]
    return cwd / f"{name or 'model'}.bundle"


@cli_entry
def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    from ..exporters.export import ExportConfig, export_bundle
    from ..models.catalog import DEFAULT_PRESET, default_bundle_path

    draft = None if args.draft == "none" else ("self" if args.draft == "self" else Path(args.draft))
    formats = tuple(dict.fromkeys(args.formats or ("onnx",)))
    # the default model's bundle goes where a load with a backend running that format looks for it
    home = default_bundle_path(DEFAULT_PRESET, "onnx" if "onnx" in formats else formats[0])
    cfg = ExportConfig(
        output=args.output or default_output(args.target, Path.cwd()) or home,
        target=args.target,
        draft=draft,
        formats=formats,
        target_precision=args.target_precision,
        draft_precision=args.draft_precision,
        draft_vocab=args.draft_vocab,
        draft_layers=args.draft_layers,
        calibration=args.calibration,
        force=args.force,
        draft_head=None if args.draft_head == "none" else args.draft_head,
        train_minutes=args.train_minutes,
        tree=args.tree,
        memory_budget=args.memory_budget,
    )
    if cfg.draft_head is None:
        out = export_bundle(cfg)
    else:  # the training (torch's side) uses the exporters, not the reverse: it runs the export
        from ..training.distill import export_with_head

        out = export_with_head(cfg)
    print(f"bundle written: {out}")
    return 0
