"""The bundle: one folder, one `edgespec.json` manifest describing every artifact in it.

Loading validates the manifest and checks that every file it names exists, so a broken
bundle fails at load with a one-line error instead of deep inside a backend.
"""
from __future__ import annotations

import json
import logging
import os
import re
import typing
from dataclasses import MISSING as _MISSING
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import numpy as np

from .checks import is_int
from .errors import BundleError
from .files import path_problem

__all__ = [
    "MANIFEST",
    "SCHEMA_VERSION",
    "Artifact",
    "ModelEntry",
    "TokenizerInfo",
    "DraftHeadEntry",
    "Manifest",
    "Bundle",
    "load_bundle",
    "inside_bundle",
    "read_manifest",
    "check_shared",
]

logger = logging.getLogger(__name__)
MANIFEST = "edgespec.json"
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Artifact:
    """One model file in one format."""

    file: str  # relative to the bundle
    precision: str  # fp32, fp16, int8, int4
    quantization: dict[str, Any] | None = None  # method, bits, block size...
    # the file is a hard link to the user's own (a GGUF run directly, cached without a second
    # copy): its size, mtime and sha256 when linked, checked at load (check_shared)
    shared: dict[str, Any] | None = None


@dataclass(frozen=True)
class ModelEntry:
    """Target or draft: its artifacts per format and what it was made from."""

    formats: dict[str, Artifact]
    n_layers: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int  # rows of this model's LM head (K for a trimmed draft)
    source: dict[str, Any] = field(default_factory=dict)  # name, sha256, kind
    layers: list[int] | None = None  # kept target layers for a layer-cut draft
    id_map: str | None = None  # .npy file: draft id -> target id (trimmed heads)
    vocab_info: dict[str, Any] | None = None  # K, coverage, calibration source
    context_length: int | None = None  # trained context of the source model (None: not recorded)


@dataclass(frozen=True)
class TokenizerInfo:
    file: str
    bos_token_id: int | None
    add_bos: bool  # prepend BOS ourselves (the tokenizer.json does not)
    stop_token_ids: list[int]
    chat_template: str | None
    chat_template_source: str  # "model", "family" or "none"


@dataclass(frozen=True)
class DraftHeadEntry:
    """A trained draft head (`edgespec distill`, training/draft_head.py): one ONNX file every
    ONNX-reading backend runs (onnxruntime, OpenVINO), on the target's final hidden rows, ending in
    the draft's VocabTrim head; and how it was trained."""

    file: str  # the head's .onnx, relative to the bundle
    k: int  # draft vocabulary it predicts over (the draft's id map)
    hidden_size: int  # of the target's hidden rows it reads and writes
    feature_layer: str  # which hidden rows: "final_norm" (after the target's final norm)
    inner_size: int
    training_tokens: int  # positions trained on
    held_out_tokens: int
    train_minutes: float  # the budget asked for
    train_seconds: float  # spent training
    data_seconds: float  # spent making the data with the target
    held_out_agreement: float  # top-1 agreement with the target's greedy token, first draft
    held_out_agreement_chained: float  # second draft, fed the head's own feature
    calibration: str  # "built-in" or "built-in+FILE"
    peak_rss_mb: float  # peak resident memory of the distillation


@dataclass(frozen=True)
class Manifest:
    schema_version: int
    model_type: str
    family: str
    base_model: bool  # no chat template of its own: chat uses the family's
    tokenizer: TokenizerInfo
    target: ModelEntry
    draft: ModelEntry | None
    created_by: str = "edgespec"
    draft_head: DraftHeadEntry | None = None

    @property
    def self_draft(self) -> bool:
        """Whether the draft is the target's own model without a layer cut (`--draft self`): its
        body is the target's, perhaps quantized differently, under a cheaper head."""
        d, sha = self.draft, self.target.source.get("sha256")
        return d is not None and not d.layers and sha is not None and d.source.get("sha256") == sha

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False)

    @classmethod
    def from_dict(cls, d: Any) -> Manifest:
        """A manifest from parsed JSON; any wrong value is a one-line BundleError naming the field."""
        if not isinstance(d, dict):
            raise BundleError("broken manifest: not a JSON object")
        version = d.get("schema_version")
        if type(version) is not int or version != SCHEMA_VERSION:  # `true == 1` in Python
            raise BundleError(
                f"bundle schema version {version!r} is not supported "
                f"(this edgespec reads version {SCHEMA_VERSION}); export the bundle again")
        tok = _build(TokenizerInfo, d.get("tokenizer"), "tokenizer")
        target = _entry(d.get("target"), "target")
        if target is None:
            raise BundleError("broken manifest: the target entry is null")
        head = d.get("draft_head")
        head = None if head is None else _build(DraftHeadEntry, head, "draft_head")
        m = _build(cls, d, "manifest", tokenizer=tok, target=target, draft=_entry(d.get("draft"), "draft"),
                   draft_head=head)
        _check_values(m)
        return m


def _entry(e: Any, where: str) -> ModelEntry | None:
    if e is None:
        return None
    if not isinstance(e, dict):
        raise BundleError(f"broken manifest: {where} must be an object, got {_json(e)}")
    formats = e.get("formats")
    if not isinstance(formats, dict) or not formats:
        raise BundleError(f"broken manifest: {where}.formats must be an object naming at least one format")
    arts = {name: _build(Artifact, a, f"{where}.formats.{_key(name)}") for name, a in formats.items()}
    return _build(ModelEntry, e, where, formats=arts)


def _describe(hint: Any) -> str:
    """A JSON reader's name for a type hint: 'a list of integers', 'a string or null'."""
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if hint is type(None):
        return "null"
    if args and origin not in (list, dict):  # a union
        return " or ".join(_describe(a) for a in args)
    if origin is list:
        return f"a list of {_describe(args[0]).removeprefix('an ').removeprefix('a ')}s"
    if origin is dict or hint is dict:
        return "an object"
    return {bool: "true or false", int: "an integer", str: "a string", float: "a number"}.get(hint, "an object")


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a JSON value has the type a manifest field is annotated with."""
    if hint is Any:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if args and origin not in (list, dict):  # a union such as `str | None`
        return any(_conforms(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is int:  # bool is an int subclass, but `true` is not a layer count
        return is_int(value)
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_conforms(k, args[0]) and _conforms(v, args[1])
                                               for k, v in value.items())
    return isinstance(value, hint)


def _build(kind: type, d: Any, where: str, **built: Any) -> Any:
    """`kind(**d)` after checking every field's presence and JSON type (`built`: nested values
    already made into dataclasses)."""
    if not isinstance(d, dict):
        raise BundleError(f"broken manifest: {where} must be an object, got {_json(d)}")
    names = [f.name for f in fields(kind)]
    unexpected = [k for k in d if k not in names]
    if unexpected:
        raise BundleError(f"broken manifest: unexpected field {where}.{_key(unexpected[0])}")
    hints = typing.get_type_hints(kind)
    values = {**d, **built}
    for f in fields(kind):
        if f.name not in values:
            if f.default is _MISSING and f.default_factory is _MISSING:
                raise BundleError(f"broken manifest: missing field {where}.{f.name}")
        elif f.name not in built and not _conforms(values[f.name], hints[f.name]):
            raise BundleError(f"broken manifest: {where}.{f.name} must be {_describe(hints[f.name])}, "
                              f"got {_json(values[f.name])}")
    return kind(**values)


def _key(name: str) -> str:
    """A manifest key as it may appear in a one-line error: plain when it is a plain name,
    JSON-quoted (newlines escaped, long keys cut) when a broken manifest put anything else there."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]{1,40}", name) else _json(name)


def _json(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=True, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_values(m: Manifest) -> None:
    """Ranges and paths the types cannot say: sizes are positive, ids are not negative, and
    every file is a relative path that stays inside the bundle."""
    tok = m.tokenizer
    ids = [*tok.stop_token_ids, *([tok.bos_token_id] if tok.bos_token_id is not None else [])]
    if any(i < 0 for i in ids):
        raise BundleError("broken manifest: tokenizer token ids must not be negative")
    check_relative(tok.file, "tokenizer.file")
    for where, e in (("target", m.target), ("draft", m.draft)):
        if e is not None:
            _check_model_values(e, where)
    if m.draft_head is not None:
        check_relative(m.draft_head.file, "draft_head.file")
        if m.draft is None:
            raise BundleError("broken manifest: a draft_head needs the draft whose head it ends in")
        for name in ("k", "hidden_size", "inner_size"):
            if getattr(m.draft_head, name) < 1:
                raise BundleError(f"broken manifest: draft_head.{name} must be >= 1, got {getattr(m.draft_head, name)}")


def _check_model_values(e: ModelEntry, where: str) -> None:
    """One model entry's ranges and files (`where`: "target" or "draft")."""
    for name in ("n_layers", "n_kv_heads", "head_dim", "vocab_size"):
        if getattr(e, name) < 1:
            raise BundleError(f"broken manifest: {where}.{name} must be >= 1, got {getattr(e, name)}")
    if e.context_length is not None and e.context_length < 1:
        raise BundleError(f"broken manifest: {where}.context_length must be >= 1, got {e.context_length}")
    if e.layers is not None and any(i < 0 for i in e.layers):
        raise BundleError(f"broken manifest: {where}.layers must not hold negative indices")
    for fmt, a in e.formats.items():
        check_relative(a.file, f"{where}.formats.{_key(fmt)}.file")
    if e.id_map is not None:
        check_relative(e.id_map, f"{where}.id_map")


def check_relative(rel: str, where: str) -> str:
    """`rel` if it is a relative path without `..` (on POSIX and Windows), else a BundleError:
    a bundle must not name files outside its folder."""
    parts = re.split(r"[\\/]", rel)
    if (not rel.strip() or "\0" in rel or PurePosixPath(rel).is_absolute() or PureWindowsPath(rel).drive
            or rel.startswith(("/", "\\")) or ".." in parts):
        raise BundleError(f"broken manifest: {where} must be a relative path inside the bundle, got {_json(rel)}")
    return rel


def inside_bundle(root: Path, rel: str, where: str = "file") -> Path:
    """`root / rel`, refusing a path that leaves `root` (`..`, absolute, or through a symlink)."""
    check_relative(rel, where)
    path = root / rel
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        raise BundleError(f"bundle {root}: {where} {rel!r} points outside the bundle folder") from None
    except (OSError, RuntimeError) as e:  # a symlink loop (Python before 3.13 raises RuntimeError)
        raise BundleError(f"bundle {root}: cannot resolve {where} {rel!r}: "
                          f"{getattr(e, 'strerror', None) or e}") from None
    return path


@dataclass(frozen=True)
class Bundle:
    """A loaded, validated bundle folder."""

    path: Path
    manifest: Manifest

    def file(self, rel: str) -> Path:
        return inside_bundle(self.path, rel)

    def formats(self) -> list[str]:
        return sorted(self.manifest.target.formats)

    def id_map(self) -> np.ndarray | None:
        d = self.manifest.draft
        if d is None or d.id_map is None:
            return None
        try:  # allow_pickle stays False: a bundle must not run code when it loads
            return np.load(self.file(d.id_map))
        except (OSError, ValueError) as e:
            raise BundleError(f"bundle {self.path}: cannot read the draft's id map {d.id_map}: {e}") from None


def read_manifest(root: Path) -> Manifest:
    """The manifest of the bundle folder `root`; a one-line BundleError if it is not one."""
    mf = root / MANIFEST
    if not mf.is_file():
        raise BundleError(f"{root} has no {MANIFEST}: not an edgespec bundle")
    try:
        data = json.loads(mf.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise BundleError(f"broken manifest {mf}: {str(e) or type(e).__name__}") from None
    except OSError as e:
        raise BundleError(f"cannot read {mf}: {e.strerror or e}") from None
    return Manifest.from_dict(data)


def load_bundle(path: str | os.PathLike) -> Bundle:
    """Read and validate a bundle; every error is a one-line BundleError."""
    root = Path(path).expanduser()
    problem = path_problem(root)
    if problem == "missing":
        raise BundleError(f"bundle not found: {root}")
    if problem is not None:
        raise BundleError(f"{root} is {problem}, not a bundle folder")
    if not root.is_dir():
        raise BundleError(f"{root} is not a bundle folder (export one with `edgespec export`)")
    manifest = read_manifest(root)
    files = [("tokenizer.file", manifest.tokenizer.file)]
    for where, entry in (("target", manifest.target), ("draft", manifest.draft)):
        if entry is None:
            continue
        files += [(f"{where}.formats.{fmt}.file", a.file) for fmt, a in entry.formats.items()]
        if entry.id_map:
            files.append((f"{where}.id_map", entry.id_map))
    if manifest.draft_head is not None:
        files.append(("draft_head.file", manifest.draft_head.file))
    missing = [rel for where, rel in files if not inside_bundle(root, rel, where).is_file()]
    if missing:
        raise BundleError(f"bundle {root} is incomplete: missing {', '.join(missing)}")
    check_shared(root, manifest)
    return Bundle(root, manifest)


def check_shared(root: Path, manifest: Manifest) -> None:
    """Refuse a bundle whose file shared with the user's (Artifact.shared, a hard link) changed
    since: the draft beside it was cut from the old weights. A changed size or mtime alone (a
    `touch`) is forgiven when the content still has the recorded sha256."""
    for where, entry in (("target", manifest.target), ("draft", manifest.draft)):
        for a in (entry.formats.values() if entry is not None else ()):
            if a.shared is None:
                continue
            path = inside_bundle(root, a.file, f"{where} file")
            st = path.stat()
            if [st.st_size, st.st_mtime_ns] == [a.shared.get("size"), a.shared.get("mtime_ns")]:
                continue
            from .models.catalog import file_sha256

            if file_sha256(path) != a.shared.get("sha256"):
                raise BundleError(f"bundle {root}: {a.file} is the GGUF it was built from (a hard link), and that "
                                  "file was overwritten since; run the GGUF again (its bundle is rebuilt) or "
                                  "export it with `edgespec export`")
