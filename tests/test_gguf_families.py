"""GGUF families transcoded to ONNX and OpenVINO, against llama.cpp on the same file and the same ids.

Two families users bring as GGUFs: Llama 3.1+ (its RoPE scaling is a `rope_freqs.weight` tensor of
per-dimension divisors, which llama.cpp applies as ggml_rope_ext's freq_factors) and Mistral /
Llama 2 (a SentencePiece vocabulary; grouped-query attention, a head_dim apart from hidden/heads,
a tied head). Each tiny random-weight GGUF is exported by `edgespec export`, and the bundle's
next-token logits are compared with llama-cpp-python's on the same GGUF at the first positions and
past 250 (where a RoPE scaling error has grown far above rounding), and so are the greedy ids.
Then the architectures read as rows of gguf/source.ARCHS (Phi-3, Gemma 2, SmolLM3, Qwen 3 MoE), the
same way, and RoPE metadata and families the code cannot run refused by name. The GGUFs are written
by tests/gguf_writers.py; the runs and their comparison are tests/gguf_reference.py's.

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
from tests.gguf_reference import ATOL, assert_agrees, edgespec_run, llama_cpp_run  # noqa: E402
from tests.gguf_writers import FAMILY_SHAPES, SPM_SHAPES, family_gguf, write_spm_gguf  # noqa: E402
from tests.tiny import LLAMA3_ROPE  # noqa: E402


# -- Llama 3: rope_freqs -------------------------------------------------------------------
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
    from edgespec.exporters.gguf.experts import MAX_DENSE_EXPERTS

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
