"""The Python API in a few lines: a completion, a streamed completion with its metrics, a chat turn.

    python examples/python_api.py [BUNDLE]       # default: the embedded Gemma 3 270M bundle
"""
from __future__ import annotations

import sys

import edgespec


def main(bundle: str | None = None) -> None:
    with edgespec.load(bundle) as engine:
        print(engine.generate("The capital of France is", max_tokens=16))
        for r in engine.stream("def fibonacci(n):", max_tokens=48):
            print(r.text, end="", flush=True)
        print(f"\n[{r.tokens_per_s:.1f} tok/s, {r.stats.acceptance:.0%} of drafts accepted]")
        chat = engine.chat(system="You are terse.")
        for r in chat.send("Name three primary colours.", max_tokens=48):
            print(r.text, end="", flush=True)
        print()


if __name__ == "__main__":
    # this script owns its process and builds no onnxruntime sessions of its own: one thread pool
    # for all of edgespec's (docs/api.md)
    edgespec.share_threads()
    main(sys.argv[1] if len(sys.argv) > 1 else None)
