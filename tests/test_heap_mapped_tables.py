"""MappedTables lets a table's pages go while sessions prepack it, and stops at drop_pages()."""
from __future__ import annotations

import mmap
import sys
import time

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper  # noqa: E402

from edgespec.runtimes.onnxruntime import graphs as onnx_graphs  # noqa: E402
from edgespec.runtimes.onnxruntime.graphs import MappedTables  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"),
                                reason="resident pages are read from /proc (Linux)")

ROWS, WIDTH = 512, 1024  # a 2 MiB float32 table


def _model(folder, table: np.ndarray):
    (folder / "w.bin").write_bytes(table.tobytes())
    t = TensorProto(name="table", data_type=TensorProto.FLOAT, dims=table.shape)
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "w.bin"), ("offset", "0"), ("length", str(table.nbytes))):
        t.external_data.add(key=k, value=v)
    g = helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["out"])], "g",
                          [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], initializer=[t])
    return helper.make_model(g)


def _resident_kib(path) -> int:
    """KiB of `path`'s mappings resident in this process."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def _touch(a: np.ndarray) -> float:
    return float(a.sum(dtype=np.float64))


def _wait_until(cond, seconds: float = 2.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(onnx_graphs.SHED_SECONDS)
    return cond()


def test_pages_go_while_loading_and_stay_after_drop_pages(tmp_path):
    table = np.arange(ROWS * WIDTH, dtype=np.float32).reshape(ROWS, WIDTH)
    tables = MappedTables(_model(tmp_path, table), tmp_path, ["table"])
    path = tmp_path / "w.bin"
    mapped = tables.arrays["table"]
    assert _touch(mapped) == _touch(table)  # what is read is the file's data, however often pages go
    # until drop_pages, the pages read are let go again (a session prepacking reads each once)
    assert _wait_until(lambda: _resident_kib(path) < 64)
    assert _touch(mapped) == _touch(table)
    tables.drop_pages()
    time.sleep(5 * onnx_graphs.SHED_SECONDS)
    rows = mapped[::64].copy()  # a Gather's rows come back, and now stay
    time.sleep(10 * onnx_graphs.SHED_SECONDS)
    assert _resident_kib(path) > 0
    np.testing.assert_array_equal(rows, table[::64])


def test_shedding_stops_when_the_tables_go(tmp_path):
    import threading

    before = {t for t in threading.enumerate() if t.name == "edgespec-shed-pages"}
    tables = MappedTables(_model(tmp_path, np.ones((ROWS, WIDTH), np.float32)), tmp_path, ["table"])
    assert {t for t in threading.enumerate() if t.name == "edgespec-shed-pages"} - before
    del tables
    assert _wait_until(lambda: not {t for t in threading.enumerate() if t.name == "edgespec-shed-pages"} - before)


def test_session_built_while_shedding_reads_the_table(tmp_path):
    pytest.importorskip("onnxruntime")
    table = np.random.default_rng(0).standard_normal((ROWS, WIDTH)).astype(np.float32)
    model = _model(tmp_path, table)
    tables = MappedTables(model, tmp_path, ["table"])
    values = onnx_graphs.ort_values(tables.arrays)
    sess = onnx_graphs.session(model, tmp_path, threads=1, spin=False, initializers=values)
    tables.drop_pages()
    ids = np.array([0, 7, ROWS - 1], dtype=np.int64)
    np.testing.assert_array_equal(sess.run(None, {"ids": ids})[0], table[ids])


def test_drop_file_pages_keeps_written_mappings(tmp_path):
    from edgespec.runtimes.heap import drop_file_pages

    path = tmp_path / "weights.bin"
    data = np.arange(4 * ROWS * WIDTH, dtype=np.float32)
    path.write_bytes(data.tobytes())
    clean = np.memmap(path, dtype=np.float32, mode="c")  # private and writable, as onnxruntime maps
    assert _touch(clean) == _touch(data) and _resident_kib(path) > 1024
    written = np.memmap(path, dtype=np.float32, mode="c", shape=(WIDTH,))
    written[0] = -1.0  # a page of its own now: its mapping must keep it
    assert drop_file_pages([path]) >= 1
    assert _resident_kib(path) <= 8  # the written mapping's page, nothing of the clean one
    assert written[0] == -1.0 and _touch(clean) == _touch(data)
