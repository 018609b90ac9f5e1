"""A GGUF source read with gguf-py and numpy (no torch): config, weights, tokenizer, and the
bundle `edgespec export` makes of it, on tiny GGUFs written in-process (edgespec's own GGUF
writer, quantized by llama.cpp); the real default model in the slow tier."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from edgespec.bundle import load_bundle  # noqa: E402
from edgespec.exporters.export import ExportConfig, export_bundle  # noqa: E402
from edgespec.exporters.gguf.source import open_gguf, read_gguf  # noqa: E402
from edgespec.exporters.gguf.tokenizer import GGUFTokenizer, spm_merges  # noqa: E402
from edgespec.exporters.gguf.transcode import BlockWeight  # noqa: E402
from edgespec.exporters.onnx.graph import GraphOptions, build_decoder  # noqa: E402
from tests.tiny import LONG_PROMPT, PROMPTS  # noqa: E402

TEXTS = (*PROMPTS, "hello  world\n\tcat", "<start_of_turn>user\nhi<end_of_turn>", "unknown ünïcode 😀", "")


def _gguf(zoo, name: str, precision: str = "fp32"):
    """A tiny GGUF of the `name` variant, written by edgespec's GGUF writer (int8 = llama.cpp Q8_0)."""
    if precision != "fp32":
        pytest.importorskip("llama_cpp", reason="quantizing a GGUF needs llama-cpp-python")
    bundle = zoo.bundle(name, None, formats=("gguf",), target_precision=precision)
    return bundle / load_bundle(bundle).manifest.target.formats["gguf"].file


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3", "gemma3-tied"])
def test_config_and_weights_match_transformers(zoo, name):
    """Same ModelSpec as transformers reads off the HF folder and the same weights, bit for bit
    (llama's q/k rows un-permuted, Gemma's norms back to transformers' w rather than 1 + w)."""
    from edgespec.exporters.spec import spec_from_hf

    hf = zoo.hf_model(name)
    model = read_gguf(_gguf(zoo, name))
    ref = spec_from_hf(hf)
    for f in ref.__dataclass_fields__:
        a, b = getattr(ref, f), getattr(model.spec, f)
        if f == "rope":
            assert a.keys() == b.keys()
            for lt in a:
                np.testing.assert_allclose(b[lt][0], a[lt][0], rtol=1e-6)
                assert b[lt][1] == a[lt][1]
        elif f == "rms_eps":  # GGUF stores it as float32, which is what the graph computes in
            assert np.float32(a) == np.float32(b)
        else:
            assert a == b, f
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    if ref.tie_embeddings:
        state.pop("lm_head.weight", None)
    assert set(model.tensors) == set(state)
    offset = ref.family.norm_offset
    for k, v in model.tensors.items():
        assert isinstance(v, np.ndarray)
        if offset and k.endswith("norm.weight"):
            # the file holds float32(1 + w): w comes back within an ulp of 1 + w, and 1 + w exactly
            np.testing.assert_allclose(v, state[k], rtol=0, atol=np.spacing(np.float32(1 + np.abs(v).max())))
            np.testing.assert_array_equal((v + offset).astype(np.float32), (state[k] + np.float32(offset)))
        else:
            np.testing.assert_array_equal(v, state[k], err_msg=k)


@pytest.mark.parametrize("name", ["qwen2", "gemma3-tied"])
def test_tokenizer_gives_the_source_ids(zoo, name):
    tok = GGUFTokenizer(open_gguf(_gguf(zoo, name)))
    ref = zoo.hf_tokenizer(name)
    for text in TEXTS:
        assert tok(text).input_ids == ref(text).input_ids, text
        assert tok(text, add_special_tokens=False).input_ids == ref(text, add_special_tokens=False).input_ids
    vocab = tok.get_vocab()  # transformers may add tokens past the model's rows (Qwen's <|endoftext|>)
    assert vocab == {t: i for t, i in ref.get_vocab().items() if i < len(vocab)}
    assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)


def test_spm_merges_follow_the_joined_piece_score():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -1.0, -0.5, -2.0]
    # bc scores best, then ab; abc's two splits tie on score: the longer left piece first
    assert spm_merges(tokens, scores) == [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]


def test_quantized_gguf_exports_its_own_blocks(zoo, tmp_path):
    """`edgespec export` of a Q8_0 GGUF: MatMulNBits on the GGUF's blocks, no re-encoding. The graph
    computing in fp32 (accuracy level 0) gives the logits of the fp32 graph of gguf-py's dequantized
    weights; the exported one (level 4, int8 activations as llama.cpp computes) their argmax."""
    pytest.importorskip("onnxruntime")
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    src = _gguf(zoo, "gemma3", "int8")
    model = read_gguf(src)
    assert any(isinstance(v, BlockWeight) for v in model.tensors.values())
    out = export_bundle(ExportConfig(output=tmp_path / "b", target=src))
    m = load_bundle(out).manifest
    art = m.target.formats["onnx"]
    assert art.precision == "int8" and art.quantization["method"] == "gguf-transcode"
    assert art.quantization["gguf_file_type"] == "Q8_0"
    assert m.target.source["kind"] == "gguf" and m.draft is not None
    import onnx

    ops = {n.op_type for n in onnx.load(str(out / art.file), load_external_data=False).graph.node}
    assert "MatMulNBits" in ops

    assert art.quantization["accuracy_level"] == 4

    def save(weights, name, **opts):
        path = tmp_path / name / "model.onnx"
        path.parent.mkdir()
        onnx.save_model(build_decoder(model.spec, weights, GraphOptions(kv_layout="append", **opts)), str(path))
        return path

    ref, exact = save(model.dequantized(), "ref"), save(model.tensors, "exact", nbits_accuracy=0)
    ids = GGUFTokenizer(open_gguf(src))(LONG_PROMPT).input_ids
    with OnnxRuntime(out / art.file) as a, OnnxRuntime(ref) as b, OnnxRuntime(exact) as c:
        want = b.forward(ids, len(ids))
        np.testing.assert_allclose(c.forward(ids, len(ids)), want, atol=1e-4, rtol=1e-4)
        got = a.forward(ids, len(ids))
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
        np.testing.assert_allclose(got, want, atol=0.1 * np.abs(want).max())


def _unknown_type_gguf(path) -> None:
    """A GGUF whose embedding is MXFP4, a block type gguf-py can write and edgespec cannot transcode."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    w = GGUFWriter(str(path), "gemma3")
    q = quantize(np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32), GGMLQuantizationType.MXFP4)
    w.add_tensor("token_embd.weight", q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("fmt", ["onnx", "openvino"])
def test_unknown_block_type_is_exit_2_and_nothing_written(tmp_path, fmt):
    if fmt == "openvino":
        pytest.importorskip("openvino")
    src = tmp_path / "odd.gguf"
    _unknown_type_gguf(src)
    out = tmp_path / "bundle"
    proc = subprocess.run([sys.executable, "-m", "edgespec", "export", "--target", str(src), "-o", str(out),
                           "--format", fmt],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(lines) == 1 and "MXFP4" in lines[0] and "token_embd.weight" in lines[0], proc.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["odd.gguf"]


def test_gguf_path_imports_no_torch(zoo):
    """Reading a GGUF source (weights, config, tokenizer) loads neither torch nor transformers."""
    src = _gguf(zoo, "gemma3-tied")
    code = ("import sys; from edgespec.exporters.sources import load_source; s = load_source(sys.argv[1]); "
            "import json; print(json.dumps([m for m in ('torch', 'transformers') if m in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", code, str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_gguf_self_draft_is_the_target_body_under_a_trimmed_head(zoo, tmp_path):
    """The GGUF self-draft with a VocabTrim head, calibrated by the exported target on onnxruntime
    (no torch model): the manifest calls it a self-draft, and its logits are the target's at the
    kept ids (the same blocks under the embedding's own rows)."""
    pytest.importorskip("onnxruntime")
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    src = _gguf(zoo, "gemma3", "int8")
    out = export_bundle(ExportConfig(output=tmp_path / "b", target=src, draft_vocab=64))
    b = load_bundle(out)
    m = b.manifest
    assert m.self_draft and m.draft.vocab_size == 64
    art = m.draft.formats["onnx"]
    assert art.quantization["method"] == "gguf-transcode" and art.precision == "int8"
    assert m.draft.vocab_info["calibration_tokens"] > 0
    assert not (out / ".calibration").exists()
    keep = b.id_map()
    ids = GGUFTokenizer(open_gguf(src))(LONG_PROMPT).input_ids
    with OnnxRuntime(b.file(m.target.formats["onnx"].file)) as t, OnnxRuntime(b.file(art.file)) as d:
        np.testing.assert_allclose(d.forward(ids, 4), t.forward(ids, 4)[:, keep], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_default_gguf_matches_the_transformers_path(tmp_path, hf_default):
    """The real default GGUF read without torch: the same token ids as transformers' GGUF tokenizer
    on a few dozen strings, and the fp32 graph of its weights gives transformers' path's logits."""
    pytest.importorskip("transformers")
    import onnx

    from edgespec.exporters.sources import load_source
    from edgespec.exporters.spec import spec_from_hf
    from edgespec.models.catalog import preset_source
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    strings = [*TEXTS, "multiple   internal    spaces", "tabs\tand\nnewlines\n\n\nthree", "日本語のテキストです。",
               "emoji 😀🎉👍🏽 mixed", "def f(x):\n    return x ** 2", "<bos>literal", "<unused0> reserved", " ", "\n",
               "Русский текст", "x" * 100, "don't can't", "{\"json\": [1, null]}", "\u200bzero\u200b", "\r\nwin\r\n",
               "a" + " " * 31 + "b", "<start_of_image>", "  two", "SELECT * FROM t;", "¡¿Qué?!"]
    path = preset_source()
    ours, ref = load_source(path), hf_default  # transformers' path, loaded once per session
    for s in strings:
        assert ours.tokenizer(s).input_ids == ref.tokenizer(s).input_ids, s
    weights = {k: v.detach().numpy() for k, v in ref.model.state_dict().items()}
    paths = []
    for name, spec, w in (("ours", ours.model.spec, ours.model.dequantized()),
                          ("ref", spec_from_hf(ref.model), weights)):
        paths.append(tmp_path / name / "model.onnx")
        paths[-1].parent.mkdir()
        onnx.save_model(build_decoder(spec, w, GraphOptions(kv_layout="append")), str(paths[-1]),
                        save_as_external_data=True, location="model.onnx.data")
    ids = ours.tokenizer(strings[0] + " " + strings[1]).input_ids
    with OnnxRuntime(paths[0]) as a, OnnxRuntime(paths[1]) as b:
        np.testing.assert_allclose(a.forward(ids, len(ids)), b.forward(ids, len(ids)), atol=1e-4, rtol=0)
