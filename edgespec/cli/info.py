"""`edgespec info [BUNDLE]`: installed backends, and a bundle's manifest in short."""
from __future__ import annotations

import argparse
import importlib.util
from importlib import metadata

from .common import cli_entry

__all__ = ["main"]


def _backends() -> list[str]:
    from ..runtimes import BACKENDS, backend_devices

    lines = []
    for name, info in BACKENDS.items():
        if importlib.util.find_spec(info.package) is None:
            lines.append(f"  {name:<12} not installed (pip install 'edgespec[{info.extra}]')")
            continue
        try:
            devices = ", ".join(backend_devices(name))
        except Exception as e:  # a broken install should not hide the other backends
            devices = f"unavailable ({str(e).splitlines()[0]})"
        shares = "  draft on the target's body" if info.shared_body else ""
        lines.append(f"  {name:<12} {_version(info.package)}  devices: {devices}  runs: {info.bundle_format}{shares}")
        # a backend that names its GPUs (its module imported fine: it listed a GPU)
        gpus = getattr(importlib.import_module(info.module), "gpu_names", None) if "GPU" in devices else None
        lines += [f"    GPU {gpu} (driven by {name})" for gpu in (gpus() if gpus else [])]
    return lines


def _cores() -> list[str]:
    """The machine's kinds of core and the ones an engine decodes on by default (engine/cores.py)."""
    from ..engine.cores import machine_cores, read_cores

    choice = machine_cores(None)
    threads = f"{choice.threads} threads per model" if choice.threads else "threads: the backend's choice"
    return [f"cores: {read_cores().describe()}",
            f"  decoding on cores {','.join(map(str, choice.cpus))} ({threads}{', pinned' if choice.pin else ''}): "
            f"{choice.reason}; --threads N sets the count"]


def _version(package: str) -> str:
    for dist in (package, package.replace("_", "-")):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "?"


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
    if m.self_draft:
        lines.append("  draft body: the target's own, so the draft can run on the target's body (--draft-body)")
    return lines


def _tuning(path: str, retune: bool) -> tuple[list[str], bool]:
    """The configuration a default load picks on this machine and the figures it chose by
    (tuning.py: measured at the first load, then read from the cache); and whether it measured."""
    from ..engine.engine import load
    from ..errors import EdgespecError

    try:
        with load(path, retune=retune) as engine:
            opened = engine.opened  # what the engine runs, deviations from its plan included
    except EdgespecError as e:
        return [f"tuning: cannot open the bundle: {e}"], False
    what = opened.backend + (f", draft body {opened.draft_body}" if opened.draft_body else "")
    notes = [f"  not as planned: {d.what} {d.planned} -> {d.opened}: {d.reason}" for d in opened.deviations]
    tuning = opened.tuning
    if tuning is None:
        return [f"configuration: {what} (one candidate here, or tuning is off: nothing measured)", *notes], False
    return ["configuration (the fastest exact one measured on this machine):", *("  " + ln for ln in tuning.describe()),
            *notes], any(not m.cached for m in tuning.candidates)


def _exactness(path: str, retune: bool) -> list[str]:
    """Each installed backend's exactness verdict for the bundle on this machine (probed on the
    first load, then read from the cache)."""
    from ..bundle import load_bundle
    from ..engine.engine import load
    from ..errors import EdgespecError
    from ..runtimes import BACKENDS, installed_backends

    formats = load_bundle(path).manifest.target.formats
    lines = ["exactness (a k-token verify against k one-token forwards, bit for bit, on this machine):"]
    for name in installed_backends():
        if BACKENDS[name].bundle_format not in formats:
            continue
        try:
            with load(path, backend=name, retune=retune) as engine:
                v = engine.opened.exactness
                refused = engine.opened.inexact_refusal
        except EdgespecError as e:
            lines.append(f"  {name:<12} cannot open: {e}")
            continue
        if v is None:
            lines.append(f"  {name:<12} no drafting configured, nothing to verify")
            continue
        how = "cached" if v.cached else "measured now"
        lines.append(f"  {name:<12} {v.describe()} [probe {v.probe_ms:.0f} ms, {how}]")
        if refused is not None:
            lines.append(f"  {'':<12} drafting off: {refused}")
    return lines


@cli_entry
def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="edgespec info", description="Show backends and a bundle.")
    p.add_argument("bundle", nargs="?", default=None,
                   help="bundle folder or .gguf file (a GGUF's bundle is built in the user cache on first use)")
    p.add_argument("--no-probe", dest="probe", action="store_false",
                   help="skip the exactness probe and the tuning of each configuration (they load the bundle; "
                        "cached after the first run)")
    p.add_argument("--retune", action="store_true", help="probe and measure again instead of reading the cache")
    args = p.parse_args(argv)
    print("\n".join(_cores()))
    print("backends:")
    print("\n".join(_backends()))
    if args.bundle:
        from ..exporters.gguf.bundles import resolve_bundle

        args.bundle = str(resolve_bundle(args.bundle))
        print("\n".join(_bundle(args.bundle)))
        if args.probe:
            lines, measured = _tuning(args.bundle, args.retune)
            print("\n".join(lines))
            # the tuning has just probed each candidate again: the listing reads those verdicts
            print("\n".join(_exactness(args.bundle, args.retune and not measured)))
    return 0
