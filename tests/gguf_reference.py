"""The same GGUF run by an edgespec bundle and by llama-cpp-python, and compared: next-token logits
at every position of a context (the far positions are where a RoPE scaling error has grown far above
rounding), then greedy ids decoded one forward at a time.

llama.cpp runs with an F32 KV cache here: its default F16 cache rounds K and V to half precision,
which moves these logits by ~2e-2 from a float64 reference while with an F32 cache llama.cpp and
edgespec's graphs both stay within 1e-4 of it; the half-precision cache's rounding, not a transcoding
error, is what flips some greedy tokens of a random-weight model at its near-ties.
"""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.bundle import load_bundle
from edgespec.cpus import usable_cpu_count
from edgespec.exporters.export import ExportConfig, export_bundle

__all__ = ["ATOL", "FAR", "GREEDY", "N_IDS", "assert_agrees", "edgespec_run", "llama_cpp_run"]

N_IDS = 300  # positions compared; the far one is past 250
FAR = 260
# measured: at most 4e-5 apart on logits up to ~8 (onnxruntime and OpenVINO f32 alike); without
# rope_freqs the llama3 model is 3e-3 off at position 1 and ~0.3 at FAR
ATOL = 2e-4
GREEDY = 8


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
    llm = llama_cpp.Llama(model_path=str(src), logits_all=True, n_ctx=512, n_threads=usable_cpu_count(), type_k=f32,
                          type_v=f32, verbose=False)
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
