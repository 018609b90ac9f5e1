"""`edgespec info [BUNDLE]`: installed backends, and a bundle's manifest in short."""
from __future__ import annotations

import argparse
import importlib.util
from importlib import metadata

from .common import cli_entry

__all__ = ["main"]


def _backends() -> list[str]:
    from ..runtimes import BACKENDS

    lines = []
    for name, info in BACKENDS.items():
        pkg = info.module.rsplit(".", 1)[-1]
        if importlib.util.find_spec(pkg) is None:
            lines.append(f"  {name:<12} not installed (pip install 'edgespec[{info.extra}]')")
        else:
            lines.append(f"  {name:<12} {metadata.version(pkg)}  devices: CPU  runs: {info.bundle_format}")
    return lines


def _bundle(path: str) -> list[str]:
    from ..bundle import load_bundle

    m = load_bundle(path).manifest
    lines = [f"bundle {path}", f"  model: {m.model_type} (family {m.family}){' - base model' if m.base_model else ''}",
             f"  chat template: {m.tokenizer.chat_template_source}"]
    for role, e in (("target", m.target), ("draft", m.draft)):
        if e is None:
            lines.append(f"  {role}: none")
            continue
        fmts = ", ".join(f"{f} {a.precision}" for f, a in e.formats.items())
        lines.append(f"  {role}: {e.n_layers} layers, vocab {e.vocab_size}, {fmts} (from {e.source.get('name')})")
    return lines


@cli_entry
def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="edgespec info", description="Show backends and a bundle.")
    p.add_argument("bundle", nargs="?", default=None)
    args = p.parse_args(argv)
    print("backends:")
    print("\n".join(_backends()))
    if args.bundle:
        print("\n".join(_bundle(args.bundle)))
    return 0
