"""edgespec against llama.cpp, side by side: `edgespec bench` with its llama.cpp peer column.

    python benchmarks/bench_peer.py [--bundle BUNDLE] [--per-class 2] [--repeat 1] [--max-tokens 48]
                                    [--out DIR] [-- extra edgespec bench flags, e.g. --backend openvino]

Runs the `edgespec bench` command as a user runs it, on the default bundle (the embedded Gemma 3
270M, exported on first use; its target came from the Q4_K_M GGUF, which is what llama.cpp
decodes) or on BUNDLE, with the first --per-class prompts of the chat, code and grounded suites.
In one process, per prompt and repeat, interleaved: edgespec plain, edgespec speculative, and
llama-cpp-python's own plain greedy decode of the GGUF, all from the same prompt token ids. Decode
tokens/s after the first token; `x llama.cpp` is the median of paired per-prompt ratios.

Writes into DIR (default: benchmarks/results/bench_peer/): prompts.jsonl (the prompts used),
results.json (the bench's versioned JSON), report.md with its plots (llamacpp.png: the ratios per
class), and run.log (the console output, with the machine line).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CLASSES = ("chat", "code", "grounded")


def write_prompts(path: Path, per_class: int) -> int:
    """The first `per_class` prompts of each suite, as a JSONL file `edgespec bench --prompts` reads."""
    from edgespec.bench.suites import load_prompts

    lines = []
    for cls in CLASSES:
        for p in load_prompts(cls)[:per_class]:
            obj = {"id": p.id, "class": p.cls}
            if p.is_chat:
                obj["messages"] = [{"role": r, "content": c} for r, c in p.messages]
            else:
                obj["text"] = p.text
            lines.append(json.dumps(obj, ensure_ascii=False))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default=None, help="bundle folder (default: the embedded Gemma 3 270M)")
    ap.add_argument("--per-class", type=int, default=2, help="prompts per class (default: 2; the suites hold 8)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "bench_peer")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more `edgespec bench` flags")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = args.out / "prompts.jsonl"
    n = write_prompts(prompts, args.per_class)
    extra = [a for a in args.extra if a != "--"]
    cmd = [sys.executable, "-m", "edgespec", "bench", *([args.bundle] if args.bundle else []),
           "--prompts", str(prompts), "--repeat", str(args.repeat), "--max-tokens", str(args.max_tokens),
           "--json", str(args.out / "results.json"), "--report", str(args.out), *extra]
    print(f"{n} prompts: {' '.join(cmd[1:])}", file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = f"$ edgespec {' '.join(cmd[3:])}\n\n{proc.stderr}\n{proc.stdout}"
    local_paths = [(str(HERE.parent) + "/", ""), (str(Path.home()), "~")]
    if args.bundle:
        local_paths.insert(0, (str(args.bundle), Path(args.bundle).name))
    for local, shown in local_paths:  # no machine paths in results
        log = log.replace(local, shown)
    (args.out / "run.log").write_text(log, encoding="utf-8")
    sys.stderr.write(proc.stderr)
    sys.stdout.write(proc.stdout)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
