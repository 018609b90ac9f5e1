"""Hand-run micro-benchmark (not a maintained benchmark): the cost of streaming text one token at a
time, tokenizers' DecodeStream (tokenizer.IncrementalDecoder now) against the hand-written window
decoder it replaced (kept here as it was), on the default model's tokenizer (Gemma 3, from its
GGUF package) and on a tiny byte-level BPE. Both must stream exactly the full decode of each text.

    python dev/bench_stream_decode.py            # writes dev/results/stream_decode.json

The two decoders run interleaved in each round (the machine is shared), 21 rounds; the figures are
the median of the per-token times over rounds with the min and max (the min is the least disturbed),
and the median of the paired per-round ratio window / DecodeStream.
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from edgespec.bundle import TokenizerInfo
from edgespec.tokenizer import IncrementalDecoder, Tokenizer

ROUNDS = 21
TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 20,
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 8,
    "Grüße aus München! Ça va? 日本語のテキストと中文文本, 한국어 텍스트, العربية 🎉👩‍👩‍👧 naïve café. " * 10,
]


class WindowDecoder:
    """The hand-written decoder IncrementalDecoder was: decode a window before the new ids twice
    per push and emit the difference."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.ids, self._prefix, self._read = tokenizer, [], 0, 0

    def push(self, new_ids) -> str:
        self.ids.extend(new_ids)
        prefix_text = self.tokenizer.decode(self.ids[self._prefix:self._read])
        text = self.tokenizer.decode(self.ids[self._prefix:])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        prefix_text = self.tokenizer.decode(self.ids[self._prefix:self._read])
        text = self.tokenizer.decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return text[len(prefix_text):]


def _default_tokenizer(folder: Path) -> Path:
    from edgespec.exporters.gguf.source import open_gguf
    from edgespec.exporters.gguf.tokenizer import GGUFTokenizer
    from edgespec.models.catalog import preset_source

    path = folder / "gemma3.json"
    path.write_text(GGUFTokenizer(open_gguf(preset_source())).backend_tokenizer.to_str())
    return path


def _tiny_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = folder / "tiny.json"
    tok.save(str(path))
    return path


def _stream(make, tok: Tokenizer, ids: list[int]) -> tuple[str, float]:
    dec = make(tok)
    t0 = time.perf_counter()
    text = "".join(dec.push([i]) for i in ids) + dec.flush()
    return text, time.perf_counter() - t0


def measure(path: Path) -> dict:
    tok = Tokenizer(path, TokenizerInfo(path.name, None, False, [], None, "none"))
    streams = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    n = sum(map(len, streams))
    times: dict[str, list[float]] = {"DecodeStream": [], "window": []}
    for _ in range(ROUNDS):
        for name, make in (("DecodeStream", IncrementalDecoder), ("window", WindowDecoder)):
            spent = 0.0
            for ids in streams:
                text, dt = _stream(make, tok, ids)
                assert text == tok.decode(ids), (name, path.name)  # the contract, checked every round
                spent += dt
            times[name].append(1e6 * spent / n)
    ratios = [w / d for w, d in zip(times["window"], times["DecodeStream"])]
    paired = {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3), "max": round(max(ratios), 3)}
    return {"tokens": n, "paired_ratio_window_over_stream": paired,
            **{name: {"median_us_per_token": round(statistics.median(t), 2),
                                   "min": round(min(t), 2), "max": round(max(t), 2)} for name, t in times.items()}}


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        results = {"gemma3-270m": measure(_default_tokenizer(folder)),
                   "tiny-byte-level": measure(_tiny_tokenizer(folder))}
    import tokenizers

    out = {"cpu": _cpu(), "python": sys.version.split()[0],
           "tokenizers": tokenizers.__version__, "rounds": ROUNDS, "results": results}
    target = Path(__file__).parent / "results" / "stream_decode.json"
    target.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
