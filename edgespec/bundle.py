"""The bundle: one folder, one `edgespec.json` manifest describing every artifact in it.

Loading validates the manifest and checks that every file it names exists, so a broken
bundle fails at load with a one-line error instead of deep inside a backend.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .errors import BundleError

__all__ = [
    "MANIFEST",
    "SCHEMA_VERSION",
    "Artifact",
    "ModelEntry",
    "TokenizerInfo",
    "Manifest",
    "Bundle",
    "load_bundle",
    "staged_bundle_dir",
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


@dataclass(frozen=True)
class TokenizerInfo:
    file: str
    bos_token_id: int | None
    add_bos: bool  # prepend BOS ourselves (the tokenizer.json does not)
    stop_token_ids: list[int]
    chat_template: str | None
    chat_template_source: str  # "model", "family" or "none"


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

    @property
    def self_draft(self) -> bool:
        """Whether the draft is the target's own model without a layer cut (`--draft self`): its
        body is the target's, perhaps quantized differently, under a cheaper head."""
        d, sha = self.draft, self.target.source.get("sha256")
        return d is not None and not d.layers and sha is not None and d.source.get("sha256") == sha

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Manifest":
        try:
            if d.get("schema_version") != SCHEMA_VERSION:
                raise BundleError(
                    f"bundle schema version {d.get('schema_version')!r} is not supported "
                    f"(this edgespec reads version {SCHEMA_VERSION}); export the bundle again")

            def entry(e):
                if e is None:
                    return None
                e = dict(e)
                e["formats"] = {k: Artifact(**v) for k, v in e["formats"].items()}
                return ModelEntry(**e)

            target = entry(d["target"])
            if target is None:
                raise BundleError("broken manifest: the target entry is null")
            return cls(
                schema_version=d["schema_version"],
                model_type=d["model_type"],
                family=d["family"],
                base_model=bool(d["base_model"]),
                tokenizer=TokenizerInfo(**d["tokenizer"]),
                target=target,
                draft=entry(d.get("draft")),
                created_by=d.get("created_by", "edgespec"),
            )
        except (KeyError, TypeError) as e:
            raise BundleError(f"broken manifest: missing or unexpected field {e}") from None
        except (AttributeError, ValueError) as e:  # e.g. "formats": null, "target": "a string"
            raise BundleError(f"broken manifest: a field has the wrong type ({e})") from None


@dataclass(frozen=True)
class Bundle:
    """A loaded, validated bundle folder."""

    path: Path
    manifest: Manifest

    def file(self, rel: str) -> Path:
        return self.path / rel

    def formats(self) -> list[str]:
        return sorted(self.manifest.target.formats)

    def id_map(self) -> np.ndarray | None:
        d = self.manifest.draft
        return None if d is None or d.id_map is None else np.load(self.file(d.id_map))


def load_bundle(path: str | os.PathLike) -> Bundle:
    """Read and validate a bundle; every error is a one-line BundleError."""
    root = Path(path).expanduser()
    if not root.exists():
        raise BundleError(f"bundle not found: {root}")
    if not root.is_dir():
        raise BundleError(f"{root} is not a bundle folder (export one with `edgespec export`)")
    mf = root / MANIFEST
    if not mf.is_file():
        raise BundleError(f"{root} has no {MANIFEST}: not an edgespec bundle")
    try:
        data = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"broken manifest {mf}: {e}") from None
    if not isinstance(data, dict):
        raise BundleError(f"broken manifest {mf}: not a JSON object")
    manifest = Manifest.from_dict(data)
    files = [manifest.tokenizer.file]
    for entry in filter(None, (manifest.target, manifest.draft)):
        files += [a.file for a in entry.formats.values()]
        if entry.id_map:
            files.append(entry.id_map)
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        raise BundleError(f"bundle {root} is incomplete: missing {', '.join(missing)}")
    return Bundle(root, manifest)


@contextmanager
def staged_bundle_dir(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temp folder beside `out`; on success rename it into place, else remove it.

    A crash or error leaves no half-written bundle at `out`."""
    out = out.expanduser().resolve()
    if out.exists() and not force:
        raise BundleError(f"output path exists: {out}; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private; a bundle is an ordinary folder
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
