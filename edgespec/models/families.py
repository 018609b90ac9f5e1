"""Per-family facts, as data: what differs between decoder-only families.

Everything the exporter or the chat front end needs to know about a family lives here,
keyed by the Hugging Face `model_type`, so adding a family is adding a row.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ExportError

__all__ = ["Family", "FAMILIES", "family_for", "GEMMA_CHAT_TEMPLATE"]

# Gemma's turn markers (the instruction-tuned Gemma template, minus tool calling). Kept in the
# bundle of a Gemma checkpoint that carries no template of its own (e.g. the base GGUF), for
# `--chat-format template`; a base model chats through its transcript by default.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '')"
    " + message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class Family:
    """How one family's decoder differs from the Llama baseline."""

    name: str
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight); Gemma stores weight - 1
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size)
    sandwich_norm: bool = False  # extra norms after attention and around the MLP (Gemma 2/3)
    fallback_chat_template: str | None = None  # for checkpoints that ship none (`--chat-format template`)
    chat_transcript: str | None = None  # base models chat through this transcript (models/chat_formats.py)
    stop_tokens: tuple[str, ...] = ()  # end-of-turn tokens besides EOS
    reserved_token_pattern: str | None = None  # placeholder specials never emitted (not kept by VocabTrim)
    gguf_arch: str | None = None  # llama.cpp architecture name (None: no GGUF writer for it)
    gguf_permute_qk: bool = False  # llama.cpp's LLAMA rope pairs adjacent dims: q/k rows are reordered
    gguf_rope_freqs: bool = False  # llama.cpp's architecture reads a `rope_freqs.weight` (Llama 3 scaling)


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", reserved_token_pattern=r"<\|reserved_special_token_\d+\|>", gguf_arch="llama",
                    gguf_permute_qk=True, gguf_rope_freqs=True),
    "mistral": Family("mistral", gguf_arch="llama", gguf_permute_qk=True, gguf_rope_freqs=True),
    "qwen2": Family("qwen2", fallback_chat_template=CHATML_TEMPLATE, stop_tokens=("<|im_end|>",), gguf_arch="qwen2"),
    "qwen3": Family("qwen3", fallback_chat_template=CHATML_TEMPLATE, stop_tokens=("<|im_end|>",), gguf_arch="qwen3"),
    # Qwen 3's mixture of experts (GGUF `qwen3moe`, read from GGUF only; onnx/moe.py): Qwen 3's turns
    "qwen3_moe": Family("qwen3_moe", fallback_chat_template=CHATML_TEMPLATE, stop_tokens=("<|im_end|>",)),
    # Phi-3's fused qkv_proj / gate_up_proj matrices are split into the Llama names where the weights are
    # read (onnx/graph._split_fused for a HF folder, gguf/source._split_fused for a GGUF): no family flag
    "phi3": Family("phi3", stop_tokens=("<|end|>",)),
    # SmolLM3: Llama's layout (llama.cpp reorders its q/k rows), ChatML turns, every 4th layer without RoPE
    "smollm3": Family("smollm3", fallback_chat_template=CHATML_TEMPLATE, stop_tokens=("<|im_end|>",),
                      gguf_permute_qk=True),
    # Gemma 2: Gemma 3's norms and embedding scale, soft-capped attention and logits, no q/k norms
    "gemma2": Family(
        "gemma2",
        norm_offset=1.0,
        embed_scale=True,
        sandwich_norm=True,
        fallback_chat_template=GEMMA_CHAT_TEMPLATE,
        stop_tokens=("<end_of_turn>",),
        reserved_token_pattern=r"<unused\d+>",
    ),
    "gemma3_text": Family(
        "gemma3",
        norm_offset=1.0,
        embed_scale=True,
        sandwich_norm=True,
        fallback_chat_template=GEMMA_CHAT_TEMPLATE,
        chat_transcript="qa",  # measured on Gemma 3 270M: docs/chat-formats.md
        stop_tokens=("<end_of_turn>",),
        reserved_token_pattern=r"<unused\d+>",
        gguf_arch="gemma3",
    ),
}
FAMILIES["gemma3"] = FAMILIES["gemma3_text"]


def family_for(model_type: str) -> Family:
    """The family row for a HF `model_type`, or a clear error listing the supported ones."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        supported = ", ".join(sorted(FAMILIES))
        raise ExportError(f"model type '{model_type}' is not supported (supported: {supported})") from None
