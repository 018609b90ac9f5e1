"""The GGUF format writer: weights → GGUF with the `gguf` package, quantized by llama.cpp.

Why gguf's GGUFWriter and not llama.cpp's convert_hf_to_gguf.py: the converter ships only
inside the llama-cpp-python sdist (no wheel installs it), reads only HF folders from disk,
and cannot write what edgespec derives in memory (layer-cut drafts, VocabTrim heads, GGUF
sources that transformers already dequantized). GGUFWriter writes numpy arrays, and gguf's
own TensorNameMap gives the llama.cpp tensor names per architecture, so the per-family
knowledge here is a few metadata keys; what differs by family (the architecture name, q/k row
order, Llama 3's `rope_freqs`, norm offsets) is read from the family's row (models/families.py).
Quantization (Q8_0, Q4_K_M) is llama.cpp's own `llama_model_quantize`, so the quantized
files are the ones llama.cpp's quantize tool would make.

Precision: fp32 → F32, fp16 → F16, int8 → Q8_0, int4 → Q4_K_M. A GGUF source is never decoded
here: gguf/passthrough.py copies it (or requantizes it file to file) and cuts drafts from it.

A VocabTrim draft (K kept tokens) is written as a model whose vocabulary *is* the K tokens
(no tokenizer: `tokenizer.ggml.model = none`), so llama.cpp computes a K-row head; its full
input embedding goes beside it (`model.embd.gguf`) and the llamacpp runtime feeds it input
embeddings of target ids through the batch's `embd` field (runtimes/llamacpp/runtime.py).
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ...bundle import Artifact
from ...errors import ExportError
from ...runtimes.llamacpp.runtime import EMBD_KEYS  # the metadata the runtime reads (imports no llama_cpp)
from .quantizer import EMBD_FILE, LLAMA_FTYPES, precision_of_gguf, quantize

__all__ = ["write_gguf", "LLAMA_FTYPES", "precision_of_gguf", "quantize", "EMBD_FILE"]

logger = logging.getLogger(__name__)

_NORM_SUFFIXES = ("norm.weight",)


def write_gguf(job, bar) -> Artifact:
    """Write `job` (exporters.export.ModelJob) as `<role>/model.gguf`; return its manifest entry."""
    if job.source.kind == "gguf":  # the file's own blocks, copied or cut, never decoded
        from .passthrough import write_passthrough

        return write_passthrough(job, bar)
    out = job.bundle_dir / job.role / "model.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    precision = job.precision or "fp32"
    if precision not in LLAMA_FTYPES:
        raise ExportError(f"GGUF has no precision '{precision}' (available: {', '.join(LLAMA_FTYPES)})")
    qname, ftype = LLAMA_FTYPES[precision]
    bar.set_postfix_str(f"writing {job.role} GGUF")
    trimmed = job.opts.vocab_keep is not None
    if precision in ("fp32", "fp16"):
        _write(job, out, half=precision == "fp16")
        quant = None
    else:
        tmp = out.with_name("model.f32.gguf")
        _write(job, tmp, half=False)
        bar.set_postfix_str(f"quantizing {job.role} to {qname}")
        try:
            quantize(tmp, out, ftype)
        finally:
            tmp.unlink(missing_ok=True)
        quant = {"method": "llama.cpp", "type": qname}
    if trimmed:
        _write_input_embedding(job, out.parent / EMBD_FILE, precision)
        quant = dict(quant or {}, input_embedding=EMBD_FILE, head="trimmed")
    return Artifact(file=_rel(out, job), precision=precision, quantization=quant)


def _rel(path: Path, job) -> str:
    return str(path.relative_to(job.bundle_dir))


# -- writing ------------------------------------------------------------------------------
def _arch(job) -> str:
    arch = job.spec.family.gguf_arch
    if arch is None:
        raise ExportError(f"the {job.spec.family.name} family cannot be written as GGUF yet")
    return arch


def _rope(spec, layer_type: str) -> tuple[float, float]:
    """(freq_base, freq_scale) that reproduce transformers' inv_freq for `layer_type`;
    a non-geometric table (llama3, yarn scaling) has no llama.cpp equivalent here."""
    inv, attn_scale = spec.rope[layer_type]
    inv = np.asarray(inv, dtype=np.float64)
    d = 2 * len(inv)
    base = float(np.exp(-np.log(inv[1] / inv[0]) * d / 2)) if len(inv) > 1 else 10000.0
    scale = float(inv[0])
    ref = scale * base ** (-np.arange(0, d, 2) / d)
    if not np.allclose(inv, ref, rtol=1e-4) or abs(attn_scale - 1.0) > 1e-6:
        raise ExportError(f"this model's RoPE scaling ({layer_type}) cannot be written as GGUF yet")
    # inv_freq is float32: 1e6 comes back as 999999.6, so keep 6 significant digits
    return float(f"{base:.6g}"), float(f"{scale:.6g}")


def _rope_theta(cfg) -> float | None:
    """The unscaled RoPE base of a transformers config (v4: rope_theta; v5: rope_parameters)."""
    theta = getattr(cfg, "rope_theta", None)
    params = getattr(cfg, "rope_parameters", None)
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    return float(theta) if theta is not None else None


def _rope_freqs(job) -> tuple[float, np.ndarray] | None:
    """(freq_base, rope_freqs) for a table llama.cpp reproduces only through per-dimension divisors
    (Llama 3.1+ scaling): llama.cpp's converter stores them as `rope_freqs.weight`, which ggml_rope_ext
    applies as freq_factors, theta_i = pos * base^(-2i/d) / rope_freqs[i]. None: the table is geometric."""
    spec, cfg = job.spec, job.source.model.config
    if not spec.family.gguf.rope_freqs or "full_attention" not in spec.rope:
        return None
    inv, attn_scale = spec.rope["full_attention"]
    theta = _rope_theta(getattr(cfg, "text_config", None) or cfg)
    if theta is None or abs(attn_scale - 1.0) > 1e-6:
        return None
    d = 2 * len(inv)
    # transformers' own unscaled table (float32 arange / d, float32 power), so unscaled dims give 1 exactly
    plain = np.float32(1.0) / (np.float32(theta) ** (np.arange(0, d, 2).astype(np.float32) / np.float32(d)))
    factors = plain.astype(np.float64) / np.asarray(inv, dtype=np.float64)
    if np.allclose(factors, 1.0, rtol=0, atol=1e-6):
        return None
    return theta, factors.astype(np.float32)


def _hparams(w, job, arch: str, n_layers: int, layers: tuple[int, ...], freqs) -> None:
    spec, cfg = job.spec, job.source.model.config
    cfg = getattr(cfg, "text_config", None) or cfg
    # llama.cpp takes no query scale from the file: every architecture written here scales by 1/sqrt(head_dim)
    if abs(spec.query_scale - spec.head_dim ** -0.5) > 1e-9:
        raise ExportError(f"llama.cpp's {arch} scales queries by 1/sqrt(head_dim); this model does not")
    w.add_name(f"{job.source.path.stem} ({job.role}, edgespec)")
    w.add_context_length(int(getattr(cfg, "max_position_embeddings", 4096)))
    w.add_embedding_length(spec.hidden_size)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(int(cfg.intermediate_size))
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    lts = [spec.layer_types[i] for i in layers]
    full = "full_attention" if "full_attention" in spec.rope else lts[0]
    base, scale = (freqs[0], 1.0) if freqs is not None else _rope(spec, full)
    w.add_rope_freq_base(base)
    if scale != 1.0:
        from gguf import RopeScalingType

        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(1.0 / scale)
    if spec.sliding_window and "sliding_attention" in spec.rope:
        swa_base, swa_scale = _rope(spec, "sliding_attention")
        if swa_scale != 1.0:
            raise ExportError("scaled RoPE on sliding-window layers cannot be written as GGUF yet")
        w.add_sliding_window(int(spec.sliding_window))
        w.add_rope_freq_base_swa(swa_base)
        # per kept layer, so a layer-cut draft keeps each layer's own attention kind
        w.add_array(f"{arch}.attention.sliding_window_pattern", [lt == "sliding_attention" for lt in lts])
    elif any(lt != "full_attention" for lt in lts):
        raise ExportError("this model's attention layer types cannot be written as GGUF yet")
    if spec.final_logit_softcap:
        w.add_final_logit_softcapping(float(spec.final_logit_softcap))


def _tokenizer(w, job, trimmed: bool, n_vocab: int) -> None:
    """A byte-level BPE tokenizer's, or none (ids are fed directly)."""
    if trimmed:
        w.add_tokenizer_model("none")
        w.add_vocab_size(n_vocab)
        return
    if not _hf_bpe_tokenizer(w, job.source.tokenizer, n_vocab):
        logger.warning("the %s GGUF carries no tokenizer (edgespec feeds token ids; other tools cannot "
                       "tokenize with it)", job.role)
        w.add_tokenizer_model("none")
        w.add_vocab_size(n_vocab)


def _token_type(i: int, added: dict, known: bool):
    """llama.cpp's type of token `i`: a special added token is CONTROL, another added one USER_DEFINED."""
    from gguf import TokenType

    a = added.get(i)
    if a:
        return TokenType.CONTROL if a.get("special") else TokenType.USER_DEFINED
    return TokenType.NORMAL if known else TokenType.UNUSED


def _special_ids(w, tok) -> None:
    """BOS, EOS and padding ids, and whether the tokenizer puts BOS first."""
    for tid, add in ((tok.bos_token_id, w.add_bos_token_id), (tok.eos_token_id, w.add_eos_token_id),
                     (tok.pad_token_id, w.add_pad_token_id)):
        if tid is not None:
            add(int(tid))
    bos = tok.bos_token_id
    w.add_add_bos_token(bool(bos is not None and tok("a").input_ids[:1] == [bos]))


def _hf_bpe_tokenizer(w, tok, n_vocab: int) -> bool:
    """Write a byte-level BPE (GPT-2 style) tokenizer; False for other kinds."""
    import json

    data = json.loads(tok.backend_tokenizer.to_str())
    model = data.get("model", {})
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(data.get("pre_tokenizer")):
        return False
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = {a["id"]: a for a in data.get("added_tokens", [])}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([by_id.get(i, f"[PAD{i}]") for i in range(n_vocab)])
    w.add_token_types([_token_type(i, added, i in by_id) for i in range(n_vocab)])
    w.add_token_merges(merges)
    _special_ids(w, tok)
    if getattr(tok, "chat_template", None) and isinstance(tok.chat_template, str):
        w.add_chat_template(tok.chat_template)
    return True


def _permute(wt: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half q/k rows → llama.cpp's interleaved RoPE layout (LLAMA rope type)."""
    return (wt.reshape(n_head, 2, wt.shape[0] // n_head // 2, *wt.shape[1:]).swapaxes(1, 2).reshape(wt.shape))


def _top_tensors(job):
    """(gguf name, array) of the embedding, the head and the final norm."""
    spec, wts, keep = job.spec, job.weights, job.opts.vocab_keep
    embed = wts["model.embed_tokens.weight"]
    head = wts.get("lm_head.weight")
    tied = head is None or spec.tie_embeddings
    if keep is not None:
        # the K-token model: its "embedding" is the trimmed head; inputs come as embeddings
        yield "token_embd.weight", (embed if tied else head)[np.asarray(keep)]
    else:
        yield "token_embd.weight", embed
        if not tied:
            yield "output.weight", head
    yield "output_norm.weight", wts["model.norm.weight"] + spec.family.norm_offset


def _layer_tensor(spec, name: str, arr: np.ndarray) -> np.ndarray:
    """A layer tensor as llama.cpp stores it: norms with the family's offset, q/k rows in its order."""
    fam = spec.family
    if name.endswith(_NORM_SUFFIXES):
        return arr + fam.norm_offset
    if fam.gguf.permute_qk and ".attn_q." in name:
        return _permute(arr, spec.n_heads)
    if fam.gguf.permute_qk and ".attn_k." in name:
        return _permute(arr, spec.n_kv_heads)
    return arr


def _tensors(job, arch: str, layers: tuple[int, ...]):
    """(gguf name, float32 array) for every tensor llama.cpp expects."""
    from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, get_tensor_name_map

    arch_enum = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch and a in MODEL_ARCH)
    names = get_tensor_name_map(arch_enum, job.spec.n_layers)
    yield from _top_tensors(job)
    remap = {li: j for j, li in enumerate(layers)}
    for key, arr in job.weights.items():
        if not key.startswith("model.layers."):
            continue
        li = int(key.split(".")[2])
        if li not in remap:
            continue
        base, suffix = key.rsplit(".", 1)
        name = names.get_name(base)
        if name is None:
            raise ExportError(f"no GGUF name for tensor {key} ({arch})")
        name = name.replace(f"blk.{li}.", f"blk.{remap[li]}.", 1) + "." + suffix
        yield name, _layer_tensor(job.spec, name, arr)


def _write(job, path: Path, half: bool) -> None:
    from gguf import GGUFWriter, LlamaFileType

    if any(k.endswith(("qkv_proj.weight", "gate_up_proj.weight")) for k in job.weights):
        raise ExportError("fused qkv/gate_up weights cannot be written as GGUF yet")
    arch = _arch(job)
    layers = job.opts.layers if job.opts.layers is not None else tuple(range(job.spec.n_layers))
    keep = job.opts.vocab_keep
    n_vocab = len(keep) if keep is not None else job.spec.vocab_size
    w = GGUFWriter(str(path), arch)
    freqs = _rope_freqs(job)
    _hparams(w, job, arch, len(layers), layers, freqs)
    w.add_file_type(LlamaFileType.MOSTLY_F16 if half else LlamaFileType.ALL_F32)
    _tokenizer(w, job, keep is not None, n_vocab)
    if keep is not None:
        scale = float(np.sqrt(job.spec.hidden_size)) if job.spec.family.embed_scale else 1.0
        w.add_string(EMBD_KEYS["file"], EMBD_FILE)
        w.add_string(EMBD_KEYS["tensor"], "token_embd.weight")
        w.add_float32(EMBD_KEYS["scale"], scale)
    for name, arr in _tensors(job, arch, layers):
        arr = np.ascontiguousarray(arr, dtype=np.float16 if half and arr.ndim == 2 else np.float32)
        w.add_tensor(name, arr)
    if freqs is not None:  # llama.cpp's converter writes Llama 3's scaling as this tensor
        w.add_tensor("rope_freqs.weight", np.ascontiguousarray(freqs[1], dtype=np.float32))
    _finish(w)


def _finish(w) -> None:
    """Write a GGUFWriter's header, metadata and tensors, and close it even on failure."""
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()


def _write_input_embedding(job, path: Path, precision: str) -> None:
    """The draft's full input embedding (V rows) in one small GGUF beside its model."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize as gq

    embed = np.ascontiguousarray(job.weights["model.embed_tokens.weight"], dtype=np.float32)
    w = GGUFWriter(str(path), "edgespec-embedding")
    if precision == "fp32":
        w.add_tensor("token_embd.weight", embed)
    elif precision == "fp16":
        w.add_tensor("token_embd.weight", embed.astype(np.float16))
    else:  # Q8_0 rows: a table lookup needs no more, and gguf quantizes it in numpy
        q = gq(embed, GGMLQuantizationType.Q8_0)
        w.add_tensor("token_embd.weight", q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    _finish(w)
