"""Does onnxruntime's KleidiAI path make the default model's verify round apart on aarch64?

The emulated Cortex-A76 (.ci/aarch64) found the default bundle's multi-token verify off its
one-token forwards by up to 9.3 logits (the padded-rows mode: 3.3), where x86-64 is bit-exact.
onnxruntime 1.32's aarch64 wheel routes 4-bit MatMulNBits through Arm's KleidiAI kernels, which
quantize activations their own way; session options `mlas.disable_kleidiai` and
`mlas.qnbit.force_fp32` (both in the 1.32 binary) turn that off. This probes widths 2-3 from a
few prefixes with each setting, and an 8-token forward's rows against one-token forwards, in one
process per setting (run it under qemu:
`~/.cache/edgespec-ci/aarch64/bin/python-cortex-a76 dev/aarch64/kleidiai.py BUNDLE`).

usage: python dev/aarch64/kleidiai.py BUNDLE [--option KEY=VALUE]...
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path


def eight_rows(rt) -> list[float]:
    """An 8-token forward's rows against the same tokens fed one at a time: the largest logit
    difference per row (0.0: bit-identical)."""
    import numpy as np

    ids = [int(t) for t in np.random.default_rng(20251124).integers(16, rt.vocab_size, 8)]
    rt.reset()
    wide = np.array(rt.forward(ids, 8))
    rt.reset()
    ones = [np.array(rt.forward([t], 1))[0] for t in ids]
    rt.reset()
    return [round(float(np.abs(wide[i] - ones[i]).max()), 3) for i in range(8)]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("bundle", type=Path)
    p.add_argument("--option", action="append", default=[], help="an onnxruntime session config entry")
    p.add_argument("--width", type=int, default=3)
    args = p.parse_args(argv)
    from edgespec.bundle import load_bundle
    from edgespec.runtimes.exactness import probe
    from edgespec.runtimes.onnxruntime import graphs, runtime
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    entries = dict(o.split("=", 1) for o in args.option)
    plain = graphs.session_options

    def with_entries(threads, spin):
        opts = plain(threads, spin)
        for k, v in entries.items():
            opts.add_session_config_entry(k, v)
        return opts

    # the experiment's switch, for every session this process opens (runtime.py imported the name)
    graphs.session_options = runtime.session_options = with_entries
    m = load_bundle(args.bundle).manifest
    t0 = time.process_time()
    rt = OnnxRuntime(args.bundle / m.target.formats["onnx"].file, kv_capacity=128)
    rows = eight_rows(rt)
    verdict = probe(rt, args.width, starts=(5, 14, 60), sampled=())
    print(json.dumps({"machine": platform.machine(), "options": entries, "exact": verdict.exact,
                      "worst_diff": verdict.worst_diff, "eight_token_prefill_row_diffs": rows,
                      "cpu_s": round(time.process_time() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
