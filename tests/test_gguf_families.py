"""GGUF families transcoded to ONNX and OpenVINO, against llama.cpp on the same file and the same ids.

Two families users bring as GGUFs: Llama 3.1+ (its RoPE scaling is a `rope_freqs.weight` tensor of
per-dimension divisors, which llama.cpp applies as ggml_rope_ext's freq_factors) and Mistral /
Llama 2 (a SentencePiece vocabulary; grouped-query attention, a head_dim apart from hidden/heads,
a tied head). Each tiny random-weight GGUF is exported by `edgespec export`, and the bundle's
next-token logits are compared with llama-cpp-python's on the same GGUF at the first positions and
past 250 (where a RoPE scaling error has grown far above rounding), and so are the greedy ids.

llama.cpp runs with an F32 KV cache here: its default F16 cache rounds K and V to half precision,
which moves these logits by ~2e-2 from a float64 reference while with an F32 cache llama.cpp and
edgespec's graphs both stay within 1e-4 of it; the half-precision cache's rounding, not a transcoding
error, is what flips some greedy tokens of a random-weight model at its near-ties.
"""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from edgespec.bundle import load_bundle  # noqa: E402
from edgespec.errors import ExportError  # noqa: E402
from edgespec.exporters.export import ExportConfig, export_bundle  # noqa: E402
from edgespec.exporters.gguf.source import read_gguf  # noqa: E402
from tests.tiny import LLAMA3_ROPE, WORDS  # noqa: E402

N_IDS = 300  # positions compared; the far one is past 250
FAR = 260
# measured: at most 4e-5 apart on logits up to ~8 (onnxruntime and OpenVINO f32 alike); without
# rope_freqs the llama3 model is 3e-3 off at position 1 and ~0.3 at FAR
ATOL = 2e-4
GREEDY = 8
# the SentencePiece models: GQA with a head_dim apart from hidden/heads and its own head (Mistral),
# and multi-head attention with a tied head (Llama 2)
SPM_SHAPES = {
    "mistral": dict(hidden=64, heads=4, kv=1, head_dim=32, theta=1e6, eps=1e-5, tied=False),
    "llama2": dict(hidden=64, heads=4, kv=4, head_dim=16, theta=1e4, eps=1e-6, tied=True),
}


# -- tiny GGUFs ----------------------------------------------------------------------------
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


def write_spm_gguf(path, *, hidden: int, heads: int, kv: int, head_dim: int, theta: float, eps: float, tied: bool,
                   ffn: int = 128, layers: int = 2, seed: int = 0, rope_dims: int | None = None,
                   space_prefix: bool | None = None, extra: dict | None = None) -> int:
    """A llama-architecture GGUF with random float32 weights in llama.cpp's own layout (its q/k row
    order is all llama.cpp reads) and a SentencePiece vocabulary, written with gguf-py alone (no
    edgespec code); `extra`: more `llama.*` keys, name -> (value, GGUFValueType name). Returns the
    vocabulary size."""
    from gguf import GGUFValueType, GGUFWriter

    rng = np.random.default_rng(seed)
    tokens, scores, types = spm_vocab()
    w = GGUFWriter(str(path), "llama")
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
    for key, (value, vtype) in (extra or {}).items():
        if vtype == "ARRAY":
            w.add_array(f"llama.{key}", value)
        else:
            w.add_key_value(f"llama.{key}", value, getattr(GGUFValueType, vtype))
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
        return rng.normal(0.0, 0.2, size=shape).astype(np.float32)

    def norm(n):
        return (1.0 + rng.normal(0.0, 0.3, size=n)).astype(np.float32)

    w.add_tensor("token_embd.weight", mat(len(tokens), hidden))
    w.add_tensor("output_norm.weight", norm(hidden))
    if not tied:
        w.add_tensor("output.weight", mat(len(tokens), hidden))
    for i in range(layers):
        p = f"blk.{i}."
        for name, shape in (("attn_q", (heads * head_dim, hidden)), ("attn_k", (kv * head_dim, hidden)),
                            ("attn_v", (kv * head_dim, hidden)), ("attn_output", (hidden, heads * head_dim)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))):
            w.add_tensor(f"{p}{name}.weight", mat(*shape))
        w.add_tensor(p + "attn_norm.weight", norm(hidden))
        w.add_tensor(p + "ffn_norm.weight", norm(hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return len(tokens)


def llama3_gguf(zoo):
    """The tiny Llama 3.1-scaled model as edgespec's GGUF writer writes it (fp32)."""
    bundle = zoo.bundle("llama3", None, formats=("gguf",))
    return bundle / load_bundle(bundle).manifest.target.formats["gguf"].file


def converter_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.generate_extra_tensors, written out: the
    divisor of each inverse frequency under Llama 3's scaling."""
    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


# -- runs ----------------------------------------------------------------------------------
def edgespec_run(src, fmt: str, out, ids: list[int], n_greedy: int) -> tuple[np.ndarray, list[int]]:
    """Logits at every position of `ids`, then `n_greedy` greedy ids decoded one forward at a time,
    from the bundle `edgespec export` makes of `src` in `fmt`."""
    if fmt == "openvino":
        pytest.importorskip("openvino", reason="the OpenVINO export needs openvino")
    else:
        pytest.importorskip("onnxruntime")
    bundle = export_bundle(ExportConfig(output=out, target=src, draft=None, formats=(fmt,)))
    path = bundle / load_bundle(bundle).manifest.target.formats[fmt].file
    if fmt == "openvino":
        from edgespec.runtimes.openvino.runtime import OpenVinoRuntime

        rt = OpenVinoRuntime(path, precision="f32")
    else:
        from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

        rt = OnnxRuntime(path)
    with rt:
        logits = np.array(rt.forward(ids, len(ids)))
        out_ids = [int(np.argmax(logits[-1]))]
        while len(out_ids) < n_greedy:
            out_ids.append(int(np.argmax(rt.forward(out_ids[-1:], 1)[-1])))
    return logits, out_ids


def llama_cpp_run(src, ids: list[int], n_greedy: int) -> tuple[np.ndarray, list[int]]:
    """The same from llama-cpp-python on the GGUF itself."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="the reference is llama-cpp-python on the same GGUF")
    f32 = 0  # GGML_TYPE_F32: see the module docstring
    llm = llama_cpp.Llama(model_path=str(src), logits_all=True, n_ctx=512, n_threads=2, type_k=f32, type_v=f32,
                          verbose=False)
    try:
        llm.eval(ids)
        logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
        out_ids = [int(np.argmax(logits[-1]))]
        while len(out_ids) < n_greedy:
            llm.eval(out_ids[-1:])
            out_ids.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        return logits, out_ids
    finally:
        llm.close()


def assert_agrees(src, fmt: str, out, vocab: int) -> None:
    """Next-token logits within ATOL at position 1 and at FAR, within 2 ATOL everywhere, and the
    same first GREEDY greedy ids after the whole context."""
    rng = np.random.default_rng(1)
    ids = [1] + [int(t) for t in rng.integers(3, vocab, size=N_IDS - 1)]
    ours, got = edgespec_run(src, fmt, out, ids, GREEDY)
    ref, want = llama_cpp_run(src, ids, GREEDY)
    assert ours.shape == ref.shape == (N_IDS, vocab)
    for pos in (1, FAR):
        np.testing.assert_allclose(ours[pos], ref[pos], atol=ATOL, rtol=0, err_msg=f"position {pos}")
    np.testing.assert_allclose(ours, ref, atol=2 * ATOL, rtol=0)
    assert got == want


# -- Llama 3: rope_freqs -------------------------------------------------------------------
def test_writer_emits_rope_freqs_as_llama_cpp_converter_does(zoo):
    """edgespec's GGUF writer stores Llama 3's scaling as llama.cpp's converter does: the unscaled
    base as freq_base, no rope scaling keys, and `rope_freqs.weight` with the converter's factors."""
    from gguf import GGUFReader

    reader = GGUFReader(str(llama3_gguf(zoo)))
    tensors = {t.name: t for t in reader.tensors}
    assert "rope_freqs.weight" in tensors
    want = converter_rope_factors({"rope_theta": 10000.0, **LLAMA3_ROPE}, head_dim=16)
    assert len({1.0, LLAMA3_ROPE["factor"]} & set(want.tolist())) == 2 and len(set(want.tolist())) > 2
    np.testing.assert_allclose(np.asarray(tensors["rope_freqs.weight"].data), want, rtol=1e-6)
    assert float(reader.fields["llama.rope.freq_base"].contents()) == 10000.0
    assert not [k for k in reader.fields if k.startswith("llama.rope.scaling")]


def test_reader_applies_rope_freqs_as_transformers_llama3(zoo):
    """read_gguf divides the inverse frequencies by rope_freqs: the table transformers' llama3 init
    computes for the source model."""
    from edgespec.exporters.spec import spec_from_hf

    ours = read_gguf(llama3_gguf(zoo)).spec.rope["full_attention"]
    ref = spec_from_hf(zoo.hf_model("llama3")).rope["full_attention"]
    plain = read_gguf(llama3_gguf(zoo)).config.rope_theta ** -(np.arange(0, 16, 2) / 16)
    assert not np.allclose(ref[0], plain, rtol=1e-3)  # the scaling is there to be lost
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-6)
    assert ours[1] == ref[1] == 1.0


@pytest.mark.parametrize("fmt", ["onnx", "openvino"])
def test_llama3_matches_llama_cpp(zoo, tmp_path, fmt):
    assert_agrees(llama3_gguf(zoo), fmt, tmp_path / "b", vocab=zoo.hf_model("llama3").config.vocab_size)


def test_llama3_gguf_output_is_the_file_itself(zoo, tmp_path):
    """`--format gguf` of a GGUF source copies it byte for byte: llama.cpp applies rope_freqs itself."""
    src = llama3_gguf(zoo)
    out = export_bundle(ExportConfig(output=tmp_path / "b", target=src, draft=None, formats=("gguf",)))
    art = load_bundle(out).manifest.target.formats["gguf"]
    assert art.quantization["passthrough"] is True
    assert (out / art.file).read_bytes() == src.read_bytes()


# -- Mistral / Llama 2: SentencePiece --------------------------------------------------------
@pytest.mark.parametrize("fmt", ["onnx", "openvino"])
@pytest.mark.parametrize("name", list(SPM_SHAPES))
def test_sentencepiece_llama_matches_llama_cpp(tmp_path, name, fmt):
    src = tmp_path / f"{name}.gguf"
    vocab = write_spm_gguf(src, **SPM_SHAPES[name])
    assert_agrees(src, fmt, tmp_path / "b", vocab)


@pytest.mark.parametrize("space_prefix", [None, True, False])
def test_sentencepiece_tokenizer_gives_llama_cpp_ids(tmp_path, space_prefix):
    """The bundle's tokenizer of a SentencePiece GGUF gives llama.cpp's ids, BOS included; a GGUF
    without `tokenizer.ggml.add_space_prefix` (what llama.cpp's converter writes for Llama 2 and
    Mistral) gets llama.cpp's default for SentencePiece: a space prefix."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="the reference is llama-cpp-python's tokenizer")
    from edgespec.exporters.gguf.source import open_gguf
    from edgespec.exporters.gguf.tokenizer import GGUFTokenizer

    src = tmp_path / "spm.gguf"
    write_spm_gguf(src, **SPM_SHAPES["llama2"], layers=1, space_prefix=space_prefix)
    ours = GGUFTokenizer(open_gguf(src))
    llm = llama_cpp.Llama(model_path=str(src), vocab_only=True, verbose=False)
    try:
        for text in ("the cat and the dog", "hello world", " leading space", "Zebra ünï 😀", "rain\nsnow  wind",
                     "the</s>cat", ""):
            assert ours(text).input_ids == llm.tokenize(text.encode(), add_bos=True, special=True), text
    finally:
        llm.close()


# -- RoPE metadata: honoured or refused by name ----------------------------------------------
def test_linear_rope_scaling_matches_llama_cpp(tmp_path):
    src = tmp_path / "linear.gguf"
    vocab = write_spm_gguf(src, **SPM_SHAPES["mistral"], extra={"rope.scaling.type": ("linear", "STRING"),
                                                               "rope.scaling.factor": (4.0, "FLOAT32")})
    inv = read_gguf(src).spec.rope["full_attention"][0]
    np.testing.assert_allclose(inv, 1e6 ** -(np.arange(0, 32, 2) / 32) / 4.0, rtol=1e-6)
    assert_agrees(src, "onnx", tmp_path / "b", vocab)


@pytest.mark.parametrize("extra, key", [
    ({"rope.scaling.type": ("yarn", "STRING"), "rope.scaling.factor": (4.0, "FLOAT32")}, "llama.rope.scaling.type"),
    ({"rope.scaling.attn_factor": (1.5, "FLOAT32")}, "llama.rope.scaling.attn_factor"),
    ({"rope.scaling.yarn_log_multiplier": (0.1, "FLOAT32")}, "llama.rope.scaling.yarn_log_multiplier"),
    ({"rope.dimension_sections": ([4, 4, 0, 0], "ARRAY")}, "llama.rope.dimension_sections"),
])
def test_unsupported_rope_metadata_is_refused_by_key(tmp_path, extra, key):
    src = tmp_path / "odd.gguf"
    write_spm_gguf(src, **SPM_SHAPES["llama2"], layers=1, extra=extra)
    with pytest.raises(ExportError) as err:
        read_gguf(src)
    msg = str(err.value)
    assert key in msg and "\n" not in msg


def test_yarn_at_factor_one_is_the_plain_table(tmp_path):
    """llama.cpp's yarn at factor 1 (or none given) ramps between two equal tables: it is read, as
    the unscaled table, and a yarn factor is refused (above)."""
    src = tmp_path / "yarn1.gguf"
    write_spm_gguf(src, **SPM_SHAPES["llama2"], layers=1, extra={"rope.scaling.type": ("yarn", "STRING")})
    inv = read_gguf(src).spec.rope["full_attention"][0]
    np.testing.assert_allclose(inv, 1e4 ** -(np.arange(0, 16, 2) / 16), rtol=1e-6)


def test_partial_rotary_is_refused_by_key(tmp_path):
    src = tmp_path / "partial.gguf"
    write_spm_gguf(src, **SPM_SHAPES["llama2"], layers=1, rope_dims=8)
    with pytest.raises(ExportError, match=r"'llama\.rope\.dimension_count' = 8"):
        read_gguf(src)
