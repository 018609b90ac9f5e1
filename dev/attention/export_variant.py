"""Export the default model with an attention-score variant of exporters/onnx/graph._scores, for
timing (dev/attention) and the exactness probe. Not a product path.

    python dev/attention/export_variant.py keys-first OUT_BUNDLE

keys-first: scores as K @ rows^T (key rows on the left, one pass over the head's depth whatever
the key count) and one small transpose, instead of 128-deep slices of K and the rows added up.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from edgespec.exporters.export import ExportConfig, export_bundle
from edgespec.exporters.onnx import graph


def keys_first(g, rows: str, k: str, hd: int) -> str:
    st = g.op("MatMul", [k, g.op("Transpose", [rows], perm=[0, 1, 3, 2])])  # (1, KVH, T, R)
    return g.op("Transpose", [st], perm=[0, 1, 3, 2])


VARIANTS = {"keys-first": keys_first}

if __name__ == "__main__":
    graph._scores = VARIANTS[sys.argv[1]]
    out = Path(sys.argv[2])
    export_bundle(ExportConfig(output=out, force=True))
    print("written", out, np.__version__)
