"""The runtimes' own options, checked with edgespec.checks when a runtime is built: a bad one is a
BackendError naming it, its bound and the value, before any model file is read."""
from __future__ import annotations

import importlib

import pytest

from edgespec.errors import BackendError

RUNTIMES = {"onnxruntime": ("edgespec.runtimes.onnxruntime.runtime", "OnnxRuntime"),
            "openvino": ("edgespec.runtimes.openvino.runtime", "OpenVinoRuntime")}


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
@pytest.mark.parametrize(("option", "value", "message"), [
    ("kv_capacity", 0, "kv_capacity must be an integer >= 1, got 0"),
    ("kv_capacity", True, "kv_capacity must be an integer >= 1, got True"),
    ("kv_capacity", 2.5, "kv_capacity must be an integer >= 1, got 2.5"),
    ("output", "probs", "output must be one of logits, hidden, got 'probs'"),
])
def test_a_runtime_names_a_bad_option_before_it_opens_anything(tmp_path, runtime, option, value, message):
    pytest.importorskip(runtime)
    module, name = RUNTIMES[runtime]
    cls = getattr(importlib.import_module(module), name)
    with pytest.raises(BackendError) as e:
        cls(tmp_path / "missing.onnx", **{option: value})
    assert str(e.value).endswith(message)
