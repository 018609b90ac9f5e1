"""The bench's roofline (edgespec/bench/roofline.py): what each forward reads whole
(Runtime.streamed), the bandwidth a time implies, and the machine's read bandwidth."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgespec.bench.roofline import describe, read_bandwidth, roofline
from edgespec.runtimes.base import Streamed

pytest.importorskip("onnxruntime")

from edgespec.runtimes.onnxruntime.graphs import streamed_of  # noqa: E402
from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime  # noqa: E402
from edgespec.runtimes.onnxruntime.split import open_shared_pair  # noqa: E402
from tests.test_onnxruntime_split import files, lean, lean_gguf  # noqa: E402,F401 - fixtures


def _model(tied: bool):
    """ids -> Gather(table) -> MatMul(w) -> MatMul(table^T) (tied) or MatMul(head)."""
    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.standard_normal((10, 4)).astype(np.float32), "table")
    w = numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "w")
    head = numpy_helper.from_array(rng.standard_normal((4, 10)).astype(np.float32), "head")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["x"]), helper.make_node("MatMul", ["x", "w"], ["h"])]
    inits = [table, w]
    if tied:
        nodes.append(helper.make_node("Gemm", ["h", "table"], ["logits"], transB=1))
    else:
        nodes.append(helper.make_node("MatMul", ["h", "head"], ["logits"]))
        inits.append(head)
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], initializer=inits)
    return helper.make_model(graph)


def test_a_gathered_table_is_read_by_rows_unless_a_product_reads_it():
    untied, tied = streamed_of(_model(tied=False)), streamed_of(_model(tied=True))
    assert untied == Streamed(weights=(16 + 40) * 4, ops=3)  # w and head, not the table
    assert tied == Streamed(weights=(16 + 40) * 4, ops=3)  # w and the table the head multiplies


def test_the_shared_pair_reads_the_fused_targets_weights(lean):  # noqa: F811 - the imported fixture
    """The split target (body, then its head) reads what the fused graph reads; a drafted token
    reads the body and the draft's trimmed head: less."""
    target, draft = files(lean)
    t, d = open_shared_pair(target, draft)
    with t, d, OnnxRuntime(target) as fused:
        whole, plain, drafted = fused.streamed(), t.streamed(), d.streamed()
        assert plain.weights == whole.weights > 0
        body = t.shared.body.streamed()
        assert drafted.weights == body.weights + d.head.streamed().weights < plain.weights
        assert plain.ops >= body.ops > 0


def test_roofline_rows_from_the_bench_costs():
    costs = {"ms": {"1": 10.0, "2": 12.0, "4": 16.0}, "draft_ms": 4.0}
    doc = roofline(Streamed(300_000_000, 900), Streamed(100_000_000, 880), costs, {"1": 20.0, "2": 40.0})
    assert [(r["role"], r["width"]) for r in doc["rows"]] == [("plain", 1), ("verify", 2), ("verify", 4), ("draft", 1)]
    plain = doc["rows"][0]
    assert plain["gb_s"] == pytest.approx(30.0) and plain["of_bandwidth"] == pytest.approx(0.75)  # of the best
    assert doc["rows"][-1]["gb_s"] == pytest.approx(25.0) and doc["draft_of_plain"] == pytest.approx(0.4)
    assert len(describe(doc)) == 4 and "75% of memory's" in describe(doc)[0]
    unknown = roofline(None, None, {"ms": {"1": 10.0}}, {"1": 20.0})
    assert unknown["rows"][0]["gb_s"] is None and "draft_of_plain" not in unknown
    assert roofline(None, None, None, {"1": 20.0}) is None  # no timings (static shapes): no roofline


def test_read_bandwidth_is_measured():
    one = read_bandwidth(1, nbytes=8 << 20, passes=2)
    assert 0.1 < one < 10_000  # GB/s: any machine, loaded or not
