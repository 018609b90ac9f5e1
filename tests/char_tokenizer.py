"""A small byte-level BPE tokenizer for grammar tests: JSON's characters, lowercase letters and
digits, a few merges (so forced text has one canonical tokenization among several), and an EOS.
Small enough that tests/toy.py's ToyRuntime can score its whole vocabulary."""
from __future__ import annotations

EOS = 0
_BYTE_LEVEL = {" ": "Ġ", "\n": "Ċ"}  # GPT-2's byte-to-unicode map, for the two bytes here it moves
_CHARS = list('{}[]":, ') + list("abcdefghijklmnopqrstuvwxyz") + list("0123456789") + ["\n", "-", "."]
MERGES = [("{", '"'), ('"', ":"), ("n", "a"), ("m", "e"), ("na", "me"), ("a", "g"), ("ag", "e"), ('":', " "),
          (",", " ")]


def _bl(text: str) -> str:
    return "".join(_BYTE_LEVEL.get(c, c) for c in text)


def char_vocab() -> dict[str, int]:
    vocab = {"<eos>": EOS}
    for c in _CHARS:
        vocab[_bl(c)] = len(vocab)
    for a, b in MERGES:
        vocab[_bl(a + b)] = len(vocab)
    return vocab


VOCAB = len(char_vocab())


def char_tokenizer():
    """The tokenizer (a `tokenizers.Tokenizer`); token ids are char_vocab()'s."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=char_vocab(), merges=[(_bl(a), _bl(b)) for a, b in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return tok


def char_compiler(**limits):
    """A GrammarCompiler for this tokenizer, EOS its stop id; `limits`: GrammarLimits fields."""
    from edgespec.decoding.grammar import GrammarCompiler, GrammarLimits

    tok = char_tokenizer()
    return GrammarCompiler(tok.to_str, VOCAB, [EOS], GrammarLimits(**limits))
