"""Structured output against llama.cpp's own server: the suite of benchmarks/data/structured.jsonl
(extraction, classification and tool-call prompts with their JSON schemas), the same json_schema,
prompt tokens and sampling settings sent to `edgespec serve` and to `llama-server`.

    python benchmarks/bench_structured.py --llama-server PATH [--bundle BUNDLE] [--gguf FILE]
                                          [--modes greedy,sampled] [--rounds 2] [--max-tokens 256]
                                          [--limit N] [--out DIR] [--threads 2]
    python benchmarks/bench_structured.py --no-peer ...     # edgespec alone

Both servers run at once on a loopback port each; requests go one at a time, per prompt and round
alternating which server goes first, so a busy neighbour slows both alike. Each request is a
/v1/completions call with the prompt as token ids (the plain-text transcript edgespec's chat
endpoint renders for the default base model, tools described in it) and llama.cpp's `json_schema`
field: for a tool-call prompt, the schema of the call ({"name": ..., "arguments": ...}) of its
required or named function. Sampling: `greedy` (temperature 0) and `sampled` (temperature 0.7,
top-p 0.95, top-k 40); min-p 0 and no repetition penalty on both.

Decode speed comes from each server's own `timings` (llama.cpp's names, which edgespec's server
also reports): tokens after the first over the time after it (llama.cpp counts its first sampled
token in predicted_n but not its time, a small advantage to the peer). `x llama.cpp` is the ratio of
totals: all decode tokens over all decode time, edgespec's over llama-server's. Every reply is
validated against its schema (jsonschema), the peer's too; edgespec's forced tokens (committed
without a forward because the grammar allows nothing else) are counted.

Writes DIR (default benchmarks/results/bench_structured/): results.json (per request), summary.md
(the table) and run.log (the console, with the machine line).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUITE = HERE / "data" / "structured.jsonl"
MODES = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.7, "top_p": 0.95, "top_k": 40}}
# llama-server's own fields: its defaults would otherwise differ (a repetition penalty on some
# builds) or reuse the previous request's prompt; edgespec has neither
PEER_FIELDS = {"llama.cpp": {"repeat_penalty": 1.0, "cache_prompt": False}}
STARTUP_S = 600  # edgespec's first start may build the default bundle


def suite(limit: int | None) -> list[dict]:
    rows = [json.loads(line) for line in SUITE.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def call_schema(row: dict) -> dict:
    """A tool row's reply as one JSON schema: a call of its named function, or of any of its tools."""
    named = row["tool_choice"]["function"]["name"] if isinstance(row["tool_choice"], dict) else None
    options = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": t["function"]["name"]}, "arguments": t["function"]["parameters"]}}
               for t in row["tools"] if named in (None, t["function"]["name"])]
    return options[0] if len(options) == 1 else {"anyOf": options}


def prompt_tokens(rows: list[dict], bundle: str | None) -> list[list[int]]:
    """Each row's prompt as edgespec's chat endpoint renders it for the bundle (tools included)."""
    from edgespec.bundle import load_bundle
    from edgespec.engine.engine import default_bundle
    from edgespec.engine.session import chat_format_for
    from edgespec.models.tool_calls import Function
    from edgespec.tokenizer import Tokenizer

    b = load_bundle(Path(bundle) if bundle else default_bundle())
    tok = Tokenizer(b.file(b.manifest.tokenizer.file), b.manifest.tokenizer, template_timeout_s=None)
    fmt = chat_format_for(b.manifest, tok)
    out = []
    for row in rows:
        functions = [Function(t["function"]["name"], t["function"].get("description", ""),
                              t["function"]["parameters"]) for t in row.get("tools", [])]
        out.append(fmt.tool_prompt(tok, [{"role": "user", "content": row["prompt"]}], functions).tokens)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, name: str) -> None:
    import httpx

    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with status {proc.returncode} before it served")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{name} did not answer /health within {STARTUP_S} s")


@contextmanager
def server(cmd: list[str], port: int, name: str):
    """A server process on a loopback port, stopped (SIGINT, then killed) on the way out."""
    # its log goes to a file: a pipe nobody reads fills, and the server then blocks on its next log line
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, proc, name)
        except SystemExit as e:
            log.seek(0)
            raise SystemExit(f"{e}: {log.read()[-2000:]}") from None
        yield url
    finally:
        log.close()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ask(url: str, tokens: list[int], schema: dict, mode: str, seed: int, max_tokens: int, extra: dict) -> dict:
    """One /v1/completions request; its reply text, timings and whether the text validates."""
    import httpx
    import jsonschema

    body = {"prompt": tokens, "json_schema": schema, "max_tokens": max_tokens, "seed": seed, "min_p": 0.0,
            "stream": False, **MODES[mode], **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    out = r.json()
    if r.status_code != 200:
        return {"error": out.get("error", {}).get("message", r.text)[:300], "valid": False}
    text = out["choices"][0]["text"]
    try:
        jsonschema.validate(json.loads(text), schema)
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    return {"text": text, "valid": valid, "timings": out.get("timings", {}),
            "completion_tokens": out.get("usage", {}).get("completion_tokens")}


def totals(results: list[dict], server_name: str, mode: str, kind: str | None = None) -> dict:
    picked = [r[server_name] for r in results if r["mode"] == mode and (kind is None or r["kind"] == kind)
              and server_name in r]
    timed = [p["timings"] for p in picked if "timings" in p]
    n = sum(t.get("predicted_n", 0) for t in timed)
    ms = sum(t.get("predicted_ms", 0.0) for t in timed)
    return {"requests": len(picked), "valid": sum(p["valid"] for p in picked), "decode_tokens": n,
            "decode_ms": ms, "tok_s": 1e3 * n / ms if ms else 0.0,
            "forced": sum(t.get("forced", 0) for t in timed),
            "tokens": sum(p.get("completion_tokens") or 0 for p in picked)}


def run(args, rows: list[dict], urls: dict[str, str]) -> list[dict]:
    tokens = prompt_tokens(rows, args.bundle)
    schemas = [call_schema(r) if r["kind"] == "tool" else r["schema"] for r in rows]
    for name, url in urls.items():  # warm-up: edgespec's first grammar builds its tokenizer view
        ask(url, tokens[0], schemas[0], "greedy", 0, args.max_tokens, PEER_FIELDS.get(name, {}))
    results = []
    for rnd in range(args.rounds):
        for mode in args.modes:
            for i, row in enumerate(rows):
                order = list(urls) if (i + rnd) % 2 == 0 else list(urls)[::-1]
                entry = {"round": rnd, "mode": mode, "id": row["id"], "kind": row["kind"]}
                for name in order:
                    entry[name] = ask(urls[name], tokens[i], schemas[i], mode, 1000 * rnd + i, args.max_tokens,
                                      PEER_FIELDS.get(name, {}))
                results.append(entry)
                print(json.dumps({k: v for k, v in entry.items() if k not in urls}),
                      *(f"{n}: {entry[n].get('timings', {}).get('predicted_per_second', 0):.1f} tok/s"
                        f"{'' if entry[n]['valid'] else ' INVALID'}" for n in urls), file=sys.stderr, flush=True)
    return results


def summary(results: list[dict], names: list[str], machine: dict, args) -> str:
    peer = "llama.cpp" in names
    lines = ["# Structured output: edgespec serve against llama-server", "",
             f"Machine: {machine['cpu']} ({machine['arch']}), {machine['cores_usable']} usable cores, load "
             f"{machine['load_avg_1min']} at the start. {len(results) // max(len(args.modes), 1)} requests per mode "
             f"({args.rounds} round(s) of the suite), up to {args.max_tokens} tokens.", "",
             "| mode | kind | " + " | ".join(f"{n} tok/s (valid)" for n in names) + " | edgespec forced / tokens |"
             + (" x llama.cpp |" if peer else ""),
             "| --- | --- | " + " | ".join("---" for _ in names) + " | --- |" + (" --- |" if peer else "")]
    for mode in args.modes:
        for kind in ("extract", "classify", "tool", None):
            t = {n: totals(results, n, mode, kind) for n in names}
            e = t["edgespec"]
            if not e["requests"]:
                continue
            row = (f"| {mode} | {kind or 'all'} | "
                   + " | ".join(f"{t[n]['tok_s']:.1f} ({t[n]['valid']}/{t[n]['requests']})" for n in names)
                   + f" | {e['forced']} / {e['tokens']} |")
            if "llama.cpp" in names:
                peer = t["llama.cpp"]["tok_s"]
                row += f" {e['tok_s'] / peer:.2f}x |" if peer else " – |"
            lines.append(row)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--llama-server", help="the llama-server binary (llama.cpp's own server)")
    p.add_argument("--no-peer", action="store_true", help="measure edgespec alone")
    p.add_argument("--bundle", help="the edgespec bundle (default: the embedded model's)")
    p.add_argument("--gguf", help="the GGUF llama-server runs (default: the embedded model's, the bundle's source)")
    p.add_argument("--modes", default="greedy,sampled", type=lambda s: [m for m in s.split(",") if m])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--limit", type=int, help="the suite's first N prompts only (a smoke run)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=HERE / "results" / "bench_structured")
    args = p.parse_args(argv)
    if not args.no_peer and not (args.llama_server and Path(args.llama_server).is_file()):
        p.error("give --llama-server PATH (llama.cpp's llama-server binary), or --no-peer")
    from edgespec.bench.machine import machine_info

    rows, machine = suite(args.limit), machine_info()
    print(f"machine: {json.dumps(machine)}", file=sys.stderr)
    ports = {"edgespec": free_port(), "llama.cpp": free_port()}
    edgespec_cmd = [sys.executable, "-m", "edgespec", "serve", *([args.bundle] if args.bundle else []),
                    "--port", str(ports["edgespec"]), "--threads", str(args.threads)]
    with server(edgespec_cmd, ports["edgespec"], "edgespec serve") as es:
        urls = {"edgespec": es}
        if args.no_peer:
            results = run(args, rows, urls)
        else:
            from edgespec.models.catalog import preset_source

            gguf = args.gguf or str(preset_source())
            llama_cmd = [args.llama_server, "-m", gguf, "--port", str(ports["llama.cpp"]), "-t", str(args.threads),
                         "-tb", str(args.threads), "-c", "4096", "-np", "1"]
            with server(llama_cmd, ports["llama.cpp"], "llama-server") as ls:
                urls["llama.cpp"] = ls
                results = run(args, rows, urls)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"machine": machine, "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
        if k not in ("llama_server", "gguf", "bundle", "out")}, "results": results}, indent=1), encoding="utf-8")
    text = summary(results, list(urls), machine, args)
    (args.out / "summary.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
