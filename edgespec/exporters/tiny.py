"""Tiny random-weight Hugging Face models of the families edgespec exports, with a byte-level BPE
tokenizer trained in-process: a source folder `export_bundle` takes, built offline in seconds.

The tests build their model zoo from these (tests/zoo.py), and so do the lab's harnesses in dev/;
a model family's export, a backend or an install can be tried on one without a download. The
weights are random: the text they generate means nothing, but every layer, norm and head is
exercised as a trained model's would be.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["CORPUS", "FAMILIES", "LLAMA3_ROPE", "VOCAB", "WORDS", "make_config", "make_model", "make_tokenizer"]

WORDS = ("the a an of to in is was and or but if then else for while with on at by from up down "
         "cat dog bird fish tree house car road river sky sun moon star rain snow wind fire water "
         "red blue green black white big small old new fast slow good bad happy sad one two three "
         "hello world code python function return value list print import class def data model").split()
CORPUS = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(0, len(WORDS), 3)]
VOCAB = 320
# Llama 3.1's RoPE scaling for the tiny Llama (head_dim 16, base 10000: wavelengths from 6 to ~20k
# positions): an original context of 64 leaves one dim unscaled, smooths two and divides five by 8
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
FAMILIES = ("llama", "llama3", "qwen2", "gemma3")


def make_tokenizer():
    """A byte-level BPE trained in-process, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


# tiny names that are a family's tiny model with more config keys, not families of their own
_VARIANTS = {"llama3": ("llama", {"rope_scaling": LLAMA3_ROPE})}  # Llama 3.1's RoPE scaling (model_type "llama")


def _layer_types(pattern, layers: int) -> list[str]:
    """A family's repeating layer-type pattern over `layers` layers."""
    return [pattern[i % len(pattern)] for i in range(layers)]


def make_config(family: str, vocab: int, layers: int = 2, tied: bool | None = None):
    """The transformers config of a tiny `family` model (a registered family with a `tiny` row, or a
    variant of one, e.g. "llama3"); `tied` overrides the family's default tie_word_embeddings
    (llama: untied, qwen2 and gemma3: tied)."""
    from transformers import AutoConfig

    from ..models.families import FAMILIES

    base, extra = _VARIANTS.get(family, (family, {}))
    row = FAMILIES.get(base)
    if row is None or row.tiny is None:
        known = [*(name for name, r in FAMILIES.items() if r.tiny is not None), *_VARIANTS]
        raise ValueError(f"no tiny model of family {family!r} (known: {', '.join(known)})")
    keys = {**row.tiny, **{k: dict(v) if isinstance(v, dict) else v for k, v in extra.items()}}
    if "layer_types" in keys:
        keys["layer_types"] = _layer_types(keys["layer_types"], layers)
    if tied is not None:
        keys["tie_word_embeddings"] = bool(tied)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return AutoConfig.for_model(row.model_type, **keys, **common)


def make_model(family: str, out: Path, seed: int = 0, chat_template: str | None = None,
               tied: bool | None = None, layers: int = 2) -> Path:
    """Save a small (default 2-layer) random model of `family` with the in-process tokenizer into `out`.

    A tied random Gemma 3 mostly repeats its last token (its scaled embedding dominates the
    residual stream and the head is that embedding): pass tied=False for varied greedy text."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = make_tokenizer()
    if chat_template:
        tokenizer.chat_template = chat_template
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family, len(tokenizer), layers=layers, tied=tied)).eval()
    with torch.no_grad():  # random norms too, so a wrong norm formula shows up
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
            elif p.dim() == 2:
                p.normal_(0.0, 0.2)  # larger than init: peaked, varied next-token distributions
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
