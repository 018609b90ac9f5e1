"""The compact merges form of tokenizer.json (exporters/gguf_tokenizer.compact_merges): the same tokenizer."""
from __future__ import annotations

import json

import pytest

tokenizers = pytest.importorskip("tokenizers")

from edgespec.bundle import TokenizerInfo  # noqa: E402
from edgespec.exporters.gguf.tokenizer import compact_merges, spm_merges  # noqa: E402
from edgespec.tokenizer import Tokenizer  # noqa: E402

# pieces JSON must escape or that look like the array's own punctuation: quotes, backslashes,
# brackets and commas (a piece "],[" once fooled a text-replacement version of this)
_PIECES = ["a", "b", "c", "ab", "abc", '"', ",", '",', '"]', "],[", "]", "[", "\\", '\\"', "x", "x\\", "x\\\\",
           "é", "ü", "éü", "▁", "▁a", "▁ab", "{", "}", "{}", ":"]


def _tokenizer(pieces: list[str]):
    from tokenizers import Tokenizer as HF
    from tokenizers.models import BPE

    vocab = {p: i for i, p in enumerate(pieces)}
    merges = spm_merges(pieces, [-float(i) for i in range(len(pieces))])
    return HF(BPE(vocab, merges, byte_fallback=False))


def test_compact_merges_keep_the_tokenizer():
    tok = _tokenizer(_PIECES)
    text = tok.to_str()
    compact = compact_merges(text)
    merges = json.loads(compact)["model"]["merges"]
    assert merges and all(isinstance(m, str) and m.count(" ") == 1 for m in merges)
    assert len(compact) < len(text)
    again = tokenizers.Tokenizer.from_str(compact)
    assert again.to_str() == text  # tokenizers reads the short form into the same merges, in order
    for s in ['abc"],[x\\\\', 'ab,"]{}:', "éüabc\\\"", "▁ab▁a"]:
        assert again.encode(s).ids == tok.encode(s).ids


def test_pieces_with_a_space_stay_pairs():
    tok = _tokenizer(["a", " ", "a ", " a", "a a"])
    text = tok.to_str()
    assert json.loads(text)["model"]["merges"]  # there are merges, and pieces with spaces in them
    assert compact_merges(text) == text


def test_no_merges_is_unchanged():
    from tokenizers import Tokenizer as HF
    from tokenizers.models import WordLevel

    text = HF(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).to_str()
    assert compact_merges(text) == text


def test_runtime_tokenizer_reads_the_compact_file(tmp_path):
    tok = _tokenizer(_PIECES)
    path = tmp_path / "tokenizer.json"
    path.write_text(compact_merges(tok.to_str()), encoding="utf-8")
    rt = Tokenizer(path, TokenizerInfo(file="tokenizer.json", bos_token_id=None, add_bos=False, stop_token_ids=[],
                                        chat_template=None, chat_template_source="none"))
    assert rt.encode("abc],[x") == tok.encode("abc],[x").ids
