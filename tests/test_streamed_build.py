"""The bundle build streams: GGUF tensors stay in the file until a writer reads them (in row
chunks), initializers go to the ONNX data file as they are made, the GGUF header is read without
gguf-py's per-item objects, and a build under a memory budget stops before a phase that would not
fit. The files are the ones the in-memory path writes, byte for byte. On tiny GGUFs written here
with gguf-py (Q8_0, Q4_0, Q5_0, Q4_1, BF16, F16 and F32 matrices)."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("onnx")
import onnx  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from edgespec.errors import MemoryBudgetError  # noqa: E402
from edgespec.exporters.export import ExportConfig, export_bundle, write_streamed  # noqa: E402
from edgespec.exporters.gguf.deferred import Deferred, LazyTensors  # noqa: E402
from edgespec.exporters.gguf.reader import open_gguf  # noqa: E402
from edgespec.exporters.gguf.source import read_gguf  # noqa: E402
from edgespec.exporters.gguf.transcode import BlockWeight, transcode  # noqa: E402
from edgespec.exporters.onnx.graph import GraphOptions, build_decoder  # noqa: E402
from tests.gguf_writers import family_gguf  # noqa: E402

TYPES = (T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_1, T.BF16, T.F16, T.F32)
ROWS, COLS = 48, 128


def _write(path, arrays: dict):
    """A GGUF holding `arrays` (name -> (float32 matrix, type)), quantized by gguf-py, plus metadata
    of every value kind (a string array, a float array, nested arrays)."""
    from gguf import GGUFWriter
    from gguf.quants import quantize

    w = GGUFWriter(str(path), "llama")
    w.add_string("general.name", "tiny ünïcode")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "▁c", "<0x0A>"])
    w.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0, 3.5])
    w.add_array("llama.nested", [[1, 2], [3, 4]])
    w.add_bool("llama.flag", True)
    w.add_uint32("llama.block_count", 2)
    for name, (a, t) in arrays.items():
        q = quantize(a, t)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=t) if q.dtype == np.uint8 else w.add_tensor(name, q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def matrices(tmp_path_factory):
    rng = np.random.default_rng(0)
    arrays = {f"m.{t.name}": (rng.normal(size=(ROWS, COLS)).astype(np.float32), t) for t in TYPES}
    return _write(tmp_path_factory.mktemp("gguf") / "m.gguf", arrays)


def _equal(a, b) -> None:
    if isinstance(a, BlockWeight):
        assert isinstance(b, BlockWeight) and (a.bits, a.block_size, a.source_type) == (b.bits, b.block_size,
                                                                                       b.source_type)
        for f in ("codes", "scales", "zero_points", "mins"):
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None) == (y is None), f
            if x is not None:
                np.testing.assert_array_equal(x, y, err_msg=f)
    else:
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_header_reads_as_gguf_py_reads_it(matrices):
    """Every field (types, contents) and tensor (type, shape, offset, bytes, data) as GGUFReader has it."""
    ref, ours = gguf.GGUFReader(str(matrices)), open_gguf(matrices)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for k in keys:
        assert ours.fields[k].types == ref.fields[k].types, k
        assert ours.fields[k].contents() == ref.fields[k].contents(), k
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.n_elements, a.n_bytes, int(a.data_offset)) == \
            (b.tensor_type, b.n_elements, b.n_bytes, int(b.data_offset)), a.name
        assert a.shape.tolist() == b.shape.tolist() and a.data.dtype == b.data.dtype
        np.testing.assert_array_equal(a.data, b.data)


@pytest.mark.parametrize("chunk", [1, 700, 1 << 20], ids=["row-by-row", "some-rows", "whole"])
def test_deferred_tensors_transcode_as_the_whole_tensor_does(matrices, chunk):
    """Read in chunks of any size, with any rows picked in any order: what transcode gives at once."""
    reader = open_gguf(matrices)
    pick = np.array([40, 3, 3, 17, 0, 47, 20])
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        whole = transcode(t.data, t.tensor_type, shape, t.name)
        d = Deferred(matrices, int(t.data_offset), int(t.n_bytes), int(t.tensor_type), shape, t.name)
        _equal(d.load(chunk), whole)
        picked = d.rows(pick).rows(slice(1, None))  # rows of rows compose
        assert picked.shape == (len(pick) - 1, COLS)
        _equal(picked.load(chunk), whole.rows(pick[1:]) if isinstance(whole, BlockWeight) else whole[pick[1:]])


def test_sparse_rows_are_read_a_chunk_at_a_time(tmp_path):
    """The first and last rows of a 4 MB table: two reads of a chunk each, never the span between
    them (a trimmed head keeps one row in sixteen, spread over the whole table)."""
    table = np.random.default_rng(1).normal(size=(4096, 256)).astype(np.float32)
    src = _write(tmp_path / "t.gguf", {"t": (table, T.F32)})
    t = open_gguf(src).tensors[0]
    d = Deferred(src, int(t.data_offset), int(t.n_bytes), int(t.tensor_type), table.shape, t.name)
    tracemalloc.start()
    try:
        rows = d.rows([4095, 0]).load(chunk_bytes=64 << 10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(rows, table[[4095, 0]])
    assert peak < table.nbytes / 8, peak  # a chunk's worth (64 KiB) and the file's buffer, not the table


def test_a_gguf_model_reads_its_matrices_only_when_asked(tmp_path):
    """read_gguf leaves matrices in the file (LazyTensors of Deferred): each read gives what the
    eager reader decoded, a trimmed head reads its rows only, and nothing is kept between reads."""
    src, _ = family_gguf(tmp_path, "phi3")  # fused qkv and gate/up: split into deferred row ranges
    lazy, eager = read_gguf(src), read_gguf(src, load=transcode)
    assert isinstance(lazy.tensors, LazyTensors) and set(lazy.tensors) == set(eager.tensors)
    deferred = [k for k in lazy.tensors if lazy.tensors.in_file(k)]
    assert "model.layers.0.self_attn.q_proj.weight" in deferred and "model.embed_tokens.weight" in deferred
    for k in lazy.tensors:
        _equal(lazy.tensors[k], eager.tensors[k])
    keep = np.array([5, 1, 9])
    _equal(lazy.tensors.rows("lm_head.weight", keep), eager.tensors["lm_head.weight"][keep])
    assert lazy.tensors["model.embed_tokens.weight"] is not lazy.tensors["model.embed_tokens.weight"]


def _write_graph(folder, streamed: bool, weights, spec):
    path = folder / "model.onnx"
    opts = GraphOptions(kv_layout="append", nbits_accuracy=4)
    if streamed:
        write_streamed(spec, weights, opts, path)
    else:
        folder.mkdir()
        onnx.save_model(build_decoder(spec, weights, opts), str(path), save_as_external_data=True,
                        all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=1024)
    return folder


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_streamed_graph_files_are_the_in_memory_ones_and_hold_one_tensor(tmp_path):
    """The ONNX graph written initializer by initializer is save_model's byte for byte, and its
    build never holds the model: Python's allocations (numpy's included; protobuf's own are not
    traced) peak below half of the weights. Everything is imported before tracing starts."""
    src, _ = family_gguf(tmp_path, "gemma2", hidden=512, layers=4, ffn=1024)  # weights well above the graph
    model, eager = read_gguf(src), read_gguf(src, load=transcode).tensors
    total = sum(eager[k].nbytes for k in eager)
    tracemalloc.start()
    try:
        streamed = _write_graph(tmp_path / "streamed", True, model.tensors, model.spec)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    a, b = _files(streamed), _files(_write_graph(tmp_path / "kept", False, eager, model.spec))
    assert a.keys() == b.keys() == {"model.onnx", "model.onnx.data"}
    assert a == b
    # the largest matrix is under a tenth of the weights; holding them (a cache in LazyTensors, a list of
    # transcoded tensors) would pass `total`
    assert peak < total / 2, (peak, total)


def test_a_build_that_does_not_fit_the_budget_stops_before_any_work(tmp_path):
    src, _ = family_gguf(tmp_path, "gemma2")
    out = tmp_path / "b"
    with pytest.raises(MemoryBudgetError, match=r"building the bundle needs about .* more than --memory-budget"):
        export_bundle(ExportConfig(output=out, target=src, memory_budget="1MB"))
    assert not out.exists() and not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_a_build_within_its_budget_writes_the_same_bundle(tmp_path):
    """A budget the build fits changes nothing it writes (the checks only read the process's RSS)."""
    import psutil

    src, _ = family_gguf(tmp_path, "gemma2")
    budget = psutil.Process().memory_info().rss + (2 << 30)
    a = export_bundle(ExportConfig(output=tmp_path / "a", target=src, draft_vocab=None, memory_budget=budget))
    b = export_bundle(ExportConfig(output=tmp_path / "b", target=src, draft_vocab=None))
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
