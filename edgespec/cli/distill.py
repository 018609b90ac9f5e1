"""`edgespec distill BUNDLE`: parse flags, call exporters.distill.distill_bundle (adds a trained
draft head to the bundle; torch on the CPU)."""
from __future__ import annotations

import argparse
from pathlib import Path

from .common import cli_entry, setup_logging

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from ..training.distill import DEFAULT_GEN_TOKENS, DEFAULT_TRAIN_MINUTES

    p = argparse.ArgumentParser(prog="edgespec distill",
                                description="Train a light draft head for a bundle on its own target and add it "
                                            "(drafter 'head').")
    p.add_argument("bundle", type=Path, help="bundle folder (an ONNX target with a VocabTrim self-draft)")
    p.add_argument("--train-minutes", type=float, default=DEFAULT_TRAIN_MINUTES, metavar="N",
                   help=f"training time budget on this CPU (default {DEFAULT_TRAIN_MINUTES:g})")
    p.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                   help="extra prompts: one per line, or JSON lines with messages or text")
    p.add_argument("--gen-tokens", type=int, default=DEFAULT_GEN_TOKENS, metavar="N",
                   help=f"tokens the target generates after each prompt, to train on (default {DEFAULT_GEN_TOKENS}; "
                        "more data, slower collection)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: onnxruntime's and torch's)")
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


@cli_entry
def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    from ..training.distill import DistillConfig, distill_bundle

    entry = distill_bundle(DistillConfig(args.bundle, train_minutes=args.train_minutes, calibration=args.calibration,
                                         gen_tokens=args.gen_tokens, threads=args.threads))
    print(f"draft head added to {args.bundle}: held-out agreement {entry.held_out_agreement:.3f} "
          f"(chained {entry.held_out_agreement_chained:.3f}) on {entry.held_out_tokens} positions; trained "
          f"{entry.train_seconds / 60:.1f} min on {entry.training_tokens} positions, peak memory "
          f"{entry.peak_rss_mb:.0f} MB")
    return 0
