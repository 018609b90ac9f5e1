"""The llama-server command for a GGUF target (and its draft): every flag that decides what runs,
spelled for the build that will run it (flags.py), nothing left to a default that a release may
change.

`server_argv` is the low level (a model file, a speculative setting, context, threads), used by the
bench's peer; `deploy_command` resolves a bundle into it: the target's GGUF, the draft's standalone
GGUF (`quantization.standalone` in the manifest), the chat template, and RPC workers that hold
the target's layers.
"""
from __future__ import annotations

import hashlib
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from ..cpus import usable_cpu_count
from ..errors import DeployError
from .flags import ServerHelp

__all__ = ["SpecSettings", "ServerOptions", "ServerCommand", "DeployConfig", "SPEC_CHOICES", "NGRAM_TYPES",
           "server_argv", "deploy_options", "deploy_command", "default_threads", "bundle_models", "draft_cost"]

NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod")
SPEC_CHOICES = ("auto", "none", "draft-simple", *NGRAM_TYPES)
# each n-gram type's settings: the flag (flags.FLAG_NAMES key) and llama.cpp's current default,
# written out so that a release changing a default does not change what runs
NGRAM_SETTINGS: dict[str, tuple[tuple[str, int], ...]] = {
    "ngram-simple": (("ngram_simple_size_n", 12), ("ngram_simple_size_m", 48), ("ngram_simple_min_hits", 1)),
    "ngram-map-k": (("ngram_map_k_size_n", 12), ("ngram_map_k_size_m", 48), ("ngram_map_k_min_hits", 1)),
    "ngram-map-k4v": (("ngram_map_k4v_size_n", 12), ("ngram_map_k4v_size_m", 48), ("ngram_map_k4v_min_hits", 1)),
    "ngram-mod": (("ngram_mod_n_match", 24), ("ngram_mod_n_min", 48), ("ngram_mod_n_max", 64)),
}
DEFAULT_CONTEXT = 4096  # edgespec's own default context
# a draft model's settings: llama.cpp's own defaults in the pinned release, written out so that a
# release changing them changes nothing here
DRAFT_N_MAX, DRAFT_N_MIN, DRAFT_P_MIN = 3, 0, 0.0
# above this share of the target's bytes per token a draft model cannot pay for itself: with k
# drafts a step costs 1 + k*c target tokens and yields at most k + 1 (docs/deploy.md)
MAX_DRAFT_COST = 0.5


def default_threads() -> int:
    """The cores this process may use (what edgespec's own runtimes default to)."""
    return usable_cpu_count()


@dataclass(frozen=True)
class SpecSettings:
    """llama-server's speculative decoding: its type, and for a draft model the longest draft per
    step, the shortest worth verifying, and the draft's least probability to go on drafting."""

    type: str = "none"  # "none", "draft-simple" or one of NGRAM_TYPES
    draft_n_max: int = DRAFT_N_MAX
    draft_n_min: int = DRAFT_N_MIN
    draft_p_min: float = DRAFT_P_MIN
    ngram: tuple[tuple[str, int], ...] = ()  # overrides of NGRAM_SETTINGS values, by flag key

    def __post_init__(self) -> None:
        if self.type not in ("none", "draft-simple", *NGRAM_TYPES):
            raise DeployError(f"unknown speculative type {self.type!r} (choose from none, draft-simple, "
                              f"{', '.join(NGRAM_TYPES)})")
        if not 1 <= self.draft_n_max <= 64 or not 0 <= self.draft_n_min <= self.draft_n_max:
            raise DeployError(f"draft lengths need 1 <= n_max <= 64 and 0 <= n_min <= n_max, got "
                              f"{self.draft_n_max} and {self.draft_n_min}")
        if not 0.0 <= self.draft_p_min <= 1.0:
            raise DeployError(f"draft p_min must be in [0, 1], got {self.draft_p_min}")
        known = dict(NGRAM_SETTINGS.get(self.type, ()))
        stray = [key for key, _ in self.ngram if key not in known]
        if stray:
            raise DeployError(f"{', '.join(stray)}: not a setting of {self.type} (its settings: "
                              f"{', '.join(known) or 'none'})")


@dataclass(frozen=True)
class ServerOptions:
    """One llama-server: its model (and draft), how it decodes, where it listens."""

    model: Path
    spec: SpecSettings = SpecSettings()
    draft: Path | None = None
    context: int = DEFAULT_CONTEXT
    threads: int = field(default_factory=default_threads)
    host: str = "127.0.0.1"
    port: int = 8080
    parallel: int | None = None  # None: llama-server's own choice
    rpc: tuple[str, ...] = ()
    chat_template_file: Path | None = None
    jinja: bool = True
    metrics: bool = True
    seed: int | None = None
    # llama.cpp's repacked weights (None: its default, on): their one-token kernels round apart from
    # its batches, so a speculative verify could turn greedy output from the target alone's
    repack: bool | None = None
    extra: tuple[str, ...] = ()  # more flags, passed through (checked against the build's --help)

    def __post_init__(self) -> None:
        if (self.spec.type == "draft-simple") != (self.draft is not None):
            raise DeployError("a draft model goes with --spec-type draft-simple and only with it: llama-server "
                              "loads a draft without using it unless the type says so")
        if self.context < 16 or self.threads < 1 or not 0 < self.port < 65536:
            raise DeployError(f"need context >= 16, threads >= 1 and a port in 1..65535; got {self.context}, "
                              f"{self.threads} and {self.port}")
        for worker in self.rpc:
            _check_address(worker)


def _check_address(worker: str) -> None:
    host, sep, port = worker.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DeployError(f"--rpc takes HOST:PORT[,HOST:PORT...], got {worker!r}")


def _spec_args(h: ServerHelp, spec: SpecSettings, draft: Path | None, threads: int, rpc: bool) -> list[str]:
    """The speculative flags, every one spelled out, even the type `none` (a build whose default
    type changed would otherwise draft where the command says it does not)."""
    h.check_spec_type(spec.type)
    args = [h.flag("spec_type"), spec.type]
    if spec.type == "draft-simple":
        args += [h.flag("draft_model"), str(draft), h.flag("draft_n_max"), str(spec.draft_n_max),
                 h.flag("draft_n_min"), str(spec.draft_n_min), h.flag("draft_p_min"), f"{spec.draft_p_min:g}",
                 h.flag("draft_threads"), str(threads), h.flag("draft_threads_batch"), str(threads)]
        if rpc:  # the draft stays on this machine: it is small, and its every step is latency
            args += [h.flag("draft_device"), "none", h.flag("draft_gpu_layers"), "0"]
    elif spec.type in NGRAM_SETTINGS:
        values = dict(NGRAM_SETTINGS[spec.type]) | dict(spec.ngram)
        for key, value in values.items():
            args += [h.flag(key), str(value)]
    return args


def server_argv(h: ServerHelp, o: ServerOptions) -> list[str]:
    """llama-server's argv for `o`, each flag in the spelling of the build `h` describes; a flag it
    does not know is a DeployError naming it."""
    argv = [h.binary, h.flag("model"), str(o.model), h.flag("host"), o.host, h.flag("port"), str(o.port),
            h.flag("ctx_size"), str(o.context), h.flag("threads"), str(o.threads),
            h.flag("threads_batch"), str(o.threads)]
    if o.parallel is not None:
        argv += [h.flag("parallel"), str(o.parallel)]
    if o.seed is not None:
        argv += [h.flag("seed"), str(o.seed)]
    if o.metrics:
        argv.append(h.flag("metrics"))
    if o.repack is not None:
        argv.append(h.flag("repack" if o.repack else "no_repack"))
    if o.jinja and h.has("jinja"):
        argv.append(h.flag("jinja"))
    if o.chat_template_file is not None:
        argv += [h.flag("chat_template_file"), str(o.chat_template_file)]
    if o.rpc:
        # every target layer onto the workers, split by the memory each reports
        argv += [h.flag("rpc"), ",".join(o.rpc), h.flag("gpu_layers"), "all"]
    argv += _spec_args(h, o.spec, o.draft, o.threads, bool(o.rpc))
    h.check_args(o.extra)
    return argv + list(o.extra)


@dataclass(frozen=True)
class DeployConfig:
    """What `edgespec deploy` was asked: the bundle and how to serve it."""

    bundle: str
    spec: str = "auto"  # one of SPEC_CHOICES
    draft_n_max: int = DRAFT_N_MAX
    draft_n_min: int = DRAFT_N_MIN
    draft_p_min: float = DRAFT_P_MIN
    context: int | None = None  # None: DEFAULT_CONTEXT, capped at the target's trained context
    threads: int | None = None  # None: the cores this process may use
    host: str = "127.0.0.1"
    port: int = 8080
    parallel: int | None = None
    rpc: tuple[str, ...] = ()
    # llama.cpp's repacked weights, off: a verify batch, one token and an RPC worker (which does not
    # repack) then round alike, so drafting and splitting keep the target's greedy text
    repack: bool = False
    extra: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.spec not in SPEC_CHOICES:
            raise DeployError(f"--spec must be one of {', '.join(SPEC_CHOICES)}, got {self.spec!r}")


@dataclass(frozen=True)
class ServerCommand:
    """A resolved llama-server command and why it is what it is."""

    argv: tuple[str, ...]
    options: ServerOptions
    notes: tuple[str, ...] = ()

    def shell(self) -> str:
        """The command as a shell line, one flag (and its value) per line."""
        groups: list[list[str]] = [[self.argv[0]]]
        for arg in self.argv[1:]:
            if arg.startswith("-") and not arg.lstrip("-").replace(".", "", 1).isdigit():
                groups.append([])
            groups[-1].append(arg)
        return " \\\n    ".join(" ".join(shlex.quote(a) for a in g) for g in groups)


def bundle_models(bundle) -> tuple[Path, Path | None, bool]:
    """(the target's GGUF, the draft's standalone GGUF or None, whether that draft is the target
    itself) of a loaded bundle; a DeployError when the target has no GGUF."""
    m = bundle.manifest
    art = m.target.formats.get("gguf")
    if art is None:
        raise DeployError(f"{bundle.path.name} has no GGUF target (formats: {', '.join(sorted(m.target.formats))}); "
                          "llama-server runs GGUF: export with --format gguf")
    target = bundle.file(art.file)
    d = m.draft.formats.get("gguf") if m.draft is not None else None
    if d is None:
        return target, None, False
    quant = d.quantization or {}
    # a draft with the whole vocabulary is itself loadable alone; a trimmed one names its twin
    rel = quant.get("standalone") or (d.file if m.draft.id_map is None and "input_embedding" not in quant else None)
    if not rel:
        return target, None, False  # a trimmed head with no full-vocabulary twin: not loadable alone
    draft = bundle.file(rel)
    # `--draft self` without a cut or another precision: the draft file is the target file
    same = draft.exists() and target.exists() and os.path.samefile(draft, target)
    return target, draft, same


def draft_cost(target: Path, draft: Path) -> float:
    """The draft's weight bytes over the target's: what a draft token costs in target tokens where
    decoding streams its weights once per token (a CPU's case), from the GGUF files' sizes."""
    return draft.stat().st_size / max(target.stat().st_size, 1)


def _why_not_draft(target: Path, draft: Path | None, same: bool) -> str | None:
    """Why `auto` should not use the bundle's draft (None: use it)."""
    if draft is None:
        return "the bundle has no standalone draft"
    if same:
        return "the bundle's draft is the target itself, which saves nothing in llama-server"
    cost = draft_cost(target, draft)
    if cost > MAX_DRAFT_COST:
        return (f"the bundle's draft reads {cost:.0%} of the target's weight bytes per token (its head is most "
                "of the model), too dear to gain")
    return None


def _resolve_spec(cfg: DeployConfig, target: Path, draft: Path | None,
                  same: bool) -> tuple[SpecSettings, Path | None, list[str]]:
    notes: list[str] = []
    kind = cfg.spec
    if kind == "auto":
        why = _why_not_draft(target, draft, same)
        kind = "draft-simple" if why is None else "ngram-simple"
        if why is not None:
            notes.append(f"{why}; drafting from the context instead (ngram-simple). A cheaper draft: export with "
                         "--draft-layers N or --draft SMALL.gguf of the same tokenizer")
    if kind == "draft-simple" and draft is None:
        raise DeployError("--spec draft-simple needs a standalone draft GGUF in the bundle (export with --format gguf "
                          "and a draft)")
    if kind == "draft-simple" and same:
        notes.append("the draft is the target itself: every drafted token costs a target forward")
    spec = SpecSettings(type=kind, draft_n_max=cfg.draft_n_max, draft_n_min=cfg.draft_n_min,
                        draft_p_min=cfg.draft_p_min)
    return spec, (draft if kind == "draft-simple" else None), notes


def _chat_template(bundle) -> tuple[Path | None, str | None]:
    """The chat template file llama-server should use, when the bundle's is not the GGUF's own
    (a base model's family template): written once under edgespec's cache, named by its content."""
    tok = bundle.manifest.tokenizer
    if tok.chat_template is None:
        return None, "the bundle has no chat template: /v1/chat/completions uses llama-server's fallback"
    if tok.chat_template_source == "model":
        return None, None  # the GGUF carries it; llama-server reads it from there
    from ..models.catalog import cache_dir

    digest = hashlib.sha256(tok.chat_template.encode()).hexdigest()[:16]
    path = cache_dir() / "deploy" / f"chat-template-{digest}.jinja"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(tok.chat_template)
        os.replace(tmp, path)
    return path, f"chat template: the bundle's ({tok.chat_template_source}), written to {path}"


def deploy_options(cfg: DeployConfig) -> tuple[ServerOptions, tuple[str, ...]]:
    """What serves `cfg.bundle` (its models, speculative type, context, threads, chat template) and
    why, decided from the bundle alone: a bad bundle fails here, before any llama.cpp is looked for."""
    from ..bundle import load_bundle

    bundle = load_bundle(cfg.bundle)
    target, draft, same = bundle_models(bundle)
    spec, draft, notes = _resolve_spec(cfg, target, draft, same)
    trained = bundle.manifest.target.context_length
    context = cfg.context or min(DEFAULT_CONTEXT, trained or DEFAULT_CONTEXT)
    template, note = _chat_template(bundle)
    notes += [note] if note else []
    opts = ServerOptions(model=target, spec=spec, draft=draft, context=context,
                         threads=cfg.threads or default_threads(), host=cfg.host, port=cfg.port,
                         parallel=cfg.parallel, rpc=cfg.rpc, chat_template_file=template, repack=cfg.repack,
                         extra=cfg.extra)
    return opts, tuple(notes)


def deploy_command(cfg: DeployConfig, h: ServerHelp) -> ServerCommand:
    """The llama-server command that serves `cfg.bundle` on the build `h` describes."""
    opts, notes = deploy_options(cfg)
    return ServerCommand(argv=tuple(server_argv(h, opts)), options=opts, notes=notes)
