"""Benchmarks: plain vs speculative decoding measured side by side (`edgespec bench`).

suites    built-in prompt suites (data/*.jsonl) and their encoding
measure   the interleaved measuring loop on an engine's runtimes
summary   medians, per-class figures, exactness check
schema    the versioned JSON result document; document builds it
live      the console table; report writes Markdown + PNG plots; compare merges runs
runner    one timed decode and the peak-RSS sampler (used by benchmarks/ too)
peer      llama-cpp-python's own plain decode of the GGUF: the `x llama.cpp` column
costs     c(B), a B-token forward's cost over a one-token forward
machine   CPU model, ISA features, cores, library versions
thermal   clocks and temperatures around each run, throttling verdicts; heat_report its report part

No torch or transformers on this path; matplotlib only when a report is written, llama_cpp only
when the peer runs.
"""
from .compare import merge_runs
from .document import build_document
from .measure import PEER, PLAIN, SPECULATIVE, BenchConfig, RunRecord, build_decoders, measure_run, run_bench
from .runner import PeakRSS, RunResult, timed_decode
from .schema import SCHEMA_VERSION, load_runs, save, validate
from .suites import SUITES, Prompt, encode_prompt, load_prompts
from .summary import summarise

__all__ = [
    "PEER", "PLAIN", "SPECULATIVE", "SCHEMA_VERSION", "SUITES", "BenchConfig", "PeakRSS", "Prompt", "RunRecord",
    "RunResult",
    "build_decoders", "build_document", "encode_prompt", "load_prompts", "load_runs", "measure_run", "merge_runs",
    "run_bench", "save", "summarise", "timed_decode", "validate",
]
