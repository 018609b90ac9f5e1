"""Do verifies on the real OpenVINO target round like one-token decodes across its window edge?

    nice -n 10 python dev/long_context/ov_window_exactness.py [MODEL.xml] [--threads 2] [--pad-rows]
        [--whole | --align N]

The default bundle's OpenVINO target (window 512, aligned start 256) as the engine opens it
(dynamic buffer, wide, dynamic int8 activations where the weights are compressed): the engine's own
exactness probe (edgespec.runtimes.exactness.probe: verifies of every width 2-9 against the same
positions decoded one at a time, and the decode after each verify) from prefixes where the window
first leaves position 0 and where a verify's rows start their windows in two aligned blocks.
Prints the verdict as JSON: exact widths 2-9 and a worst difference of 0 is bit for bit.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

MAX_WIDTH = 9


def main() -> None:
    from edgespec.runtimes.exactness import probe

    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pad-rows", action="store_true", help="the exact mode the probe picks where one-row "
                    "kernels round unlike taller ones (OpenVinoRuntime pad_rows)")
    ap.add_argument("--align", type=int, help="align the window's start to this instead of the IR's record")
    ap.add_argument("--whole", action="store_true", help="ignore the window record: every past whole (before)")
    a = ap.parse_args()
    if a.model:
        path = a.model
    else:
        from edgespec.engine.engine import default_bundle

        path = str(default_bundle("openvino") / "target" / "openvino" / "model.xml")
    import edgespec.runtimes.openvino.runtime as ov_runtime

    read = ov_runtime.window_of
    record = read(ov_runtime.read_ir(Path(path), None)[1])
    if record is None:
        raise SystemExit(f"{path} records no sliding window: export it again with this edgespec")
    if a.whole:
        ov_runtime.window_of = lambda model: None
    elif a.align:
        ov_runtime.window_of = lambda model: dataclasses.replace(read(model), align=a.align)
    with ov_runtime.OpenVinoRuntime(path, kv_capacity=1500, threads=a.threads, wide=True,
                                    pad_rows=a.pad_rows) as rt:
        win = rt.kv.plan.window or record
        edges = (record.size - 3, record.size + record.align - 3, record.size + record.align - 2,
                 record.size + 3 * record.align - 3)
        verdict = probe(rt, MAX_WIDTH, starts=edges, sampled=())
        print(json.dumps({"model": path, "threads": a.threads, "window": win.size,
                          "align": None if a.whole else win.align, "layers": len(win.layers), "prefixes": edges,
                          "quantize": rt.kv.plan.quantize, "pad_rows": a.pad_rows, "verdict": verdict.to_dict()}))


if __name__ == "__main__":
    main()
