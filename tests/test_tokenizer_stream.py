"""Streamed text (tokenizer.IncrementalDecoder, tokenizers' DecodeStream underneath) equals the full
decode of the same ids: multi-byte UTF-8 split over byte-fallback tokens, SentencePiece's leading
spaces (with and without the decoder's strip of the first one), byte-level BPE, ids pushed one at a
time or a few at a time. A run of byte tokens that is not UTF-8 (a random-weight model writes such
runs) never raises and neither loses nor repeats the words around it."""
from __future__ import annotations

import json
import random

import pytest

from edgespec.bundle import TokenizerInfo
from edgespec.tokenizer import IncrementalDecoder, Tokenizer

CORPUS = ["hello world, the cat sat on the mat", "speculative decoding drafts and verifies",
          "  indented line\n\nand a tab\there", "numbers 12345 and dots..."] * 3
TEXTS = ["Hello wörld 日本語 🎉 naïve café", "  two leading spaces", "line\n\n  indented\ttab",
         "ÆØÅ ß 中文 한국어 العربية 👩‍👩‍👧", "a  b   c    d", " the cat sat on the mat"]


def _byte_level():
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        special_tokens=["</s>"]))
    return tok


def _sentencepiece(strip_first_space: bool):
    """Llama's layout (the decoder strips the first space) or Gemma's (it does not): "▁" for
    spaces, and every character the pieces lack spelled as <0xNN> byte tokens."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    base = HF(models.BPE())
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    base.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=150, show_progress=False))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(base.get_vocab(), key=base.get_vocab().get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" "))
              for m in json.loads(base.to_str())["model"]["merges"]]
    tok = HF(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = base.pre_tokenizer
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if strip_first_space else []))
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


MAKERS = {"byte-level": _byte_level, "llama-spm": lambda: _sentencepiece(True),
          "gemma-spm": lambda: _sentencepiece(False)}


def _load(name: str, tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    MAKERS[name]().save(str(path))
    return Tokenizer(path, TokenizerInfo("tokenizer.json", None, False, [], None, "none"))


@pytest.fixture(scope="module", params=sorted(MAKERS))
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    return _load(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=["gemma-spm", "llama-spm"])
def byte_fallback_tokenizer(request, tmp_path_factory) -> Tokenizer:
    return _load(request.param, tmp_path_factory)


def _streamed(tok: Tokenizer, ids: list[int], chunk: int) -> str:
    dec = IncrementalDecoder(tok)
    text = "".join(dec.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk))
    return text + dec.flush()


@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_is_the_full_decode(tokenizer, chunk):
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert _streamed(tokenizer, ids, chunk) == tokenizer.decode(ids), text
        # a special token inside the reply is skipped, as the full decode skips it
        marked = ids[:2] + [tokenizer.hf.token_to_id("</s>")] + ids[2:]
        assert _streamed(tokenizer, marked, chunk) == tokenizer.decode(marked) == tokenizer.decode(ids), text


def test_text_is_held_back_until_a_character_is_whole_and_flush_gives_the_rest(tokenizer):
    ids = tokenizer.encode("ok 🎉", add_special_tokens=False)
    dec = IncrementalDecoder(tokenizer)
    parts = [dec.push([i]) for i in ids]
    assert all("\ufffd" not in p for p in parts) and "".join(parts) == tokenizer.decode(ids)
    cut = IncrementalDecoder(tokenizer)
    head = "".join(cut.push([i]) for i in ids[:-1])  # the emoji's last byte is missing
    assert "\ufffd" not in head and head + cut.flush() == tokenizer.decode(ids[:-1])


def test_byte_runs_that_are_not_utf8_never_raise_and_keep_the_words(byte_fallback_tokenizer):
    """DecodeStream itself raises on such runs (the reason IncrementalDecoder keeps a window
    difference for that step); the words between the runs come out once each, in order."""
    from tokenizers.decoders import DecodeStream

    tokenizer = byte_fallback_tokenizer
    rng = random.Random(0)
    byte_ids = [tokenizer.hf.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    # words the pieces spell (not bytes, which would join the runs around them), none inside another
    words = [" hello", " world", " cat", " mat", " speculative", " decoding", " drafts", " verifies", " numbers"]
    raised = 0
    for trial in range(40):
        ids, said = [], []
        for word in rng.sample(words, 4):
            ids += [rng.choice(byte_ids) for _ in range(rng.randint(1, 4))]
            ids += tokenizer.encode(word, add_special_tokens=False)
            said.append(word.strip())
        streamed = _streamed(tokenizer, ids, 1 + trial % 3)
        assert [w for w in said if streamed.count(w) == 1] == said, (ids, streamed)
        assert streamed.index(said[0]) < streamed.index(said[-1])
        raised += _raises(DecodeStream(skip_special_tokens=True), tokenizer.hf, ids)
    assert raised > 0  # if a tokenizers release stops raising, the window difference can go


def _raises(stream, hf, ids: list[int]) -> bool:
    try:
        for i in ids:
            stream.step(hf, i)
    except Exception:  # noqa: BLE001 -- the binding's bare Exception ("Invalid prefix ...")
        return True
    return False
