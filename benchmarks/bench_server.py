"""The servers end to end: the same completion through the engine in-process, through `edgespec
serve` (uvicorn on loopback, SSE), and through llama.cpp's own `llama-server` on the same GGUF,
plain and with its speculative types, interleaved.

    python benchmarks/bench_server.py [BUNDLE] [--tokens 64] [--repeats 5] [--concurrent 4]
                                      [--prompts FILE.jsonl] [--temperature T --top-p P --top-k K --seed S]
                                      [--llama-server [PATH]] [--server-spec ngram-simple,ngram-mod]
                                      [--peer-gguf FILE] [--threads N] [--json FILE]

Every request is streamed (`/v1/completions`, SSE, usage in the last chunk) with the same prompt
token ids (a chat prompt through the bundle's template, then encoded once) and the same sampling:
greedy by default; min-p 0 and no repetition penalty on llama-server (whose own defaults differ).
Per path: median wall time, end-to-end tokens/s (completion tokens over the whole request), decode
tokens/s after the first streamed text, and time to first text; then each server's ratio of
totals against each llama-server configuration with its spread over the repeats, and whether the
greedy texts agree. The run ends timing N concurrent requests against N sequential ones on
`edgespec serve`.

llama-server is llama.cpp's own, from the project's build of the pinned llama-cpp-python's sources
(edgespec/deploy/build.py: `python -m edgespec.deploy`), or PATH; its flags are spelled out for that
build (edgespec/deploy/command.py) and printed with its build's CMake flags.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
from contextlib import ExitStack

import httpx
import uvicorn

import edgespec
from edgespec.server import ServerConfig, create_app

__all__ = ["main"]

PROMPT = "The history of the printing press begins"


def serve_in_thread(app) -> tuple[str, uvicorn.Server, threading.Thread]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


def direct(engine, ids: list[int], n: int, sampling: dict, stop: list[str] = ()) -> dict:
    """The engine in-process: one run, timed as the HTTP paths are."""
    t0 = time.perf_counter()
    first, parts, tokens = None, [], 0
    for r in engine.stream(list(ids), max_tokens=n, wait=True, stop=list(stop), **sampling):
        if r.text and first is None:
            first = time.perf_counter() - t0
        parts.append(r.text)
        tokens += len(r.token_ids)
    return _result("".join(parts), time.perf_counter() - t0, first, tokens)


def _result(text: str, wall: float, first: float | None, tokens: int) -> dict:
    first = first or wall
    decode = wall - first
    return {"text": text, "wall_s": wall, "first_s": first, "tokens": tokens,
            "e2e_tok_s": tokens / wall if wall > 0 else 0.0,
            "decode_tok_s": (tokens - 1) / decode if tokens > 1 and decode > 0 else 0.0}


def over_http(url: str, ids: list[int], n: int, sampling: dict, stop: list[str] = ()) -> dict:
    """One streamed /v1/completions request: text, wall time, time to first text, completion tokens."""
    body = {"prompt": ids, "max_tokens": n, "stream": True, "stream_options": {"include_usage": True}, **sampling}
    if stop:
        body["stop"] = list(stop)
    t0 = time.perf_counter()
    first, parts, tokens = None, [], 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            doc = json.loads(line[6:])
            if doc.get("usage"):
                tokens = doc["usage"]["completion_tokens"]
            for choice in doc.get("choices") or []:
                if choice.get("text") and first is None:
                    first = time.perf_counter() - t0
                parts.append(choice.get("text") or "")
    return _result("".join(parts), time.perf_counter() - t0, first, tokens)


async def burst(url: str, ids: list[int], n: int, count: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(http.post("/v1/completions", json={"prompt": ids, "max_tokens": n,
                                                                       "temperature": 0}) for _ in range(count)))
        assert all(r.status_code == 200 for r in rs)
        return time.perf_counter() - t0


def start_llama_servers(engine, args, stack: ExitStack) -> dict[str, str]:
    """llama-server on the bundle's GGUF, plain and per --server-spec type: name -> URL."""
    from edgespec.bench.peer import find_peer_gguf
    from edgespec.deploy import ServerOptions, SpecSettings, locate, read_help, server_argv
    from edgespec.deploy.process import ServerProcess, free_port

    source = find_peer_gguf(engine.bundle, args.peer_gguf)
    if source is None:
        raise SystemExit("bench_server: no GGUF for llama-server: pass --peer-gguf FILE")
    build = locate(None if args.llama_server == "auto" else args.llama_server)
    cmake = " ".join(f"-D{k}={v}" for k, v in build.cmake.items())
    print(f"llama-server: {build.source}; {cmake or 'flags unknown'}; {build.compiler}", file=sys.stderr)
    help_ = read_help(build.server)
    urls = {}
    for kind in ["none", *args.server_spec]:
        port = free_port()
        opts = ServerOptions(model=source.path, spec=SpecSettings(type=kind), context=engine.context_limit or 4096,
                             threads=args.threads, port=port, parallel=1, metrics=False)
        argv = server_argv(help_, opts)
        name = "llama-server" if kind == "none" else f"llama-server+{kind}"
        print(f"{name}: {' '.join(a if a != str(source.path) else source.path.name for a in argv[1:])}",
              file=sys.stderr)
        urls[name] = stack.enter_context(ServerProcess(argv, host=opts.host, port=port)).url
    return urls


def _prompts(engine, spec: str | None) -> list[tuple[list[int], list[str]]]:
    """(prompt ids, stop strings) of each prompt: a suite's as `edgespec bench` renders and ends them
    (bench/endings.py: chat prompts in chat's own format, ended where chat ends a reply)."""
    if spec is None:
        return [(engine.tokenizer.encode(PROMPT), [])]
    from edgespec.bench.endings import render
    from edgespec.bench.suites import load_prompts
    from edgespec.engine.session import chat_format_for

    fmt = chat_format_for(engine.bundle.manifest, engine.tokenizer)
    rendered = [render(p, engine.tokenizer, fmt, stop_at_eos=True) for p in load_prompts(spec)]
    return [(r.ids, r.ending.server_stop()) for r in rendered]


def _totals(rs: list[dict]) -> tuple[float, float]:
    """Ratio-of-totals speeds: end to end, and decode after the first text."""
    toks, wall = sum(r["tokens"] for r in rs), sum(r["wall_s"] for r in rs)
    dec_t, dec_s = sum(r["tokens"] - 1 for r in rs), sum(r["wall_s"] - r["first_s"] for r in rs)
    return (toks / wall if wall else 0.0), (dec_t / dec_s if dec_s else 0.0)


def report(runs: dict[str, list[dict]], tokens: int, repeats: int, greedy: bool) -> dict:
    print(f"{platform.machine()}, {platform.processor() or ''} {os.cpu_count()} cpus, {platform.python_version()}; "
          f"{tokens} tokens, {repeats} repeats, {'greedy' if greedy else 'sampled'}")
    out = {}
    for name, rs in runs.items():
        e2e, dec = _totals(rs)
        out[name] = {"e2e_tok_s": e2e, "decode_tok_s": dec, "wall_ms": 1e3 * statistics.median(r["wall_s"] for r in rs),
                     "first_ms": 1e3 * statistics.median(r["first_s"] for r in rs)}
        print(f"  {name:<26} {out[name]['wall_ms']:7.0f} ms  e2e {e2e:6.1f} tok/s  decode {dec:6.1f} tok/s  "
              f"first text {out[name]['first_ms']:5.0f} ms")
    for peer in [n for n in runs if n.startswith("llama-server")]:
        for mine in ("server", "engine"):
            ratios = [a["e2e_tok_s"] / b["e2e_tok_s"] for a, b in zip(runs[mine], runs[peer]) if b["e2e_tok_s"]]
            x = out[mine]["e2e_tok_s"] / out[peer]["e2e_tok_s"] if out[peer]["e2e_tok_s"] else 0.0
            out[mine][f"x_{peer}"] = x
            print(f"  {mine} x {peer}: {x:.2f}x end to end (paired per run: {min(ratios):.2f}-{max(ratios):.2f})")
        if greedy:
            same = all(a["text"] == b["text"] for a, b in zip(runs["server"], runs[peer]))
            print(f"  greedy text of edgespec serve == {peer}: {same}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", nargs="?", default=None)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--concurrent", type=int, default=4)
    p.add_argument("--prompts", default=None, help="a suite name or .jsonl file (default: one fixed prompt)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--llama-server", nargs="?", const="auto", default=None, metavar="PATH",
                   help="also measure llama.cpp's own server (default build: the project's, see above)")
    p.add_argument("--server-spec", type=lambda t: [x for x in t.split(",") if x], default=["ngram-simple"],
                   help="llama-server's speculative types measured beside its plain decode (default: ngram-simple)")
    p.add_argument("--peer-gguf", default=None, help="the GGUF llama-server runs (default: the bundle's)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": 0.0}
    if args.seed is not None:
        sampling["seed"] = args.seed
    with edgespec.load(args.bundle, threads=args.threads) as engine, ExitStack() as stack:
        url, server, thread = serve_in_thread(create_app(engine, ServerConfig()))
        urls = {"server": url, **(start_llama_servers(engine, args, stack) if args.llama_server else {})}
        prompts = _prompts(engine, args.prompts)
        runs: dict[str, list] = {"engine": [], **{name: [] for name in urls}}
        direct(engine, prompts[0][0], 8, sampling)  # warm up every path
        for u in urls.values():
            over_http(u, prompts[0][0], 8, sampling)
        for rep in range(args.repeats):  # interleaved, the order rotated: every path sees the same machine load
            for ids, stop in prompts:
                order = list(runs)[rep % len(runs):] + list(runs)[:rep % len(runs)]
                for name in order:
                    runs[name].append(direct(engine, ids, args.tokens, sampling, stop) if name == "engine"
                                      else over_http(urls[name], ids, args.tokens, sampling, stop))
        figures = report(runs, args.tokens, args.repeats, args.temperature == 0)
        seq = sum(over_http(url, prompts[0][0], args.tokens, sampling)["wall_s"] for _ in range(args.concurrent))
        par = asyncio.run(burst(url, prompts[0][0], args.tokens, args.concurrent))
        print(f"{args.concurrent} requests to edgespec serve: sequential {seq:.2f} s, concurrent (queued) {par:.2f} s")
        server.should_exit = True
        thread.join(30)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"figures": figures, "tokens": args.tokens, "repeats": args.repeats, "sampling": sampling}, f,
                      indent=2)


if __name__ == "__main__":
    main()
