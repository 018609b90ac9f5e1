"""Write only the default model's target graph, with or without window-only sliding layers, for a
before/after timing with cost_by_context.py (issue 38) without exporting a whole bundle.

    python dev/long_context/target_graph.py OUT_DIR [--whole-context]

OUT_DIR/target/model.onnx is what `edgespec export` writes for the default bundle's target
(the embedded Gemma 3 270M GGUF's own blocks); --whole-context writes it with
GraphOptions(window_keys=False), the graph of bundle revision 3 and before.
"""
from __future__ import annotations

import argparse
from pathlib import Path


class _Quiet:
    def set_postfix_str(self, _text: str) -> None:
        pass


def main() -> None:
    from edgespec.exporters.export import ModelJob, write_onnx
    from edgespec.exporters.onnx.graph import GraphOptions
    from edgespec.exporters.sources import load_source
    from edgespec.models.catalog import DEFAULT_PRESET, preset_source

    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--whole-context", action="store_true")
    a = ap.parse_args()
    source = load_source(preset_source(DEFAULT_PRESET))
    opts = GraphOptions(tie_head=True, window_keys=False if a.whole_context else None)
    (a.out / "target").mkdir(parents=True, exist_ok=True)
    art = write_onnx(ModelJob("target", source.model.spec, source.model.tensors, "source", opts, source, a.out),
                     _Quiet())
    print(a.out / art.file)


if __name__ == "__main__":
    main()
