"""Tiny random-weight GGUFs written with gguf-py alone (no edgespec code), in llama.cpp's own layout
and names: a SentencePiece vocabulary as llama.cpp's converter stores one, the tensors of one block
of each architecture, and the shapes of the families the tests bring (the SentencePiece Llamas and the
rows of gguf/source.ARCHS). Shared by the family, quant and compatibility-matrix tests."""
from __future__ import annotations

import numpy as np

from tests.tiny import WORDS

__all__ = ["FAMILY_SHAPES", "SPM_SHAPES", "family_gguf", "layer_tensors", "spm_vocab", "write_spm_gguf"]

# the SentencePiece models: GQA with a head_dim apart from hidden/heads and its own head (Mistral),
# and multi-head attention with a tied head (Llama 2)
SPM_SHAPES = {
    "mistral": dict(hidden=64, heads=4, kv=1, head_dim=32, theta=1e6, eps=1e-5, tied=False),
    "llama2": dict(hidden=64, heads=4, kv=4, head_dim=16, theta=1e4, eps=1e-6, tied=True),
}
FAMILY_SHAPES = {
    # fused attn_qkv and gate/up; a sliding window llama.cpp reads and does not apply (nor does edgespec)
    "phi3": dict(arch="phi3", hidden=64, heads=4, kv=2, head_dim=16, theta=1e4, eps=1e-5, tied=False,
                 extra={"attention.sliding_window": (16, "UINT32")}),
    # caps small enough to bend these scores and logits; on layer 0 a window far shorter than the
    # positions compared against llama.cpp
    "gemma2": dict(arch="gemma2", hidden=64, heads=4, kv=2, head_dim=32, theta=1e4, eps=1e-6, tied=True,
                   extra={"attention.sliding_window": (24, "UINT32"), "attn_logit_softcapping": (1.0, "FLOAT32"),
                          "final_logit_softcapping": (3.0, "FLOAT32")}),
    # four layers: the fourth has no RoPE
    "smollm3": dict(arch="smollm3", hidden=64, heads=4, kv=1, head_dim=16, theta=1e4, eps=1e-6, tied=True,
                    layers=4),
    # a mixture of four experts, two per token, per-head q/k norms
    "qwen3moe": dict(arch="qwen3moe", hidden=64, heads=4, kv=2, head_dim=16, theta=1e6, eps=1e-6, tied=False,
                     ffn=64, experts=(4, 2)),
}


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary as llama.cpp's converter stores one: <unk> <s> </s>, 256
    byte-fallback tokens, then pieces (every "▁" prefix of the words, so each merge step exists)."""
    tokens, scores, types = ["<unk>", "<s>", "</s>"], [0.0, 0.0, 0.0], [2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    scores += [0.0] * 256
    types += [6] * 256
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz"]
    for w in WORDS[:40]:
        pieces += [p for p in ("▁" + w[:i] for i in range(1, len(w) + 1)) if p not in pieces]
    tokens += pieces
    scores += [-float(i) for i in range(len(pieces))]
    types += [1] * len(pieces)
    return tokens, scores, types


def layer_tensors(arch: str, hidden: int, q: int, kv: int, ffn: int, head_dim: int,
                  experts: int = 0) -> tuple[list, list[tuple[str, int]]]:
    """((name, numpy shape) of each matrix, (name, size) of each norm) of one `blk.N.` of `arch` as
    llama.cpp names them: Phi-3 fuses q/k/v into attn_qkv and the gate into ffn_up (gate rows first);
    Gemma 2 adds the post-attention and post-MLP norms; Qwen 3 (MoE) has per-head q/k norms, and a
    mixture of `experts` a router (`ffn_gate_inp`) and 3-D expert tensors of `ffn` rows each."""
    attn = ([("attn_qkv", (q + 2 * kv, hidden))] if arch == "phi3" else
            [("attn_q", (q, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden))])
    if experts:
        mlp = [("ffn_gate_inp", (experts, hidden)), ("ffn_gate_exps", (experts, ffn, hidden)),
               ("ffn_up_exps", (experts, ffn, hidden)), ("ffn_down_exps", (experts, hidden, ffn))]
    elif arch == "phi3":
        mlp = [("ffn_up", (2 * ffn, hidden)), ("ffn_down", (hidden, ffn))]
    else:
        mlp = [("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))]
    norms = [("attn_norm", hidden), ("ffn_norm", hidden)]
    if arch == "gemma2":
        norms += [("post_attention_norm", hidden), ("post_ffw_norm", hidden)]
    if arch in ("qwen3", "qwen3moe"):
        norms += [("attn_q_norm", head_dim), ("attn_k_norm", head_dim)]
    return [*attn, ("attn_output", (hidden, q)), *mlp], norms


def write_spm_gguf(path, *, hidden: int, heads: int, kv: int, head_dim: int, theta: float, eps: float, tied: bool,
                   ffn: int = 128, layers: int = 2, seed: int = 0, rope_dims: int | None = None,
                   space_prefix: bool | None = None, extra: dict | None = None, arch: str = "llama",
                   extra_tensors: dict | None = None, std: float = 0.2, experts: tuple[int, int] | None = None) -> int:
    """A GGUF of `arch` (llama, phi3, gemma2, smollm3...) with random float32 weights in llama.cpp's
    own layout (its q/k row order is all llama.cpp reads) and a SentencePiece vocabulary, written
    with gguf-py alone (no edgespec code); `extra`: more `<arch>.*` keys, name -> (value,
    GGUFValueType name); `extra_tensors`: more tensors, name -> array; `std`: the matrices' standard
    deviation; `experts`: (experts, used per token) of a mixture of experts of `ffn` rows each (the
    keys llama.cpp's qwen3moe reads). Returns the vocabulary size."""
    from gguf import GGUFValueType, GGUFWriter

    rng = np.random.default_rng(seed)
    tokens, scores, types = spm_vocab()
    w = GGUFWriter(str(path), arch)
    w.add_context_length(1024)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(rope_dims or head_dim)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(eps)
    w.add_file_type(0)
    if experts:
        w.add_expert_count(experts[0])
        w.add_expert_used_count(experts[1])
        w.add_expert_feed_forward_length(ffn)
    for key, (value, vtype) in (extra or {}).items():
        if vtype == "ARRAY":
            w.add_array(f"{arch}.{key}", value)
        else:
            w.add_key_value(f"{arch}.{key}", value, getattr(GGUFValueType, vtype))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if space_prefix is not None:
        w.add_add_space_prefix(space_prefix)

    def mat(*shape):
        return rng.normal(0.0, std, size=shape).astype(np.float32)

    def norm(n):
        return (1.0 + rng.normal(0.0, 0.3, size=n)).astype(np.float32)

    w.add_tensor("token_embd.weight", mat(len(tokens), hidden))
    w.add_tensor("output_norm.weight", norm(hidden))
    if not tied:
        w.add_tensor("output.weight", mat(len(tokens), hidden))
    for name, value in (extra_tensors or {}).items():
        w.add_tensor(name, value)
    mats, norms = layer_tensors(arch, hidden, heads * head_dim, kv * head_dim, ffn, head_dim,
                                experts[0] if experts else 0)
    for i in range(layers):
        for name, shape in mats:
            w.add_tensor(f"blk.{i}.{name}.weight", mat(*shape))
        for name, size in norms:
            w.add_tensor(f"blk.{i}.{name}.weight", norm(size))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return len(tokens)


def family_gguf(tmp_path, name: str, **changes) -> tuple[object, int]:
    """The FAMILY_SHAPES model `name` written to `tmp_path`, with `changes` to its shape (`extra`
    keys merged into the family's); (path, vocabulary size)."""
    src = tmp_path / f"{name}.gguf"
    shape = dict(FAMILY_SHAPES[name])
    shape["extra"] = {**shape.get("extra", {}), **changes.pop("extra", {})}
    return src, write_spm_gguf(src, **{**shape, **changes})
