"""The compatibility matrix as a test: family x llama.cpp quant type x bundle format.

Each row writes a tiny random-weight GGUF of the family with gguf-py (tests/test_gguf_families.py),
quantizes it with llama.cpp's own quantizer (`llama_model_quantize`), exports it with `edgespec
export`, and checks the bundle against llama-cpp-python on the same file: next-token logits at every
position of a prompt within the row's stated tolerance, the first greedy ids, and speculative
decoding (prompt lookup, k = 4, verified in one target forward) token for token equal to plain
decoding. A row that cannot run records the documented reason instead (`NOT_RUNNABLE`).

Greedy ids are compared where both sides compute the same products: the F32 rows. A quantized row
multiplies the GGUF's own blocks, but llama.cpp first rounds the activations to 8 bits per block
(Q8_0 / Q8_K), onnxruntime its own way, and llama.cpp itself another way in a batch of many tokens
(its tiled GEMM) than in the reference's; on a random-weight model, whose next-token logits are full
of near-ties, the argmax may then differ at some positions, and the two roundings add up. So a
quantized row holds its logits to the exact product of the same blocks (llama.cpp on the file
expanded to F32 by its own quantizer, which dequantizes each block as its kernels do) within the
quant type's tolerance, and its top-1 to llama.cpp's on the quantized file at MIN_TOP1 of the
prompt's positions (the dequantized blocks themselves are checked bit for bit against gguf-py in
tests/test_gguf_quants.py).

Rows run in the default tier where marked in `DEFAULT_TIER` (under ~2 minutes on 2 cores); the
rest are slow. With EDGESPEC_MATRIX_OUT set, every row's outcome is appended to that JSON-lines
file, which dev/compat_matrix.py renders into docs/models.md's compatibility table.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp", reason="the reference is llama-cpp-python on the same GGUF")

from edgespec.bundle import load_bundle  # noqa: E402
from edgespec.engine.engine import load  # noqa: E402
from edgespec.exporters.export import ExportConfig, export_bundle  # noqa: E402
from edgespec.exporters.gguf.export import quantize  # noqa: E402
from tests.gguf_reference import llama_cpp_run  # noqa: E402
from tests.gguf_writers import FAMILY_SHAPES, SPM_SHAPES, write_spm_gguf  # noqa: E402
from tests.test_export_onnx import decode  # noqa: E402

# rows 256 wide: llama.cpp's K-quants need whole 256-wide super-blocks (narrower rows fall back to
# other types, and Q4_K_M would not be Q4_K at all); weights at 0.1 so that each product keeps the
# scale of its input, as a trained model's do (at 0.2 the random model amplifies rounding chaotically)
WIDE = dict(hidden=256, heads=4, kv=2, head_dim=64, ffn=256, std=0.1)
FAMILIES = {
    "llama": {**SPM_SHAPES["mistral"], **WIDE},
    **{name: {**shape, **WIDE} for name, shape in FAMILY_SHAPES.items()},
}
QUANTS = {"F32": 0, "Q8_0": 7, "Q4_0": 2, "Q4_K_M": 15}  # llama_ftype values
FORMATS = ("onnx", "gguf")
# logits tolerance per quant type (absolute, on logits up to ~10). F32: summation order, and
# llama.cpp's CPU GELU reads a half-precision table (gemma2); quantized weights: the distance from
# the exact product of the blocks, which the 8-bit rounding of the activations before the integer
# products opens. How far that rounding carries depends on the model: a family whose random layers
# amplify it (smollm3's) puts llama.cpp itself as far from the exact product, batched or not, so a
# row is also within tolerance up to RELATIVE times llama.cpp's own distance on the same file
ATOL = {"F32": 2e-4, "Q8_0": 0.5, "Q4_0": 0.5, "Q4_K_M": 1.0}
RELATIVE = 1.5
GELU_ATOL = 5e-3
MIN_TOP1 = 0.8
# a quantized mixture of experts: where a position's k-th and next expert are within rounding of each
# other, the two sides may route it apart and its logits jump (measured on the tiny qwen3moe: one
# position of 48 at 0.97 in Q4_0 and 0.49 in Q8_0, the others within 0.18; llama.cpp's own runtime
# in the gguf row jumps at the same position of Q4_0). Up to ROUTING_FLIPS positions may exceed the
# tolerance; the others are held to it
MOE = {"qwen3moe"}
ROUTING_FLIPS = 2
N_LOGITS = 48
N_GREEDY = 6
N_SPEC = 16
# (family, quant, format) -> the documented reason the row cannot run
NOT_RUNNABLE: dict[tuple[str, str, str], str] = {}
# the mixture of experts runs in the slow tier only: its default-tier checks are in tests/test_gguf_families.py
DEFAULT_TIER = ({(f, "F32", "onnx") for f in FAMILIES if f != "qwen3moe"}
                | {("llama", "Q4_K_M", "onnx"), ("phi3", "Q8_0", "gguf")})



def _rows():
    for fam in FAMILIES:
        for quant in QUANTS:
            for fmt in FORMATS:
                marks = () if (fam, quant, fmt) in DEFAULT_TIER else (pytest.mark.slow,)
                yield pytest.param(fam, quant, fmt, id=f"{fam}-{quant}-{fmt}", marks=marks)


def _record(**row) -> None:
    out = os.environ.get("EDGESPEC_MATRIX_OUT")
    if out:
        with open(out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """(family, quant) -> (the quantized GGUF, vocabulary size), written once per module."""
    cache: dict[tuple[str, str], tuple] = {}

    def get(fam: str, quant: str):
        """(the GGUF, its F32 expansion: the exact product of its blocks, the vocabulary size)"""
        if (fam, quant) not in cache:
            d = tmp_path_factory.mktemp(f"{fam}-{quant}")
            f32 = d / "f32.gguf"
            vocab = write_spm_gguf(f32, **FAMILIES[fam])
            src = exact = f32
            if quant != "F32":
                src, exact = d / f"{quant}.gguf", d / f"{quant}-as-f32.gguf"
                quantize(f32, src, QUANTS[quant])
                quantize(src, exact, QUANTS["F32"], allow_requantize=True)
            cache[fam, quant] = (src, exact, vocab)
        return cache[fam, quant]

    return get


def _llama_cpp(src, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    """llama-cpp-python's logits at every position of `ids` and its first greedy ids (F32 KV cache)."""
    return llama_cpp_run(src, ids, N_GREEDY)


def _ours(bundle, fmt: str, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    """The bundle's target on its backend: logits at every position of `ids`, then greedy ids."""
    path = bundle / load_bundle(bundle).manifest.target.formats[fmt].file
    if fmt == "gguf":
        from edgespec.runtimes.llamacpp.runtime import LlamaCppRuntime as Runtime
    else:
        from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime as Runtime
    with Runtime(path) as rt:
        logits = np.array(rt.forward(ids, len(ids)))
        out = [int(np.argmax(logits[-1]))]
        while len(out) < N_GREEDY:
            out.append(int(np.argmax(rt.forward(out[-1:], 1)[-1])))
    return logits, out


def _worst(a: np.ndarray, b: np.ndarray, spare: int) -> float:
    """The largest of each position's largest difference, past the `spare` worst positions."""
    return float(np.sort(np.abs(a - b).max(-1))[-1 - spare])


@pytest.mark.parametrize("fam, quant, fmt", list(_rows()))
def test_matrix_row(sources, tmp_path, fam, quant, fmt):
    row = dict(family=fam, quant=quant, format=fmt)
    if (fam, quant, fmt) in NOT_RUNNABLE:
        _record(**row, status="refused", reason=NOT_RUNNABLE[fam, quant, fmt])
        pytest.skip(NOT_RUNNABLE[fam, quant, fmt])
    src, exact_src, vocab = sources(fam, quant)
    bundle = export_bundle(ExportConfig(output=tmp_path / "b", target=src, draft=None, formats=(fmt,)))
    rng = np.random.default_rng(7)
    ids = [1] + [int(t) for t in rng.integers(3, vocab, size=N_LOGITS - 1)]
    ref, want = _llama_cpp(src, ids)
    exact = ref if exact_src == src else _llama_cpp(exact_src, ids)[0]
    ours, got = _ours(bundle, fmt, ids)
    assert ours.shape == ref.shape == exact.shape == (N_LOGITS, vocab)
    spare = ROUTING_FLIPS if fam in MOE and quant != "F32" else 0
    theirs = _worst(ref, exact, spare)  # llama.cpp's own runtime on the quantized file (0 on F32)
    atol = max(ATOL[quant], RELATIVE * theirs) if quant != "F32" or fam != "gemma2" else GELU_ATOL
    err, flips = _worst(ours, exact, spare), int((np.abs(ours - exact).max(-1) > atol).sum())
    _record(**row, status="fail", max_abs=err, atol=atol, flips=flips, llama_cpp=theirs)  # overwritten on a pass
    assert err <= atol, (f"logits {err:.2e} from the exact product (tolerance {atol}; {flips} positions "
                         f"beyond it; llama.cpp's own: {theirs:.2e})")
    if quant == "F32":
        assert got == want
    else:
        assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= MIN_TOP1

    # a prompt that repeats itself, so prompt lookup drafts; greedy speculative == plain
    prompt = [1] + [int(t) for t in rng.integers(3, vocab, size=12)] * 3
    backend = "llamacpp" if fmt == "gguf" else "onnxruntime"
    with load(bundle, backend=backend, use_draft=False) as engine:
        plain, drafted, _ = decode(engine, prompt, N_SPEC)
        assert drafted == 0
    with load(bundle, backend=backend, use_draft=False, drafter="ngram", k=4) as engine:
        spec, drafted, _ = decode(engine, prompt, N_SPEC)
    assert drafted > 0 and spec == plain
    _record(**row, status="pass", max_abs=err, atol=atol, flips=flips, llama_cpp=theirs)
