"""The inputs the hostile cases start from, built once in a work folder: tiny random-weight models
(edgespec/exporters/tiny.py) as an ONNX bundle with an int4 self-draft and as a GGUF, a private
cache folder, and helpers to run the CLI, hash a folder and find what a run left behind."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from outcome import Outcome, from_process

__all__ = ["Fixtures", "build_fixtures", "tree_digest", "leftovers", "rewrite_gguf", "claim_array"]

REPO = Path(__file__).resolve().parents[2]
# names a run leaves beside its output while it works: staging folders, moved-aside bundles,
# partial downloads and cache writes
_TRANSIENT = (".stage-", ".old-", ".part", ".tmp")


@dataclass
class Fixtures:
    work: Path
    bundle: Path  # ONNX target with an int4 self-draft (rolls back often)
    gguf: Path  # a tiny Llama as a GGUF file
    cache: Path  # EDGESPEC_CACHE of every run
    timeout_s: float

    def copy(self, name: str, src: Path | None = None) -> Path:
        dst = self.work / "cases" / name
        shutil.rmtree(dst, ignore_errors=True)
        dst.parent.mkdir(parents=True, exist_ok=True)
        src = src or self.bundle
        if src.is_dir():
            shutil.copytree(src, dst, symlinks=True)
        else:
            shutil.copy2(src, dst)
        return dst

    def manifest(self, bundle: Path) -> dict:
        return json.loads((bundle / "edgespec.json").read_text())

    def write_manifest(self, bundle: Path, data: dict) -> None:
        (bundle / "edgespec.json").write_text(json.dumps(data))

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "EDGESPEC_CACHE": str(self.cache), "PYTHONPATH": str(REPO), **extra}

    def cli(self, *args: str, stdin: bytes | None = None, ok_codes: tuple[int, ...] = (0,),
            timeout_s: float | None = None, env: dict | None = None) -> Outcome:
        try:
            proc = subprocess.run([sys.executable, "-m", "edgespec", *args], input=stdin, capture_output=True,
                                  timeout=timeout_s or self.timeout_s, env=env or self.env(), cwd=self.work)
        except subprocess.TimeoutExpired:
            return from_process(None, "")
        return from_process(proc.returncode, proc.stderr.decode("utf-8", "replace"), ok_codes)


def build_fixtures(work: Path, timeout_s: float) -> Fixtures:
    sys.path.insert(0, str(REPO))
    import torch

    from edgespec.bundle import load_bundle
    from edgespec.exporters.export import ExportConfig, export_bundle
    from edgespec.exporters.tiny import make_model
    from edgespec.models.families import CHATML_TEMPLATE

    torch.set_num_threads(1)  # tiny matmuls: more threads only contend
    zoo = work / "zoo"
    qwen2 = make_model("qwen2", zoo / "qwen2", chat_template=CHATML_TEMPLATE)
    bundle = export_bundle(ExportConfig(output=zoo / "qwen2.bundle", target=qwen2, draft_precision="int4"))
    llama = make_model("llama", zoo / "llama")
    gguf_bundle = export_bundle(ExportConfig(output=zoo / "llama-gguf.bundle", target=llama, draft=None,
                                             formats=("gguf",)))
    gguf = gguf_bundle / load_bundle(gguf_bundle).manifest.target.formats["gguf"].file
    (work / "cache").mkdir(parents=True, exist_ok=True)
    return Fixtures(work, bundle, gguf, work / "cache", timeout_s)


def tree_digest(path: Path) -> str:
    """One hash of every name and byte under `path` (a file or a folder): data lost shows as a change."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        h.update(str(f.relative_to(path.parent)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def leftovers(folder: Path, name: str = "") -> list[str]:
    """Names under `folder` a finished run should not have left (staging, moved-aside, partial);
    `name`: only those of the output called so (`.NAME.<pid>.stage-*`)."""
    if not folder.exists():
        return []
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if any(t in p.name for t in _TRANSIENT) and name in p.name)


def rewrite_gguf(src: Path, dst: Path, changes: dict) -> None:
    """`src` written again as `dst` with metadata `changes`: key -> (value, type, array item type);
    a value of None drops the key."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in changes:
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for key, (value, kind, sub) in changes.items():
        if value is not None:
            w.add_key_value(key, value, kind, sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=[int(x) for x in reversed(t.shape)], raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def claim_array(path: Path, key: str, count: int) -> None:
    """Make the metadata array `key` claim `count` entries, in place."""
    data = bytearray(path.read_bytes())
    at = data.index(key.encode()) + len(key)
    struct.pack_into("<Q", data, at + 8, count)
    path.write_bytes(bytes(data))
