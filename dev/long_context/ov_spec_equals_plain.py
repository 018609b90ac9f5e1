"""Does speculative greedy equal plain greedy on OpenVINO at long contexts, windowed?

    nice -n 10 python dev/long_context/ov_spec_equals_plain.py BUNDLE [--tokens 2000] [--questions 5]

The slow tier's check (tests/test_slow_contexts.speculative_equals_plain: questions after a
~`--tokens` document, each reply of the speculative engine against the plain one's) on the OpenVINO
backend, which the slow tier does not run, for a bundle with an OpenVINO target (the default
bundle's, `edgespec export --format openvino`, records the sliding window). Raises on the first
differing reply; prints the drafter and the time.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tests package, for its check


def main() -> None:
    import edgespec
    import tests.test_slow_contexts as slow

    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--questions", type=int, default=5)
    a = ap.parse_args()
    slow.QUESTIONS = slow.QUESTIONS[:a.questions]
    kw = {"backend": "openvino", "max_context": a.tokens + 512}
    t0 = time.perf_counter()
    with edgespec.load(a.bundle, **kw) as spec, edgespec.load(a.bundle, use_draft=False, **kw) as plain:
        slow.speculative_equals_plain(spec, plain, a.tokens)
        print(f"speculative == plain on {len(slow.QUESTIONS)} questions after ~{a.tokens} tokens "
              f"(drafter {spec.drafter_name}, {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
