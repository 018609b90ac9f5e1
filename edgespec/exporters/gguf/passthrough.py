"""GGUF in, GGUF out, without decoding a weight: the llama.cpp format of a GGUF source.

The target is the user's file itself, cloned (copy-on-write) or copied by the kernel, so the
bundle owns its weights and a later write to the user's file cannot change it; or requantized
file to file by llama.cpp's own quantizer when another precision is asked, which streams tensor
by tensor inside llama.cpp. So any block type llama.cpp runs exports, including those edgespec
cannot transcode to ONNX or OpenVINO. Only the direct-GGUF cache shares the user's file (a hard
link: a cache must not double the disk a model takes), recorded and checked at load.

A draft cut from a GGUF (kept layers, a VocabTrim head) is written tensor by tensor: each
tensor's bytes are read from the file, renamed or row-selected as they are (a quantized row is
whole blocks, so picking rows needs no requantization) and written out before the next one is
read, so the export's memory is about the largest tensor, never the model.

Beside a trimmed draft goes its full-vocabulary twin (`model.full.gguf`: the same layers and
blocks with the source's own tokenizer), which llama.cpp's server, Ollama and other loaders take
as a standalone draft (docs/deploy.md).
"""
from __future__ import annotations

import logging
import os
import shutil
from functools import partial
from pathlib import Path

import numpy as np

from ...bundle import Artifact
from ...errors import ExportError
from ...files import clone_file
from ...runtimes.llamacpp.runtime import EMBD_KEYS  # the metadata the runtime reads (imports no llama_cpp)
from .quantizer import EMBD_FILE, LLAMA_FTYPES, quantize
from .reader import read_span

__all__ = ["FULL_DRAFT_FILE", "copy_file", "write_draft", "write_input_embedding", "write_passthrough"]

logger = logging.getLogger(__name__)

FULL_DRAFT_FILE = "model.full.gguf"
# reader fields that are the file's own framing, not metadata to carry over
_FRAMING = ("GGUF.", "general.architecture")


def copy_file(src: Path, dst: Path, *, share: bool = False) -> dict | None:
    """`src` at `dst` without reading it into memory, owned by the bundle: a copy-on-write clone
    where the file system has them (no disk used, and a later write to the source leaves the
    bundle as it was), else a copy (kernel-side: shutil.copyfile uses sendfile / copy_file_range),
    which keeps the source's mtime. With `share` (the direct-GGUF cache, which must not double the
    disk a model takes) a hard link instead of the copy; then the linked file's size, mtime and
    sha256 are returned, for the manifest (Artifact.shared), and a load refuses the bundle once they
    changed and its content with them."""
    dst.unlink(missing_ok=True)
    if clone_file(src, dst):
        return None
    if share:
        from .hashes import link_hashed

        try:
            digest = link_hashed(src, dst)
        except OSError:  # another file system: copy
            pass
        else:
            st = dst.stat()
            return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    shutil.copyfile(src, dst)
    st = src.stat()
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))  # lets a twin of the same file find it (_copied)
    return None


def _copied(src: Path, bundle_dir: Path) -> Path | None:
    """The target's file in this bundle when it is a copy of `src` (the same size and mtime, as
    copy_file leaves it, and not `src` itself), so a draft's twin that is `src` again is linked to
    it inside the bundle instead of copied a second time."""
    own = bundle_dir / "target" / "model.gguf"
    try:
        a, b = own.stat(), src.stat()
    except OSError:
        return None
    same = (a.st_size, a.st_mtime_ns) == (b.st_size, b.st_mtime_ns) and (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino)
    return own if same else None


def _twin(src: Path, path: Path, job) -> None:
    """The full-vocabulary twin of an all-layer draft, which is the source itself: a link to the
    target's copy in this bundle when it is one (never read by edgespec, so never checked), else
    the source placed as copy_file places it."""
    own = _copied(src, job.bundle_dir)
    if own is None:
        copy_file(src, path, share=job.share_source)
        return
    path.unlink(missing_ok=True)
    os.link(own, path)


def _numpy_shape(t) -> tuple[int, ...]:
    return tuple(int(x) for x in reversed(t.shape))  # GGUF lists ne0 (the row length) first


def _read(fh, t) -> np.ndarray:
    """One tensor's bytes, read (not memory-mapped, so they leave the process with the array)."""
    return read_span(fh, int(t.data_offset), int(t.n_bytes), t.name)


def _rows(raw: np.ndarray, t, keep: np.ndarray) -> np.ndarray:
    """Rows `keep` of a 2-D tensor's bytes: each row is whole blocks of any type."""
    n_rows = _numpy_shape(t)[0]
    return np.ascontiguousarray(raw.reshape(n_rows, -1)[keep]).reshape(-1)


def _metadata(reader, arch: str, n_src_layers: int, layers: tuple[int, ...] | None) -> dict:
    """key -> (value, type, sub_type) of the source's metadata; per-layer arrays of the model's own
    `<arch>.` keys keep only the kept layers' entries."""
    from gguf import GGUFValueType

    out = {}
    for key, f in reader.fields.items():
        if key.startswith(_FRAMING):
            continue
        try:
            value = f.contents()
        except UnicodeDecodeError:
            raise ExportError(f"the GGUF's '{key}' holds text that is not UTF-8") from None
        kind = f.types[0]
        sub = f.types[-1] if kind == GGUFValueType.ARRAY else None
        if (layers is not None and key.startswith(f"{arch}.") and isinstance(value, list)
                and len(value) == n_src_layers):
            value = [value[i] for i in layers]
        out[key] = (value, kind, sub)
    return out


def _draft_metadata(reader, arch: str, spec, layers, keep, embed_scale: float, name: str) -> dict:
    from gguf import GGUFValueType as T

    meta = _metadata(reader, arch, spec.n_layers, layers)
    meta["general.name"] = (name, T.STRING, None)
    if layers is not None:
        meta[f"{arch}.block_count"] = (len(layers), T.UINT32, None)
        if "sliding_attention" in spec.layer_types:
            # per kept layer, so a layer-cut draft keeps each layer's own attention kind
            meta[f"{arch}.attention.sliding_window_pattern"] = (
                [spec.layer_types[i] == "sliding_attention" for i in layers], T.ARRAY, T.BOOL)
    if keep is not None:
        # the K-token model: no tokenizer (ids are fed as input embeddings), a K-row head
        meta = {k: v for k, v in meta.items() if not k.startswith("tokenizer.")}
        meta["tokenizer.ggml.model"] = ("none", T.STRING, None)
        meta[f"{arch}.vocab_size"] = (len(keep), T.UINT32, None)
        meta[EMBD_KEYS["file"]] = (EMBD_FILE, T.STRING, None)
        meta[EMBD_KEYS["tensor"]] = ("token_embd.weight", T.STRING, None)
        meta[EMBD_KEYS["scale"]] = (float(embed_scale), T.FLOAT32, None)
    return meta


def _plan(reader, layers, keep) -> list[tuple[str, object, np.ndarray | None]]:
    """(output name, source tensor, rows kept or None) in the order they are written."""
    by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in by_name:
        raise ExportError("the GGUF has no token embedding (token_embd.weight)")
    remap = {li: j for j, li in enumerate(layers)} if layers is not None else None
    plan = []
    for t in reader.tensors:
        name = t.name
        if name.startswith("blk.") and remap is not None:
            _, idx, rest = name.split(".", 2)
            if int(idx) not in remap:
                continue
            name = f"blk.{remap[int(idx)]}.{rest}"
        if keep is not None and name in ("token_embd.weight", "output.weight"):
            continue  # the trimmed head is written first, below
        plan.append((name, t, None))
    if keep is not None:
        # the K-token model's "embedding" is the head's kept rows (tied: the embedding's own)
        head = by_name.get("output.weight", by_name["token_embd.weight"])
        plan.insert(0, ("token_embd.weight", head, np.asarray(keep, dtype=np.int64)))
    return plan


def _write(path: Path, arch: str, meta: dict, plan, src: Path) -> None:
    """Header, metadata and tensor infos first, then each tensor read and written in turn."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    try:
        for key, (value, kind, sub) in meta.items():
            w.add_key_value(key, value, kind, sub_type=sub)
        for name, t, rows in plan:
            shape = _numpy_shape(t)
            if rows is not None:
                shape = (len(rows), *shape[1:])
            nbytes = int(t.n_bytes) // _numpy_shape(t)[0] * shape[0] if rows is not None else int(t.n_bytes)
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        with src.open("rb") as fh:
            for _, t, rows in plan:
                raw = _read(fh, t)
                w.write_tensor_data(_rows(raw, t, rows) if rows is not None else raw)
                del raw
    finally:
        w.close()


def write_draft(reader, src: Path, out: Path, spec, *, layers: tuple[int, ...] | None,
                keep: np.ndarray | None, embed_scale: float, name: str) -> None:
    """A draft GGUF cut from `src` (its open `reader`): layers `layers` (None: all) renumbered
    from 0, and with `keep` a K-row head of the source head's rows `keep`; the blocks are the
    source's own bytes."""
    from .reader import field

    arch = str(field(reader, "general.architecture", ""))
    meta = _draft_metadata(reader, arch, spec, layers, keep, embed_scale, name)
    _write(out, arch, meta, _plan(reader, layers, keep), src)


def write_input_embedding(reader, src: Path, out: Path) -> None:
    """The source's full input embedding, in its own block type, alone in a small GGUF (the
    llamacpp runtime looks rows up in it for a trimmed draft)."""
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    _write(out, "edgespec-embedding", {}, [("token_embd.weight", t, None)], src)


def _requantize(src: Path, dst: Path, precision: str) -> str:
    """llama.cpp's quantizer from `src` (any block types) to `precision`; its llama.cpp type name."""
    if precision not in LLAMA_FTYPES:
        raise ExportError(f"GGUF has no precision '{precision}' (available: {', '.join(LLAMA_FTYPES)})")
    qname, ftype = LLAMA_FTYPES[precision]
    quantize(src, dst, ftype, allow_requantize=True)
    return qname


def _source_precision(job) -> tuple[str, str]:
    m = job.source.model
    return m.precision or m.file_type.lower(), m.file_type


def write_passthrough(job, bar) -> Artifact:
    """The GGUF format of a GGUF source (`job`: exporters.export.ModelJob): `<role>/model.gguf`,
    the source's file or a cut of it, and for a trimmed draft its input embedding and its
    full-vocabulary twin."""
    folder = job.bundle_dir / job.role
    folder.mkdir(parents=True, exist_ok=True)
    have = _source_precision(job)[0]
    precision = None if job.precision in (None, "source", have) else job.precision  # None: the source's blocks
    if job.opts.layers is None and job.opts.vocab_keep is None:
        return _whole(job, folder / "model.gguf", precision, bar)
    return _cut(job, folder, precision, bar)


def _rel(job, path: Path) -> str:
    return str(path.relative_to(job.bundle_dir))


def _whole(job, out: Path, precision: str | None, bar) -> Artifact:
    """The whole source at `out`: its own file (copied, cloned or shared), or requantized."""
    have, ftype = _source_precision(job)
    src = job.source.path
    if precision is None:
        bar.set_postfix_str(f"copying the {job.role} GGUF ({src.stat().st_size / 2**30:.1f} GiB)")
        shared = copy_file(src, out, share=job.share_source)
        return Artifact(file=_rel(job, out), precision=have,
                        quantization={"method": "llama.cpp", "type": ftype, "passthrough": True,
                                      "standalone": _rel(job, out)}, shared=shared)
    bar.set_postfix_str(f"requantizing {job.role} to {precision}")
    qname = _requantize(src, out, precision)
    return Artifact(file=_rel(job, out), precision=precision,
                    quantization={"method": "llama.cpp", "type": qname, "requantized_from": ftype,
                                  "standalone": _rel(job, out)})


def _cut(job, folder: Path, precision: str | None, bar) -> Artifact:
    """A draft cut from the source (kept layers, a VocabTrim head) at `<folder>/model.gguf`; with a
    trimmed head also its full-vocabulary twin and its input embedding."""
    from .reader import open_gguf

    have, ftype = _source_precision(job)
    layers, keep, src = job.opts.layers, job.opts.vocab_keep, job.source.path
    bar.set_postfix_str(f"cutting {job.role} GGUF")
    reader = open_gguf(src)
    scale = float(np.sqrt(job.spec.hidden_size)) if job.spec.family.embed_scale else 1.0
    write = partial(write_draft, reader, src, spec=job.spec, layers=layers, embed_scale=scale,
                    name=f"{src.stem} ({job.role}, edgespec)")
    out = folder / "model.gguf"
    quant = {"method": "llama.cpp", "type": ftype}
    full = folder / FULL_DRAFT_FILE if keep is not None else out
    targets = [(out, keep)] + ([(full, None)] if keep is not None else [])
    for path, rows in targets:
        if rows is None and layers is None and precision is None:
            _twin(src, path, job)
        else:
            quant["type"] = _cut_file(write, path, rows, precision) or quant["type"]
    if keep is not None:
        write_input_embedding(reader, src, folder / EMBD_FILE)
        quant.update(input_embedding=EMBD_FILE, head="trimmed")
    quant["standalone"] = _rel(job, full)
    return Artifact(file=_rel(job, out), precision=precision or have, quantization=quant)


def _cut_file(write, path: Path, rows: np.ndarray | None, precision: str | None) -> str | None:
    """One cut file at `path` (`write(path, keep=rows)`: write_draft), its blocks the source's own,
    or written aside and requantized by llama.cpp to `precision`; the type it was requantized to."""
    if precision is None:
        write(path, keep=rows)
        return None
    staged = path.with_name(path.stem + ".src.gguf")
    write(staged, keep=rows)
    try:
        return _requantize(staged, path, precision)
    finally:
        staged.unlink(missing_ok=True)
