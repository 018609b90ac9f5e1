"""ONNX files read and cut at the wire level (runtimes/onnxruntime/wire.py), without the `onnx` package:
the body and head models are byte for byte what `onnx`'s own helpers build from the same file
(fp32, tied, GGUF-transcoded, unfused graphs with inline weights, a graph without the
recorded hidden size), inline tensors read as numpy_helper reads them, a broken file is a one-line
error, and opening bundles on onnxruntime (fused, draft on its own body, draft on the target's
body) never imports `onnx`."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from edgespec.bundle import load_bundle  # noqa: E402
from edgespec.errors import BackendError  # noqa: E402
from edgespec.runtimes.onnxruntime import graphs as onnx_graphs  # noqa: E402
from edgespec.runtimes.onnxruntime.wire import parse_model, read_model, tensor_array  # noqa: E402
from tests.zoo import DISAGREEING  # noqa: E402

# ---- the reference: the same cut made with onnx's helpers (what the runtime did before) ------

def _ref_cut(src, body: bool):
    g = src.graph
    neg = {n.output[0] for n in g.node if n.op_type == "Neg" and list(n.input) == ["n_logits"]}
    (cut,) = [n.output[0] for n in g.node if n.op_type == "Slice" and len(n.input) > 1 and n.input[1] in neg]
    meta = {p.key: p.value for p in src.metadata_props}
    if "edgespec.hidden_size" in meta:
        width = int(meta["edgespec.hidden_size"])
    else:
        consts = {t.name: t for t in g.initializer}
        (width,) = [int(numpy_helper.to_array(consts[n.input[1]])[-1]) for n in g.node
                    if n.op_type == "Reshape" and n.input[0] == cut and n.input[1] in consts]
    producer = {o: i for i, n in enumerate(g.node) for o in n.output}
    stop = None if body else cut
    wanted = [cut, *(o.name for o in g.output if o.name != "logits")] if body else ["logits"]
    keep, todo = set(), [o for o in wanted if o != stop]
    while todo:
        i = producer.get(todo.pop())
        if i is None or i in keep:
            continue
        keep.add(i)
        todo += [t for t in g.node[i].input if t and t != stop]
    nodes = [g.node[i] for i in sorted(keep)]
    hidden = helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, "N", width])
    if body:
        nodes.append(helper.make_node("Identity", [cut], ["hidden"], name="edgespec_hidden"))
        inputs, outputs = list(g.input), [hidden, *(o for o in g.output if o.name != "logits")]
    else:
        nodes.insert(0, helper.make_node("Identity", ["hidden"], [cut], name="edgespec_hidden"))
        inputs, outputs = [hidden], [o for o in g.output if o.name == "logits"]
    used = {t for n in nodes for t in n.input}
    graph = helper.make_graph(nodes, "edgespec_body" if body else "edgespec_head", inputs, outputs,
                              initializer=[t for t in g.initializer if t.name in used])
    model = helper.make_model(graph, opset_imports=list(src.opset_import), producer_name=src.producer_name)
    model.ir_version = src.ir_version
    model.metadata_props.extend(src.metadata_props)
    return model


def _check_cuts(path) -> None:
    src = onnx.load(str(path), load_external_data=False)
    model = read_model(path)
    assert model.to_bytes() == src.SerializeToString()  # read and written back: the same bytes
    assert onnx_graphs.body_model(model).to_bytes() == _ref_cut(src, body=True).SerializeToString()
    assert onnx_graphs.head_model(path, direct=False).to_bytes() == _ref_cut(src, body=False).SerializeToString()
    external = {t.name for t in src.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert onnx_graphs.gathered_tables(model) == sorted(
        {n.input[0] for n in src.graph.node if n.op_type == "Gather" and n.input[0] in external})
    sizes = sum(int(np.prod(t.dims)) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
                for t in src.graph.initializer)
    assert onnx_graphs.initializer_bytes(model, exclude=set()) == sizes > 0


def _target(bundle):
    return bundle / load_bundle(bundle).manifest.target.formats["onnx"].file


@pytest.mark.parametrize("name", ["llama", "gemma3-tied", "qwen2"])
def test_cuts_are_what_onnx_builds_byte_for_byte(zoo, name):
    _check_cuts(_target(zoo.bundle(name, DISAGREEING)))


def test_cuts_of_a_transcoded_gguf_fused_and_unfused_with_inline_weights(zoo, tmp_path):
    """GGUF blocks in MatMulNBits and a Gather on blocks; the unfused graph saved whole."""
    pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp", reason="quantizing a GGUF needs llama-cpp-python")
    from edgespec.exporters.gguf.source import read_gguf
    from edgespec.exporters.onnx.graph import GraphOptions, build_decoder

    src = zoo.bundle("gemma3-tied", None, formats=("gguf",), target_precision="int8")
    model = read_gguf(src / load_bundle(src).manifest.target.formats["gguf"].file)
    for fused in (True, False):
        path = tmp_path / ("fused" if fused else "unfused") / "model.onnx"
        path.parent.mkdir()
        onnx.save_model(build_decoder(model.spec, model.tensors, GraphOptions(fused_ops=fused)), str(path),
                        save_as_external_data=fused, location="model.onnx.data")
        _check_cuts(path)
        direct, kept = onnx_graphs.head_model(path), onnx_graphs.head_model(path, direct=False)
        assert [n.op_type for n in direct.nodes] == ["Identity", "MatMulNBits"]  # the tied head on the blocks
        rows = np.random.default_rng(4).standard_normal((3, model.spec.hidden_size)).astype(np.float32)
        for n in (1, 3):
            np.testing.assert_array_equal(_head_logits(direct, path.parent, rows[:n]),
                                          _head_logits(kept, path.parent, rows[:n]))


def _head_logits(model, folder, rows: np.ndarray) -> np.ndarray:
    sess = onnx_graphs.session(model, folder, threads=1, spin=False, initializers={})
    return sess.run(["logits"], {"hidden": rows[None]})[0][0]


@pytest.mark.parametrize("name, product", [("llama", "MatMul"), ("gemma3", "MatMul"), ("gemma3-tied", None)])
def test_a_direct_head_writes_the_same_logits_bit_for_bit(zoo, name, product):
    """Reshape -> MatMul -> Unsqueeze becomes one MatMul into `logits`; a head of another shape
    (the tied fp32 head's Gemm) is left as it is."""
    path = _target(zoo.bundle(name, DISAGREEING))
    direct, kept = onnx_graphs.head_model(path), onnx_graphs.head_model(path, direct=False)
    ops = [n.op_type for n in direct.nodes]
    if product is None:
        assert direct.to_bytes() == kept.to_bytes()
    else:
        assert ops == ["Identity", product] and direct.nodes[-1].outputs == ("logits",)
        assert len(direct.initializers) == len(kept.initializers) - 2  # the two shape constants
    width = int(direct.metadata_props["edgespec.hidden_size"])
    rng = np.random.default_rng(3)
    for n in (1, 2, 5):
        rows = rng.standard_normal((n, width)).astype(np.float32)
        np.testing.assert_array_equal(_head_logits(direct, path.parent, rows), _head_logits(kept, path.parent, rows))


def test_a_graph_without_its_recorded_hidden_size_reads_it_from_the_reshape(zoo, tmp_path):
    src = onnx.load(str(_target(zoo.bundle("llama", DISAGREEING))))
    kept = [p for p in src.metadata_props if p.key != "edgespec.hidden_size"]
    del src.metadata_props[:]
    src.metadata_props.extend(kept)
    path = tmp_path / "model.onnx"
    onnx.save_model(src, str(path))
    _check_cuts(path)


@pytest.mark.parametrize("tensor", [
    numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "raw_f32"),
    numpy_helper.from_array(np.array([-1, 640], dtype=np.int64), "raw_i64"),
    numpy_helper.from_array(np.array(3.5, dtype=np.float16), "raw_scalar_f16"),
    numpy_helper.from_array(np.zeros((0, 4), dtype=np.float32), "empty"),
    helper.make_tensor("typed_f32", TensorProto.FLOAT, [2, 2], [1.5, -2.0, 0.25, 1e30]),
    helper.make_tensor("typed_i64", TensorProto.INT64, [3], [-1, 0, 2**40]),
    helper.make_tensor("typed_i32", TensorProto.INT32, [2], [-7, 7]),
    helper.make_tensor("typed_f64", TensorProto.DOUBLE, [1], [0.1]),
], ids=lambda t: t.name)
def test_inline_tensors_read_as_numpy_helper_reads_them(tensor):
    graph = helper.make_graph([], "g", [], [], initializer=[tensor])
    (t,) = parse_model(helper.make_model(graph).SerializeToString()).initializers
    want = numpy_helper.to_array(tensor)
    got = tensor_array(t)
    assert t.name == tensor.name and t.dims == tuple(tensor.dims) and t.external is None
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_a_broken_or_missing_file_is_a_one_line_error(zoo, tmp_path):
    good = _target(zoo.bundle("llama", DISAGREEING)).read_bytes()
    for name, data in (("truncated", good[: len(good) // 2]), ("garbage", b"\xff" * 64), ("empty", b"")):
        path = tmp_path / f"{name}.onnx"
        path.write_bytes(data)
        with pytest.raises(BackendError) as e:
            onnx_graphs.body_model(path)
        assert path.name in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(BackendError, match="not found"):
        read_model(tmp_path / "absent.onnx")


# a fresh interpreter that refuses `import onnx` and runs `edgespec generate` on a bundle three ways
_NO_ONNX = textwrap.dedent("""
    import io, json, sys
    from contextlib import redirect_stdout

    tried = []

    class NoOnnx:
        def find_spec(self, name, path=None, target=None):
            if name == "onnx" or name.startswith("onnx."):
                tried.append(name)
                raise ImportError("onnx is blocked here")

    sys.meta_path.insert(0, NoOnnx())
    from edgespec.cli import main

    codes, texts = [], []
    for extra in (["--draft-body", "shared"], ["--draft-body", "own"], ["--no-draft"]):
        out = io.StringIO()
        with redirect_stdout(out):
            codes.append(main(["generate", sys.argv[1], "the cat", "--max-tokens", "12", "--backend", "onnxruntime",
                               "--threads", "1", *extra]))
        texts.append(out.getvalue())
    print(json.dumps({"codes": codes, "texts": texts, "tried": tried, "onnx": "onnx" in sys.modules,
                      "onnxruntime": "onnxruntime" in sys.modules}))
""")


def test_generate_on_onnxruntime_never_imports_onnx(zoo):
    bundle = zoo.bundle("gemma3-tied", DISAGREEING)
    proc = subprocess.run([sys.executable, "-c", _NO_ONNX, str(bundle)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["codes"] == [0, 0, 0] and got["onnxruntime"]
    assert got["tried"] == [] and not got["onnx"]
    assert got["texts"][0] == got["texts"][1] == got["texts"][2] != ""  # greedy: the same text every way


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_the_fused_graph_with_a_direct_head_gives_the_files_logits(zoo, name):
    """OnnxRuntime opens the whole graph rewritten (onnx_graphs.fused_model): the same logits, bit
    for bit, as a session of the file as written."""
    import onnxruntime as ort

    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    path = _target(zoo.bundle(name, DISAGREEING))
    model = onnx_graphs.fused_model(path)
    producer = {o: n.op_type for n in model.nodes for o in n.outputs}
    assert producer["logits"] == "MatMul" and len(model.nodes) == len(read_model(path).nodes) - 2
    ids = [int(t) for t in np.random.default_rng(6).integers(3, 200, 24)]
    with OnnxRuntime(path, threads=1) as rt:
        got = np.array(rt.forward(ids, n_logits=5))
        kv = rt.kv_buffers()[0].shape[1:]
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([ids]), "n_logits": np.array([5])}
    feeds.update({i.name: np.zeros((1, 0, *kv), np.float32) for i in plain.get_inputs()[2:]})
    np.testing.assert_array_equal(got, plain.run(["logits"], feeds)[0][0])
