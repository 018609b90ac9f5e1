"""The GGUF format of a GGUF source is the file itself (plus drafts cut from it tensor by tensor),
whatever its block types: tiny GGUFs quantized by llama.cpp's own quantizer to types edgespec
cannot transcode export with `--format gguf` and decode on llama.cpp with speculative == plain,
while `--format onnx` refuses them in one line naming the type. The trimmed draft's
full-vocabulary twin passes llama.cpp's draft/target vocabulary rule (read through
llama-cpp-python's vocabulary API) and generates standalone in llama-cpp-python."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'edgespec[llamacpp]')")
pytest.importorskip("gguf")

from edgespec.bundle import load_bundle  # noqa: E402
from edgespec.engine.engine import load  # noqa: E402
from edgespec.exporters.export import ExportConfig, export_bundle  # noqa: E402
from edgespec.exporters.gguf.export import quantize  # noqa: E402
from edgespec.exporters.gguf.reader import open_gguf  # noqa: E402
from edgespec.exporters.gguf.transcode import TRANSCODABLE, quant_type_name  # noqa: E402
from edgespec.exporters.gguf.vocab_check import CHECK_START_ID, MAX_SIZE_DIFFERENCE  # noqa: E402
from tests.test_export_onnx import decode  # noqa: E402
from tests.tiny import PROMPTS, make_config, make_tokenizer  # noqa: E402

GGUF = ("gguf",)
N_NEW = 12
# llama.cpp's file types: rows of 256 (K-quant and i-quant super-blocks) keep these types in the
# tiny model's matrices instead of falling back to a 32-block type. IQ3_S is one no format of
# edgespec but the GGUF one can take (UNTRANSCODABLE)
FTYPES = {"IQ4_XS": 30, "Q2_K": 10, "IQ3_S": 26}
UNTRANSCODABLE = "IQ3_S"
WIDE = 256


def make_wide_gguf(out: Path, *, seed: int = 0, layers: int = 2, hidden: int = WIDE, family: str = "llama") -> Path:
    """An fp32 GGUF of a tiny random model whose rows are one 256-block wide (written by edgespec's
    GGUF writer from a transformers model of the in-process tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    src = out.with_suffix(".hf")
    tok = make_tokenizer()
    cfg = make_config(family, len(tok), layers=layers)
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = hidden, 2 * hidden, hidden // cfg.num_attention_heads
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.2)
    model.save_pretrained(src)
    tok.save_pretrained(src)
    b = export_bundle(ExportConfig(output=out.with_suffix(".bundle"), target=src, formats=GGUF, draft=None,
                                   target_precision="fp32"))
    os.replace(b / "target" / "model.gguf", out)
    return out


def block_types(path: Path) -> set[str]:
    return {quant_type_name(t.tensor_type) for t in open_gguf(path).tensors}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """type -> a tiny GGUF quantized to it by llama.cpp (from one fp32 source)."""
    root = tmp_path_factory.mktemp("quantized")
    f32 = make_wide_gguf(root / "tiny-f32.gguf")
    out = {}
    for name, ftype in FTYPES.items():
        out[name] = root / f"tiny-{name}.gguf"
        quantize(f32, out[name], ftype)
    return out


@pytest.fixture(scope="module")
def cut_bundle(quantized, tmp_path_factory):
    """type -> the `--format gguf` bundle of its tiny GGUF with a one-layer, 64-row draft cut from
    it, exported once (its VocabTrim calibration decodes a few thousand tokens on llama.cpp)."""
    bundles = {}

    def get(qtype: str) -> Path:
        if qtype not in bundles:
            out = tmp_path_factory.mktemp(f"cut-{qtype}") / "b"
            bundles[qtype] = export_bundle(ExportConfig(output=out, target=quantized[qtype], formats=GGUF,
                                                        draft_vocab=64, draft_layers=1))
        return bundles[qtype]

    return get


def _assert_cut_of(src: Path, draft: Path, layers: list[int], keep) -> None:
    """Every tensor of the cut draft is the source's bytes: kept layers renumbered, the K-row head
    the source head's rows `keep`, nothing decoded or re-encoded."""
    s = {t.name: t for t in open_gguf(src).tensors}
    d = {t.name: t for t in open_gguf(draft).tensors}
    head = s.get("output.weight", s["token_embd.weight"])
    rows = np.asarray(head.data).reshape(int(head.shape[-1]), -1)[keep]
    assert d["token_embd.weight"].tensor_type == head.tensor_type
    np.testing.assert_array_equal(np.asarray(d["token_embd.weight"].data).reshape(len(keep), -1), rows)
    expect = {"output_norm.weight"} | {n.replace(f"blk.{li}.", f"blk.{j}.", 1) for j, li in enumerate(layers)
                                      for n in s if n.startswith(f"blk.{li}.")}
    assert set(d) == expect | {"token_embd.weight"}
    for j, li in enumerate(layers):
        for n in (n for n in s if n.startswith(f"blk.{li}.")):
            got = d[n.replace(f"blk.{li}.", f"blk.{j}.", 1)]
            assert got.tensor_type == s[n].tensor_type
            np.testing.assert_array_equal(np.asarray(got.data), np.asarray(s[n].data))


def _greedy(bundle: Path, use_draft: bool) -> tuple[list[list[int]], int]:
    outs, drafted = [], 0
    kw = dict(k=4, drafter="model") if use_draft else dict(use_draft=False)
    with load(bundle, backend="llamacpp", **kw) as engine:
        if use_draft:
            assert engine.draft is not None and engine.draft_backend == "llamacpp"
        for prompt in PROMPTS:
            out, d, _ = decode(engine, engine.tokenizer.encode(prompt), N_NEW)
            outs.append(out)
            drafted += d
    return outs, drafted


@pytest.mark.parametrize("qtype", list(FTYPES))
def test_gguf_format_copies_any_block_type_and_decodes_exactly(quantized, cut_bundle, qtype):
    src = quantized[qtype]
    assert qtype in block_types(src)  # the file really holds the type under test
    out = cut_bundle(qtype)
    m = load_bundle(out).manifest
    art = m.target.formats["gguf"]
    assert art.quantization["passthrough"] is True and art.quantization["type"] == qtype
    assert (out / art.file).read_bytes() == src.read_bytes()
    # the draft: one layer and 64 head rows cut from the file, its blocks as they were
    d = m.draft.formats["gguf"]
    assert m.draft.n_layers == 1 and m.draft.vocab_size == 64
    assert d.quantization["head"] == "trimmed" and qtype in block_types(out / d.file)
    assert block_types(out / d.file) <= block_types(src)
    _assert_cut_of(src, out / d.file, layers=m.draft.layers, keep=load_bundle(out).id_map())
    plain, _ = _greedy(out, use_draft=False)
    spec, drafted = _greedy(out, use_draft=True)
    assert drafted > 0 and all(len(set(p)) > 2 for p in plain)
    assert spec == plain


def test_onnx_refuses_an_untranscodable_type_by_name(quantized, tmp_path):
    src = quantized[UNTRANSCODABLE]
    missing = sorted(t for t in block_types(src) if t not in TRANSCODABLE)
    assert UNTRANSCODABLE in missing, "the type became transcodable: pick another for this test"
    out = tmp_path / "b"
    proc = subprocess.run([sys.executable, "-m", "edgespec", "export", "--target", str(src),
                           "-o", str(out), "--format", "onnx"], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("edgespec: error:") and UNTRANSCODABLE in lines[0], lines[0]
    assert not out.exists()


def _vocab(lib, model):
    v = lib.llama_model_get_vocab(model)
    n = lib.llama_vocab_n_tokens(v)
    return dict(kind=lib.llama_vocab_type(v), add_bos=lib.llama_vocab_get_add_bos(v),
                add_eos=lib.llama_vocab_get_add_eos(v), bos=lib.llama_vocab_bos(v), eos=lib.llama_vocab_eos(v),
                texts=[ctypes.string_at(lib.llama_vocab_get_text(v, i)) for i in range(n)])


def test_full_vocabulary_draft_passes_llamas_rule_and_runs_standalone(cut_bundle):
    """What `llama-server -m target.gguf -md draft.gguf` checks before it pairs the two
    (common_speculative_are_compatible), through llama-cpp-python's vocabulary API; then the
    draft alone generates in llama-cpp-python."""
    import llama_cpp
    from llama_cpp import Llama

    out = cut_bundle("Q2_K")  # the bundle the Q2_K row above checked
    art = load_bundle(out).manifest.draft.formats["gguf"]
    full = out / art.quantization["standalone"]
    assert full.name == "model.full.gguf" and full != out / art.file
    t_llm = Llama(str(out / "target" / "model.gguf"), vocab_only=True, verbose=False)
    d_llm = Llama(str(full), n_ctx=128, verbose=False)
    t, d = _vocab(llama_cpp, t_llm.model), _vocab(llama_cpp, d_llm.model)
    assert d_llm.n_vocab() == t_llm.n_vocab() > 64  # the twin has the whole head, not the trimmed one
    for key in ("kind", "add_bos", "add_eos", "bos", "eos"):
        assert t[key] == d[key], key
    assert abs(len(t["texts"]) - len(d["texts"])) <= MAX_SIZE_DIFFERENCE
    assert t["texts"][CHECK_START_ID:] == d["texts"][CHECK_START_ID:] and len(set(t["texts"])) > 100
    assert d_llm.metadata["general.architecture"] == "llama" and int(d_llm.metadata["llama.block_count"]) == 1
    ids = d_llm.tokenize(PROMPTS[0].encode())
    gen = []
    for tok in d_llm.generate(ids, temp=0.0):
        gen.append(tok)
        if len(gen) == 6:
            break
    assert len(gen) == 6 and all(0 <= g < d_llm.n_vocab() for g in gen)


def test_another_precision_is_requantized_by_llama_cpp_file_to_file(quantized, tmp_path):
    """--target-precision / --draft-precision on a GGUF source: llama.cpp's quantizer from the
    file's own blocks (allow_requantize), the draft cut first, its full twin requantized too."""
    src = quantized[UNTRANSCODABLE]
    out = export_bundle(ExportConfig(output=tmp_path / "b", target=src, formats=GGUF, target_precision="int8",
                                     draft_precision="int8", draft_vocab=64, draft_layers=1))
    m = load_bundle(out).manifest
    t, d = m.target.formats["gguf"], m.draft.formats["gguf"]
    assert t.precision == d.precision == "int8"
    assert t.quantization["type"] == d.quantization["type"] == "Q8_0"
    assert t.quantization["requantized_from"] == UNTRANSCODABLE
    for f in (out / t.file, out / d.file, out / d.quantization["standalone"]):
        assert "Q8_0" in block_types(f) and UNTRANSCODABLE not in block_types(f), f
    assert not list((out / "draft").glob("*.src.gguf"))  # the staged cut is removed
    plain, _ = _greedy(out, use_draft=False)
    spec, drafted = _greedy(out, use_draft=True)
    assert drafted > 0 and spec == plain
