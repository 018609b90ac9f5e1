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
        # in pieces: a runtime may return fewer logit rows per forward than N_IDS (a sliding-window cache)
        logits = np.concatenate([np.array(rt.forward(ids[i:i + 128], len(ids[i:i + 128])))
                                 for i in range(0, len(ids), 128)])
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


def assert_agrees(src, fmt: str, out, vocab: int, atol: float = ATOL) -> np.ndarray:
    """Next-token logits within `atol` at position 1 and at FAR, within 2 `atol` everywhere, and the
    same first GREEDY greedy ids after the whole context; returns llama.cpp's logits."""
    rng = np.random.default_rng(1)
    ids = [1] + [int(t) for t in rng.integers(3, vocab, size=N_IDS - 1)]
    ours, got = edgespec_run(src, fmt, out, ids, GREEDY)
    ref, want = llama_cpp_run(src, ids, GREEDY)
    assert ours.shape == ref.shape == (N_IDS, vocab)
    for pos in (1, FAR):
        np.testing.assert_allclose(ours[pos], ref[pos], atol=atol, rtol=0, err_msg=f"position {pos}")
    np.testing.assert_allclose(ours, ref, atol=2 * atol, rtol=0)
    assert got == want
    return ref


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


# -- Phi-3, Gemma 2, SmolLM3: architectures as rows of gguf/source.ARCHS ----------------------
# llama.cpp's CPU GELU reads a half-precision table: measured 2.2e-3 apart on the tiny Gemma 2 with
# or without its soft-caps (the SiLU families stay within 4e-5)
GELU_ATOL = 5e-3
FAMILY_SHAPES = {
    # fused attn_qkv and gate/up; a sliding window llama.cpp reads and does not apply (nor does edgespec)
    "phi3": dict(arch="phi3", hidden=64, heads=4, kv=2, head_dim=16, theta=1e4, eps=1e-5, tied=False,
                 extra={"attention.sliding_window": (16, "UINT32")}),
    # caps small enough to bend these scores and logits; a window far shorter than N_IDS on layer 0
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


def family_gguf(tmp_path, name: str, **changes) -> tuple[object, int]:
    src = tmp_path / f"{name}.gguf"
    shape = dict(FAMILY_SHAPES[name])
    shape["extra"] = {**shape.get("extra", {}), **changes.pop("extra", {})}
    return src, write_spm_gguf(src, **{**shape, **changes})


@pytest.mark.parametrize("fmt", ["onnx", "openvino"])
@pytest.mark.parametrize("name", list(FAMILY_SHAPES))
def test_family_matches_llama_cpp(tmp_path, name, fmt):
    src, vocab = family_gguf(tmp_path, name)
    ref = assert_agrees(src, fmt, tmp_path / "b", vocab, GELU_ATOL if name == "gemma2" else ATOL)
    if name == "gemma2":  # the final cap bounds every logit
        assert np.abs(ref).max() <= 3.0


def test_family_specs_read_llama_cpp_facts(tmp_path):
    """What each architecture leaves to llama.cpp's code: Phi-3's window ignored and its matrices
    split, Gemma 2's alternating window and default caps (50, 30) when the file has none, SmolLM3's
    fourth layer without RoPE (an identity table)."""
    phi3 = read_gguf(family_gguf(tmp_path, "phi3")[0])
    assert phi3.spec.layer_types == ("full_attention",) * 2 and phi3.spec.sliding_window is None
    assert {k.split(".", 3)[3] for k in phi3.tensors if k.startswith("model.layers.0.")} == {
        f"{m}.weight" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                                "post_attention_layernorm")}
    assert phi3.tensors["model.layers.0.mlp.gate_proj.weight"].shape == (128, 64)

    src = tmp_path / "gemma2-default.gguf"
    shape = {k: v for k, v in FAMILY_SHAPES["gemma2"].items() if k != "extra"}
    write_spm_gguf(src, **shape, layers=4)
    g2 = read_gguf(src).spec
    assert g2.layer_types == ("sliding_attention", "full_attention") * 2 and g2.sliding_window == 4096
    assert (g2.attn_logit_softcap, g2.final_logit_softcap) == (50.0, 30.0)
    assert g2.query_scale == pytest.approx(32 ** -0.5) and g2.family.sandwich_norm

    s3 = read_gguf(family_gguf(tmp_path, "smollm3")[0]).spec
    assert s3.layer_types[3] == "full_attention_nope" and set(s3.layer_types[:3]) == {"full_attention"}
    assert not s3.rope["full_attention_nope"][0].any() and s3.rope["full_attention"][0].all()


def test_gemma2_attention_softcap_is_what_llama_cpp_applies(tmp_path):
    """Without its attention cap the same weights give other logits (far beyond GELU_ATOL), so the
    agreement above is the cap's, not a cap too loose to matter."""
    capped, vocab = family_gguf(tmp_path, "gemma2")
    (tmp_path / "loose").mkdir()
    loose, _ = family_gguf(tmp_path / "loose", "gemma2", extra={"attn_logit_softcapping": (1e6, "FLOAT32")})
    ids = [1] + list(range(3, 40))
    a, _ = llama_cpp_run(capped, ids, 1)
    b, _ = llama_cpp_run(loose, ids, 1)
    assert np.abs(a - b).max() > 20 * GELU_ATOL
    ours, _ = edgespec_run(capped, "onnx", tmp_path / "b", ids, 1)
    np.testing.assert_allclose(ours, a, atol=GELU_ATOL, rtol=0)


def test_phi3_longrope_factors_are_refused_by_name(tmp_path):
    src, _ = family_gguf(tmp_path, "phi3", extra_tensors={"rope_factors_long.weight": np.ones(8, np.float32),
                                                          "rope_factors_short.weight": np.ones(8, np.float32)})
    with pytest.raises(ExportError) as err:
        read_gguf(src)
    msg = str(err.value)
    assert "rope_factors_long.weight" in msg and "LongRoPE" in msg and "\n" not in msg


def test_unsupported_architecture_fails_export_in_one_line_naming_it(tmp_path):
    """A family the code cannot run (here OLMoE's mixture of experts) fails at export by name."""
    src, _ = family_gguf(tmp_path, "smollm3", arch="olmoe")
    with pytest.raises(ExportError) as err:
        export_bundle(ExportConfig(output=tmp_path / "b", target=src, draft=None, formats=("onnx",)))
    msg = str(err.value)
    assert "'olmoe' is not supported" in msg and "qwen3moe" in msg and "gemma2" in msg and "\n" not in msg


# -- Qwen 3 MoE: a mixture of few experts, computed densely (onnx/moe.py) ----------------------
def test_qwen3moe_reads_experts_per_matrix(tmp_path):
    """Each 3-D expert tensor becomes one matrix per expert in transformers' names, the router
    stays float, and the count of experts used per token reaches the spec."""
    src, _ = family_gguf(tmp_path, "qwen3moe")
    m = read_gguf(src)
    assert m.spec.experts_used == 2 and m.config.intermediate_size == 64
    assert m.tensors["model.layers.1.mlp.gate.weight"].shape == (4, 64)
    for e in range(4):
        for proj, shape in (("gate_proj", (64, 64)), ("up_proj", (64, 64)), ("down_proj", (64, 64))):
            assert m.tensors[f"model.layers.1.mlp.experts.{e}.{proj}.weight"].shape == shape
    assert "model.layers.0.mlp.experts.4.gate_proj.weight" not in m.tensors
    from gguf import GGUFReader

    raw = {t.name: np.asarray(t.data) for t in GGUFReader(str(src)).tensors}
    np.testing.assert_array_equal(m.tensors["model.layers.1.mlp.experts.2.down_proj.weight"],
                                  raw["blk.1.ffn_down_exps.weight"][2])


def test_qwen3moe_routing_is_what_llama_cpp_computes(tmp_path):
    """The same weights with every expert used give other logits (far beyond ATOL), so the agreement
    of test_family_matches_llama_cpp is the top-2 routing's, not a routing too weak to matter."""
    top2, vocab = family_gguf(tmp_path, "qwen3moe")
    (tmp_path / "all").mkdir()
    dense, _ = family_gguf(tmp_path / "all", "qwen3moe", experts=(4, 4))
    ids = [1] + list(range(3, 40))
    a, _ = llama_cpp_run(top2, ids, 1)
    b, _ = llama_cpp_run(dense, ids, 1)
    assert np.abs(a - b).max() > 100 * ATOL
    ours, _ = edgespec_run(dense, "onnx", tmp_path / "b", ids, 1)
    np.testing.assert_allclose(ours, b, atol=ATOL, rtol=0)


def test_many_experts_are_refused_by_name_for_onnx_and_copied_for_gguf(tmp_path):
    """Above MAX_DENSE_EXPERTS the ONNX/OpenVINO graph would compute too many experts per token: one
    line naming the architecture and the count, before any weight is decoded; llama.cpp's format
    takes the file as it is."""
    from edgespec.exporters.gguf.source import MAX_DENSE_EXPERTS

    src, _ = family_gguf(tmp_path, "qwen3moe", experts=(MAX_DENSE_EXPERTS + 1, 2), layers=1, ffn=32)
    with pytest.raises(ExportError) as err:
        export_bundle(ExportConfig(output=tmp_path / "b", target=src, draft=None, formats=("onnx",)))
    msg = str(err.value)
    assert f"qwen3moe with {MAX_DENSE_EXPERTS + 1} experts" in msg and "--format gguf" in msg and "\n" not in msg
    out = export_bundle(ExportConfig(output=tmp_path / "g", target=src, draft=None, formats=("gguf",)))
    art = load_bundle(out).manifest.target.formats["gguf"]
    assert (out / art.file).read_bytes() == src.read_bytes()


@pytest.mark.parametrize("axis", [0, 1])
def test_stacked_experts_keep_their_blocks(axis):
    """Experts stacked by rows (gate, up) or by columns (down) are the same weights, block for block."""
    from edgespec.exporters.gguf.transcode import BlockWeight
    from edgespec.exporters.onnx.moe import stack_experts

    rng = np.random.default_rng(0)

    def expert():  # an 8-bit weight with zero points and block mins, (6, 64) in blocks of 32
        return BlockWeight(rng.integers(0, 256, (6, 2, 32), dtype=np.uint8), rng.random((6, 2), np.float32),
                           rng.integers(0, 256, (6, 2), dtype=np.uint8), 8, 32, "Q5_K",
                           rng.random((6, 2), np.float32))

    ws = [expert() for _ in range(3)]
    stacked = stack_experts(ws, axis)
    assert stacked.shape == ((18, 64) if axis == 0 else (6, 192))
    np.testing.assert_array_equal(stacked.dequantize(), np.concatenate([w.dequantize() for w in ws], axis=axis))
