"""A draft on the target's body on onnxruntime (runtimes/onnxruntime/split.py), on tiny models:
the split graph computes the fused graph's logits bit for bit (fp32 and GGUF-transcoded
MatMulNBits bundles, fused and unfused append graphs, padded rows), the draft's head on the
target's body gives the separate draft's logits where their bodies are the same blocks, the
exactness probe finds the pair exact where it finds the fused target exact, speculative greedy
on the pair is plain greedy, and a tied table is in memory once."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from edgespec.bundle import load_bundle  # noqa: E402
from edgespec.engine.engine import load  # noqa: E402
from edgespec.runtimes import BACKENDS  # noqa: E402
from edgespec.runtimes.exactness import probe  # noqa: E402
from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime  # noqa: E402
from edgespec.runtimes.onnxruntime.split import open_shared_pair  # noqa: E402
from tests.test_export_onnx import decode  # noqa: E402
from tests.zoo import DISAGREEING  # noqa: E402

SPLIT = "edgespec.runtimes.onnxruntime.split:open_shared_pair"


def files(path):
    m = load_bundle(path).manifest
    return path / m.target.formats["onnx"].file, path / m.draft.formats["onnx"].file


@pytest.fixture(scope="module")
def lean_gguf(zoo):
    """A tiny tied Gemma 3 GGUF in Q8_0 blocks (quantized by llama.cpp)."""
    pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp", reason="quantizing a GGUF needs llama-cpp-python")
    src = zoo.bundle("gemma3-tied", None, formats=("gguf",), target_precision="int8")
    return src / load_bundle(src).manifest.target.formats["gguf"].file


@pytest.fixture(scope="module")
def lean(lean_gguf, tmp_path_factory):
    """The GGUF's bundle: its blocks in MatMulNBits, a tied head on the embedding's blocks, and a
    self-draft whose body is the target's blocks under a 64-token VocabTrim head."""
    from edgespec.exporters.export import ExportConfig, export_bundle

    return export_bundle(ExportConfig(output=tmp_path_factory.mktemp("lean") / "b", target=lean_gguf,
                                      draft_vocab=64))


def ids_of(vocab: int, n: int, seed: int = 2) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


# a prefill, one-token decodes, verifies of several widths, a rollback and decodes again
STEPS = [(0, 20, 3), *[(i, i + 1, 1) for i in range(20, 26)], (26, 31, 5), (31, 40, 9), (34, 35, 1), (35, 36, 1)]


def assert_same_logits(split, fused, ids, steps=STEPS) -> None:
    for rt in (split, fused):
        rt.reset()
    for lo, hi, n in steps:
        if lo < split.n_past:  # a rejected draft: both roll back
            split.trim(lo)
            fused.trim(lo)
        np.testing.assert_array_equal(np.array(split.forward(ids[lo:hi], n_logits=n)),
                                      fused.forward(ids[lo:hi], n_logits=n), err_msg=f"{lo}:{hi}")


@pytest.mark.parametrize("pad_rows", [False, True], ids=["default", "padded"])
@pytest.mark.parametrize("name", ["llama", "gemma3-tied"])
def test_the_split_graph_computes_the_fused_logits_bit_for_bit(zoo, name, pad_rows):
    target, draft = files(zoo.bundle(name, DISAGREEING))
    pair = open_shared_pair(target, draft, pad_rows=pad_rows)
    with pair[0] as split, pair[1], OnnxRuntime(target, pad_rows=pad_rows) as fused:
        assert split.capabilities.extra["pad_rows"] == pad_rows
        assert_same_logits(split, fused, ids_of(fused.vocab_size, 40), STEPS if pad_rows else STEPS[:-2])


@pytest.mark.parametrize("pad_rows", [False, True], ids=["default", "padded"])
def test_the_lean_split_is_the_fused_target_and_the_separate_draft(lean, pad_rows):
    """On the GGUF bundle (int8 activations in MatMulNBits): target logits are the fused graph's,
    and the draft's are its own graph's, whose body is the same blocks (no layer cut)."""
    target, draft = files(lean)
    keep = load_bundle(lean).id_map()
    pair = open_shared_pair(target, draft, pad_rows=pad_rows)
    with pair[0] as t, pair[1] as d, OnnxRuntime(target, pad_rows=pad_rows) as fused, \
            OnnxRuntime(draft, pad_rows=pad_rows) as own:
        ids = ids_of(fused.vocab_size, 40)
        assert_same_logits(t, fused, ids)
        assert d.vocab_size == own.vocab_size == len(keep)
        d.reset()
        for lo, hi, n in ((0, 12, 2), (12, 13, 1), (13, 14, 1), (14, 18, 4)):
            got = np.array(d.forward(ids[lo:hi], n_logits=n))
            np.testing.assert_array_equal(got, own.forward(ids[lo:hi], n_logits=n), err_msg=f"{lo}:{hi}")
        # ...which are the target's logits at the kept ids (another MatMulNBits width: not bit for bit)
        fused.reset()
        np.testing.assert_allclose(got, fused.forward(ids[:18], n_logits=4)[:, keep], rtol=1e-4, atol=1e-4)


def test_the_tied_table_is_in_memory_once(lean):
    """The embedding's blocks are the tied head's: one mapping of the file, handed to the body's and
    the head's sessions (the fused graph holds it once too); the draft holds only its head."""
    target, draft = files(lean)
    t, d = open_shared_pair(target, draft)
    with t, d:
        body = t.shared.body
        shared = sorted(body._initializers)
        assert shared and all(n.startswith("model.embed_tokens.weight") for n in shared)
        assert sorted(t.head._values) == shared and not d.head._values
        for n in shared:
            assert t.head._values[n].data_ptr() == body._initializers[n].data_ptr()
        mem_t, mem_d = t.memory_bytes(), d.memory_bytes()
        with OnnxRuntime(target) as fused:
            assert mem_t["weights"] == fused.memory_bytes()["weights"]  # the file, counted once
            assert mem_t["kv"] == fused.memory_bytes()["kv"]
        vocab, hidden = load_bundle(lean).manifest.draft.vocab_size, t.head.hidden_size
        assert mem_d["kv"] == 0 and 0 < mem_d["weights"] < 2 * vocab * hidden  # 64 rows of blocks


@pytest.mark.parametrize("pad_rows", [False, True], ids=["default", "padded"])
def test_an_unfused_append_graph_splits_too(lean_gguf, tmp_path, pad_rows):
    """A graph without onnxruntime's fused kernels (GraphOptions(fused_ops=False): plain norms,
    RoPE and attention, no fused qkv): the same cut, the same bits. (Rollbacks in the padded mode
    only: in the default mode this graph's one-row forward rounds unlike a wider one, so after a
    rollback a row the shared body kept from a verify is not what the fused graph recomputes
    alone; the exactness probe finds that and picks the padded mode.)"""
    import onnx

    from edgespec.exporters.gguf.source import read_gguf
    from edgespec.exporters.onnx.graph import GraphOptions, build_decoder

    model = read_gguf(lean_gguf)
    path = tmp_path / "unfused" / "model.onnx"
    path.parent.mkdir()
    onnx.save_model(build_decoder(model.spec, model.tensors, GraphOptions(kv_layout="append", fused_ops=False)),
                    str(path))
    pair = open_shared_pair(path, path, pad_rows=pad_rows)
    with pair[0] as split, pair[1], OnnxRuntime(path, pad_rows=pad_rows) as fused:
        assert split.capabilities.fixed_kv and split.head.pad_rows == pad_rows
        assert_same_logits(split, fused, ids_of(fused.vocab_size, 40), STEPS if pad_rows else STEPS[:-2])


@pytest.mark.parametrize("pad_rows", [False, True], ids=["default", "padded"])
def test_the_probe_finds_the_pair_exact_where_the_fused_target_is(lean, pad_rows):
    target, draft = files(lean)
    pair = open_shared_pair(target, draft, pad_rows=pad_rows)
    with pair[0] as split, pair[1], OnnxRuntime(target, pad_rows=pad_rows) as fused:
        a, b = probe(split, 9), probe(fused, 9)
        assert a.exact == b.exact and a.exact_width == b.exact_width
        assert split.kernel_options() != fused.kernel_options()  # cached apart


@pytest.fixture
def shared_onnxruntime(monkeypatch):
    """The registry as the lead will flip it: onnxruntime runs a draft on the target's body."""
    monkeypatch.setitem(BACKENDS, "onnxruntime", replace(BACKENDS["onnxruntime"], shared_body=SPLIT))


@pytest.mark.parametrize("drafter", ["model", "both"])
def test_speculative_greedy_on_the_pair_is_plain_greedy(zoo, lean, shared_onnxruntime, drafter):
    """(The lean draft keeps 64 ids a random model seldom picks: it drafts, mostly rejected.)"""
    total = 0
    for path in (zoo.bundle("llama", DISAGREEING), lean):
        prompt = ids_of(load_bundle(path).manifest.target.vocab_size, 12, seed=5)
        with load(path, backend="onnxruntime", k=4, drafter=drafter, draft_body="shared") as engine, \
                load(path, backend="onnxruntime", use_draft=False) as plain:
            assert engine.shared_body and engine.draft.shared is engine.target.shared
            out, drafted, accepted = decode(engine, prompt, 40)
            assert drafted > 0
            total += accepted
            assert out == decode(plain, prompt, 40)[0]
            mem = engine.memory()
        assert mem["draft"]["kv"] == 0 and mem["draft"]["weights"] < mem["target"]["weights"] / 2
    assert total > 0, "rollback and acceptance both tested"


@pytest.mark.parametrize("bundle", ["fp32", "lean"])
def test_mapped_tables_leave_the_fused_graph_as_it_was(zoo, lean, bundle):
    """OnnxRuntime maps the tables a Gather reads (and lets their pages go): the same logits as a
    session that loaded every weight itself."""
    import onnxruntime as ort

    from edgespec.runtimes.onnxruntime.graphs import gathered_tables, load_proto

    target = files(zoo.bundle("gemma3-tied", DISAGREEING) if bundle == "fp32" else lean)[0]
    with OnnxRuntime(target) as rt:
        assert sorted(rt._initializers) == gathered_tables(load_proto(target)) != []
        ids = ids_of(rt.vocab_size, 30)
        got = np.array(rt.forward(ids, n_logits=4))
        kv = rt.kv_buffers()[0].shape[1:]
    plain = ort.InferenceSession(str(target), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([ids]), "n_logits": np.array([4])}
    feeds.update({i.name: np.zeros((1, 0, *kv), np.float32) for i in plain.get_inputs()[2:]})
    np.testing.assert_array_equal(got, plain.run(["logits"], feeds)[0][0])


def test_a_graph_without_an_edgespec_head_is_a_one_line_error(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from edgespec.errors import BackendError

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4])
    path = tmp_path / "other.onnx"
    onnx.save_model(helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["logits"])], "g", [x], [y])),
                    str(path))
    with pytest.raises(BackendError, match="not an edgespec decoder graph with a head to cut") as e:
        open_shared_pair(path, path)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- the target head's rows, for the draft


@pytest.mark.parametrize("bundle", ["llama", "gemma3-tied", "lean"])
def test_the_draft_holds_the_target_heads_row_of_any_token(zoo, lean, bundle):
    """vocab_rows(ids): the target head's weights, exactly: the head fed one-hot rows (which its
    int8 input quantization keeps exact) returns them; hidden @ rows.T is the target's logits at
    those ids (a float head exactly, MatMulNBits to its input rounding). Untied (llama: the head's
    own tensor), tied fp32 and tied GGUF blocks."""
    path = lean if bundle == "lean" else zoo.bundle(bundle, DISAGREEING)
    pair = open_shared_pair(*files(path))
    with pair[0] as t, pair[1] as d:
        assert t.vocab_rows is None and d.vocab_rows is not None
        pick = np.array([0, 5, t.vocab_size - 1, 7, 3])
        rows = d.vocab_rows(pick)
        h = rows.shape[1]
        assert rows.shape == (len(pick), t.head.hidden_size) and rows.dtype == np.float32
        one_hot = np.array(t.head(np.eye(h, dtype=np.float32)))[:, pick].T
        np.testing.assert_allclose(rows, one_hot, rtol=1e-5, atol=1e-7)
        ids = ids_of(t.vocab_size, 12)
        logits = np.array(t.forward(ids, n_logits=4))
        got = d.hidden_rows(ids, 4) @ rows.T
        tol = 1e-4 if bundle != "lean" else 2e-2 * float(np.abs(logits).max())
        np.testing.assert_allclose(got, logits[:, pick], atol=tol)
        with pytest.raises(ValueError, match="outside the head's vocabulary"):
            d.vocab_rows(np.array([t.vocab_size]))


@pytest.mark.parametrize("bits, zero_points", [(4, False), (4, True), (8, False), (8, True)])
def test_nbits_rows_dequantize_as_onnxruntime_multiplies(bits, zero_points):
    """A MatMulNBits node built here (every bit width and zero-point form the exporter may write):
    its product with the identity is W transposed, which `nbits_rows` reads row by row."""
    onnx = pytest.importorskip("onnx")
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from edgespec.runtimes.onnxruntime.head_rows import nbits_rows

    k, n, block = 80, 12, 32
    blocks, blob = -(-k // block), block * bits // 8
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (n, blocks, blob), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, n * blocks).astype(np.float32)
    zp = rng.integers(0, 256, n * -(-blocks * bits // 8), dtype=np.uint8) if zero_points else None
    inits = [helper.make_tensor("B", TensorProto.UINT8, codes.shape, codes.tobytes(), raw=True),
             helper.make_tensor("S", TensorProto.FLOAT, scales.shape, scales)]
    if zp is not None:
        inits.append(helper.make_tensor("Z", TensorProto.UINT8, zp.shape, zp.tobytes(), raw=True))
    node = helper.make_node("MatMulNBits", ["A", "B", "S"] + (["Z"] if zero_points else []), ["Y"],
                            domain="com.microsoft", K=k, N=n, bits=bits, block_size=block)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [k, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [k, n])], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    weights_t = sess.run(None, {"A": np.eye(k, dtype=np.float32)})[0]  # (K, N)
    read = nbits_rows(codes, scales, zp, k, bits)
    ids = np.array([3, 0, 11, 3])
    np.testing.assert_allclose(read(ids), weights_t[:, ids].T, rtol=1e-6, atol=1e-7)
    assert onnx is not None
