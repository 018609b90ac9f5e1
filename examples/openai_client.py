"""Talk to `edgespec serve` with the official `openai` package, as any OpenAI client app would.

    edgespec serve [BUNDLE] --api-key secret            # in one terminal
    python examples/openai_client.py --api-key secret   # in another

or let the script start (and stop) the server itself:

    python examples/openai_client.py --serve [BUNDLE]

It lists the model, streams a chat reply, then asks for a plain completion and prints usage.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from openai import OpenAI

__all__ = ["main", "started_server"]


@contextmanager
def started_server(bundle: str | None, api_key: str | None) -> Iterator[str]:
    """Run `edgespec serve` on a free loopback port; yields its base URL."""
    cmd = [sys.executable, "-m", "edgespec", "serve", "--port", "0", *([bundle] if bundle else [])]
    env = dict(os.environ, **({"EDGESPEC_API_KEY": api_key} if api_key else {}))  # not on the command line
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # "edgespec serve: http://127.0.0.1:PORT/v1 (...)"
        if not line.startswith("edgespec serve: "):
            raise SystemExit(f"the server did not start (exit code {proc.wait()})")
        yield line.split()[2]
    finally:
        proc.terminate()
        proc.wait(30)


def run(client: OpenAI, prompt: str, max_tokens: int) -> None:
    model = client.models.list().data[0].id
    print(f"model: {model}")

    print(f"\n> {prompt}")
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0.7, top_p=0.95, seed=1, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]")

    text = "The capital of France is"
    out = client.completions.create(model=model, prompt=text, max_tokens=16, temperature=0, stop=["\n"])
    print(f"\n{text}{out.choices[0].text}  [finish: {out.choices[0].finish_reason}, "
          f"{out.usage.completion_tokens} tokens]")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Use edgespec serve through the openai package.")
    p.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    p.add_argument("--api-key", default=os.environ.get("EDGESPEC_API_KEY"))
    p.add_argument("--serve", nargs="?", const="", default=None, metavar="BUNDLE",
                   help="start `edgespec serve [BUNDLE]` for the run (default bundle if none is named)")
    p.add_argument("--prompt", default="Write a haiku about small computers.")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)

    def client(url: str) -> OpenAI:
        # the openai package insists on a key; the server ignores it unless started with --api-key
        return OpenAI(base_url=url, api_key=args.api_key or "none", max_retries=0)

    if args.serve is None:
        run(client(args.base_url), args.prompt, args.max_tokens)
    else:
        with started_server(args.serve or None, args.api_key) as url:
            run(client(url), args.prompt, args.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
