"""Does speculative greedy equal plain greedy on OpenVINO at long contexts, windowed?

    nice -n 10 python dev/long_context/ov_spec_equals_plain.py BUNDLE [--tokens 2000] [--questions 5]

The slow tier's question (tests/test_slow_contexts.py: questions after a ~`--tokens` document, each
reply of the speculative engine against the plain one's) on the OpenVINO backend, for a bundle with
an OpenVINO target (the default bundle's, `edgespec export --format openvino`, records the sliding
window). The document is `edgespec bench`'s long-prompt text (the installed packages' licences, cut
to `--tokens`). Raises on the first differing reply; prints the drafter and the time.
"""
from __future__ import annotations

import argparse
import time

QUESTIONS = ["What is the main topic?", "Summarize it in one line.", "Who is mentioned first?",
             "What happens next?", "List three key words.", "What is the tone?", "Give it a title.",
             "What question does it raise?"]
N_TOKENS = 24


def _greedy(engine, ids: list[int]) -> list[int]:
    from edgespec.decoding import SamplingParams

    tokens = list(ids)
    for _ in engine.stream_ids(tokens, SamplingParams(), N_TOKENS, stop=()):
        pass
    return tokens[len(ids):]


def main() -> None:
    import edgespec
    from edgespec.bench.long_prompts import cut_to_tokens, licence_text

    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--questions", type=int, default=5)
    a = ap.parse_args()
    questions = QUESTIONS[:a.questions]
    kw = {"backend": "openvino", "max_context": a.tokens + 512}
    t0 = time.perf_counter()
    with edgespec.load(a.bundle, **kw) as spec, edgespec.load(a.bundle, use_draft=False, **kw) as plain:
        doc = cut_to_tokens(licence_text(), a.tokens, lambda text: len(spec.tokenizer.encode(text)))
        drafted = 0
        for q in questions:
            ids = spec.tokenizer.encode(f"{doc}\n\nQuestion: {q}\nAnswer:")
            got, want = _greedy(spec, ids), _greedy(plain, ids)
            if got != want:
                raise SystemExit(f"speculative output left plain's after ~{a.tokens} tokens on {q!r}")
            drafted += spec.last_stats.drafted
        print(f"speculative == plain on {len(questions)} questions after ~{a.tokens} tokens "
              f"(drafter {spec.drafter_name}, {drafted} tokens drafted, {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
