"""OpenVINO's own state as the KV holder: the previous exact mode, a baseline the OpenVINO tests
hold the runtime's holders against. It is not part of the package: a test registers it under
"state" for its own run (`register(monkeypatch)`, then `OpenVinoRuntime(ir, kv="state")`), so the
runtime's `kv` takes only names of holders the package has.

The IR is made stateful at load (the past inputs become OpenVINO variables, as optimum-intel's
stateful export does) and the plugin appends in place; a rollback writes the kept prefix back into
each variable, 6-10 ms at 300 positions on Gemma 3 270M, and speculative decoding rolls back most
steps. The variables would keep padded keys, so the attention is not padded and activations stay
f32 (the CPU plugin's dynamic int8 quantization would make a verify round unlike one-token decodes).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgespec.runtimes.openvino.graph import make_stateful
from edgespec.runtimes.openvino.kv import KV_KINDS, KVHolder, KVLayout, KVPlan, dynamic_inputs
from edgespec.runtimes.openvino.runtime import import_ov

__all__ = ["StatefulKV", "register"]


class StatefulKV(KVHolder):
    """The cache in the compiled model's variables: one request, any width."""

    name = "state"
    new_rows = False  # the stateful IR returns no KV rows: the plugin keeps them

    def __init__(self, layout: KVLayout, plan: KVPlan, request) -> None:
        super().__init__(layout, plan, request)
        self._req = request

    @classmethod
    def prepare(cls, model, layout: KVLayout, plan: KVPlan) -> None:
        make_stateful(model)

    def feed(self, token_ids: Sequence[int], n_logits: int) -> dict[str, np.ndarray]:
        self.reserve(self._n + len(token_ids))
        return dynamic_inputs(token_ids, self._n, n_logits, rows=len(token_ids))

    def abort(self, n_past: int) -> None:
        self._cut(n_past)  # the variables must hold the sequence as before the call

    def trim(self, n_past: int) -> None:
        if n_past < self._n:
            self._cut(n_past)
        super().trim(n_past)

    def _cut(self, n: int) -> None:
        """Keep the first n positions in every variable (the plugin copies the prefix in)."""
        if n == 0:
            self._req.reset_state()
            return
        ov = import_ov()
        for st in self._req.query_state():
            shape = list(st.state.shape)
            if shape[2] > n:  # a view of the kept rows, not a copy of them
                st.state = ov.Tensor(st.state, [0] * len(shape), shape[:2] + [n] + shape[3:])

    def nbytes(self) -> int:
        return self.layout.bytes_per_token * self._n  # the variables hold exactly the sequence

    def close(self) -> None:
        self._req = None


def register(monkeypatch, holder: type[KVHolder] = StatefulKV) -> str:
    """Make `holder` a KV holder the OpenVINO runtime opens by its name, for this test only; the name."""
    monkeypatch.setitem(KV_KINDS, holder.name, holder)
    return holder.name
