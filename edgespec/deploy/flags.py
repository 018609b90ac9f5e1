"""What one llama-server build accepts, read from its own `--help`.

llama.cpp renames its speculative flags between releases and keeps a removed flag in `--help` with
"the argument has been removed", or drops it so that the server refuses to start, or (the case its
users meet most) loads a draft that nothing uses because `--spec-type` was not given. edgespec
therefore never assumes a spelling: every flag it emits is looked up in the help text of the binary
that will run it, under the names llama.cpp has used for it, and a flag the build does not know is
an error that names it.
"""
from __future__ import annotations

import functools
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import DeployError

__all__ = ["ServerHelp", "parse_help", "read_help", "FLAG_NAMES"]

# what a flag is for -> its names, newest first (llama.cpp's common/arg.cpp, then the older names)
FLAG_NAMES: dict[str, tuple[str, ...]] = {
    "model": ("--model", "-m"),
    "host": ("--host",),
    "port": ("--port",),
    "ctx_size": ("--ctx-size", "-c"),
    "threads": ("--threads", "-t"),
    "threads_batch": ("--threads-batch", "-tb"),
    "parallel": ("--parallel", "-np"),
    "seed": ("--seed", "-s"),
    "metrics": ("--metrics",),
    "jinja": ("--jinja",),
    "chat_template_file": ("--chat-template-file",),
    "gpu_layers": ("--gpu-layers", "--n-gpu-layers", "-ngl"),
    "rpc": ("--rpc",),
    "repack": ("--repack",),
    "no_repack": ("--no-repack", "-nr"),
    "spec_type": ("--spec-type",),
    "draft_model": ("--spec-draft-model", "--model-draft", "-md"),
    "draft_n_max": ("--spec-draft-n-max", "--draft-max", "--draft-n", "--draft"),
    "draft_n_min": ("--spec-draft-n-min", "--draft-min", "--draft-n-min"),
    "draft_p_min": ("--spec-draft-p-min", "--draft-p-min"),
    "draft_threads": ("--spec-draft-threads", "--threads-draft", "-td"),
    "draft_threads_batch": ("--spec-draft-threads-batch", "--threads-batch-draft", "-tbd"),
    "draft_gpu_layers": ("--spec-draft-ngl", "--gpu-layers-draft", "--n-gpu-layers-draft", "-ngld"),
    "draft_device": ("--spec-draft-device", "--device-draft", "-devd"),
    "ngram_simple_size_n": ("--spec-ngram-simple-size-n",),
    "ngram_simple_size_m": ("--spec-ngram-simple-size-m",),
    "ngram_simple_min_hits": ("--spec-ngram-simple-min-hits",),
    "ngram_map_k_size_n": ("--spec-ngram-map-k-size-n",),
    "ngram_map_k_size_m": ("--spec-ngram-map-k-size-m",),
    "ngram_map_k_min_hits": ("--spec-ngram-map-k-min-hits",),
    "ngram_map_k4v_size_n": ("--spec-ngram-map-k4v-size-n",),
    "ngram_map_k4v_size_m": ("--spec-ngram-map-k4v-size-m",),
    "ngram_map_k4v_min_hits": ("--spec-ngram-map-k4v-min-hits",),
    "ngram_mod_n_match": ("--spec-ngram-mod-n-match",),
    "ngram_mod_n_min": ("--spec-ngram-mod-n-min",),
    "ngram_mod_n_max": ("--spec-ngram-mod-n-max",),
}
REMOVED = "the argument has been removed"
# an option line: the names (and value hint) from column 0, then its help after a run of spaces
_NAME = r"-{1,2}[A-Za-z0-9][^\s,]*"
_OPTION = re.compile(rf"^({_NAME}(?:,\s*{_NAME})*)(?:\s(\S.*?))?(?:\s{{2,}}(.*))?$")


@dataclass(frozen=True)
class ServerHelp:
    """The options of one llama-server build: every name it accepts (removed ones left out), each
    option's value hint, and the speculative types its `--spec-type` lists."""

    binary: str
    names: frozenset[str]
    hints: dict[str, str]
    spec_types: tuple[str, ...]
    removed: frozenset[str] = frozenset()

    def flag(self, what: str) -> str:
        """This build's spelling of the flag for `what` (a FLAG_NAMES key); a DeployError naming the
        flag when the build accepts none of its names (renamed or removed: never dropped quietly)."""
        names = FLAG_NAMES[what]
        for name in names:
            if name in self.names:
                return name
        gone = [n for n in names if n in self.removed]
        why = f" ({', '.join(gone)}: removed in this build)" if gone else ""
        raise DeployError(f"{self.binary} does not recognise {names[0]}{why}; its --help lists none of "
                          f"{', '.join(names)}. A newer or older llama.cpp renamed it: use the llama.cpp "
                          "edgespec builds (python -m edgespec.deploy), or say which flag replaces it")

    def has(self, what: str) -> bool:
        return any(n in self.names for n in FLAG_NAMES[what])

    def check_spec_type(self, spec_type: str) -> None:
        if spec_type not in self.spec_types:
            listed = ", ".join(self.spec_types) or "none"
            raise DeployError(f"{self.binary} has no speculative type {spec_type!r} (its --spec-type takes: {listed})")

    def check_args(self, args: Iterable[str]) -> None:
        """Every option in `args` is one this build accepts (for flags a user passes through)."""
        unknown = [a.split("=", 1)[0] for a in args
                   if a.startswith("-") and not _number(a) and a.split("=", 1)[0] not in self.names]
        if unknown:
            raise DeployError(f"{self.binary} does not recognise {', '.join(unknown)} (not in its --help)")


def _number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True


def _spec_types(hint: str) -> tuple[str, ...]:
    """`--spec-type`'s value hint lists the types: "none,draft-simple,..." or "[a|b]" or "{a,b}"."""
    return tuple(t for t in re.split(r"[,|{}\[\]\s]+", hint) if re.fullmatch(r"[a-z][a-z0-9-]*", t))


def parse_help(text: str, binary: str = "llama-server") -> ServerHelp:
    """The options `text` (llama-server's --help) lists, in llama.cpp's layout: an option's names from
    column 0 ("-t,    --threads N"), its help beside or below them, indented."""
    names: set[str] = set()
    removed: set[str] = set()
    hints: dict[str, str] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _OPTION.match(line)
        if m is None:
            continue
        own = [n.strip() for n in m.group(1).split(",")]
        hint = (m.group(2) or "").strip()
        # the help text: on the same line, or indented on the next
        help_ = m.group(3) or (lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1][:1].isspace() else "")
        (removed if REMOVED in help_ else names).update(own)
        for n in own:
            hints[n] = hint
    types = _spec_types(hints.get("--spec-type", ""))
    return ServerHelp(binary=binary, names=frozenset(names), hints=hints, spec_types=types,
                      removed=frozenset(removed))


@functools.lru_cache(maxsize=8)
def _help_text(binary: str, mtime_ns: int) -> str:
    try:
        done = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DeployError(f"cannot run {binary} --help: {e}") from None
    text = done.stdout + done.stderr
    if done.returncode != 0 or "--port" not in text:
        first = text.strip().splitlines()[-1] if text.strip() else f"exit {done.returncode}"
        raise DeployError(f"{binary} --help did not list llama-server's options ({first})")
    return text


def read_help(binary: str | Path) -> ServerHelp:
    """The options of the llama-server at `binary`, from its --help (read once per file version)."""
    path = Path(binary)
    try:
        mtime = path.stat().st_mtime_ns
    except OSError as e:
        raise DeployError(f"llama-server not found at {path}: {e.strerror or e}") from None
    return parse_help(_help_text(str(path), mtime), str(path))
