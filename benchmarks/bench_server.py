"""What the HTTP server costs on top of the engine: the same greedy completion run in-process
and through `edgespec serve`'s code (uvicorn on loopback, httpx client, SSE), interleaved.

    python benchmarks/bench_server.py [BUNDLE] [--tokens 64] [--repeats 5] [--concurrent 4]

Reports median wall time, tokens/s and time to first text per path, checks that the server's
greedy text equals the engine's, then times N concurrent requests against N sequential ones.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import socket
import statistics
import threading
import time

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


def direct(engine, n: int) -> tuple[str, float, float]:
    t0 = time.perf_counter()
    first, parts = None, []
    for r in engine.stream(PROMPT, max_tokens=n, wait=True):
        if r.text and first is None:
            first = time.perf_counter() - t0
        parts.append(r.text)
    return "".join(parts), time.perf_counter() - t0, first or 0.0


def over_http(url: str, n: int) -> tuple[str, float, float]:
    body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first, parts = None, []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text = json.loads(line[6:])["choices"][0]["text"]
                if text and first is None:
                    first = time.perf_counter() - t0
                parts.append(text)
    return "".join(parts), time.perf_counter() - t0, first or 0.0


async def burst(url: str, n: int, count: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": n,
                                                                       "temperature": 0}) for _ in range(count)))
        assert all(r.status_code == 200 for r in rs)
        return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("bundle", nargs="?", default=None)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--concurrent", type=int, default=4)
    args = p.parse_args()
    with edgespec.load(args.bundle) as engine:
        url, server, thread = serve_in_thread(create_app(engine, ServerConfig()))
        direct(engine, 8), over_http(url, 8)  # warm up both paths
        runs: dict[str, list] = {"engine": [], "server": []}
        for _ in range(args.repeats):  # interleaved: the two paths see the same machine load
            runs["engine"].append(direct(engine, args.tokens))
            runs["server"].append(over_http(url, args.tokens))
        print(f"{platform.machine()}, {platform.python_version()}; {args.tokens} tokens, median of {args.repeats}")
        texts = {name: {t for t, _, _ in rs} for name, rs in runs.items()}
        print(f"greedy text identical: {texts['engine'] == texts['server'] and len(texts['engine']) == 1}")
        for name, rs in runs.items():
            wall = statistics.median(w for _, w, _ in rs)
            ttft = statistics.median(f for _, _, f in rs)
            print(f"  {name:<7} {wall * 1e3:7.0f} ms  {args.tokens / wall:6.1f} tok/s  first text {ttft * 1e3:5.0f} ms")
        ratio = statistics.median(w for _, w, _ in runs["server"]) / statistics.median(w for _, w, _ in runs["engine"])
        print(f"  server / engine wall time: {ratio:.3f}")
        seq = sum(over_http(url, args.tokens)[1] for _ in range(args.concurrent))
        par = asyncio.run(burst(url, args.tokens, args.concurrent))
        print(f"{args.concurrent} requests: sequential {seq:.2f} s, concurrent (queued) {par:.2f} s")
        server.should_exit = True
        thread.join(30)


if __name__ == "__main__":
    main()
