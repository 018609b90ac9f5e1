"""llama.cpp's own server as the bench's peer: `llama-server` (the project's build of the llama.cpp
the pinned llama-cpp-python carries, edgespec/deploy/build.py) decoding the same GGUF over HTTP,
plainly or with one of its speculative modes, every flag spelled out (deploy/command.py).

Each run posts the prompt's token ids to `/completion` (the same ids edgespec decodes: no
tokenizer or template of the server's own in between), from an empty cache (`cache_prompt` off),
at the bench's sampling: llama.cpp's chain top-k, top-p, min-p, temperature in that order (what
llama-cpp-python's `generate` builds), no repetition, frequency, presence or DRY penalty, and
EOS respected when the bench stops at it (else ignored, for fixed-length runs). The run is timed
by the server's own clock, its `timings`: the first token after the prompt's forward
(`prompt_ms`), then `predicted_per_second`, its tokens after the first over the time after it,
which is how edgespec's decode speed is counted. HTTP and JSON costs are left out here; the
end-to-end comparison of the two servers is benchmarks/bench_server.py.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

from ..decoding import SamplingParams
from ..errors import ConfigError, DeployError
from .measure import SERVER_PEER, RunRecord
from .peer import PeerSource, _Peer

__all__ = ["LlamaServerPeer", "server_peer_name", "parse_peer", "completion_body", "record_from_response"]

logger = logging.getLogger(__name__)

# llama.cpp's sampler chain at the bench's knobs, as llama-cpp-python's generate() orders it
SAMPLERS = ["top_k", "top_p", "min_p", "temperature"]


def server_peer_name(spec_type: str) -> str:
    """The configuration name of a llama-server peer: "llama-server", or "llama-server+TYPE"."""
    return SERVER_PEER if spec_type == "none" else f"{SERVER_PEER}+{spec_type}"


def parse_peer(name: str) -> str:
    """The speculative type a llama-server peer's name asks for ("none" for plain)."""
    if name == SERVER_PEER:
        return "none"
    head, sep, kind = name.partition("+")
    if head != SERVER_PEER or not sep or not kind:
        raise ConfigError(f"not a llama-server peer: {name!r} (llama-server or llama-server+TYPE)")
    return kind


def completion_body(ids: Sequence[int], max_tokens: int, params: SamplingParams, stop_at_eos: bool,
                    stop: Sequence[str] = ()) -> dict:
    """llama-server's /completion request for one bench run; `stop`: strings that end it (a chat
    reply's next speaker and blank line, endings.Ending.server_stop)."""
    body = {"prompt": [int(i) for i in ids], "n_predict": int(max_tokens), "cache_prompt": False,
            "return_tokens": True, "stream": False, "ignore_eos": not stop_at_eos, "samplers": SAMPLERS,
            "repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "dry_multiplier": 0.0,
            "n_probs": 0}
    if params.greedy:
        body.update(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0)
    else:
        body.update(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p)
    if params.seed is not None:
        body["seed"] = int(params.seed) & 0xFFFFFFFF
    if stop:
        body["stop"] = list(stop)
    return body


def record_from_response(doc: dict, prompt_len: int, stop_ids: Sequence[int] = ()) -> RunRecord:
    """A RunRecord timed by the server's own `timings`: prompt_ms (the prompt's forward and the
    first token) as time to first token, predicted_ms the time after it; draft_n and
    draft_n_accepted when it drafted. Tokens after the first stop id are dropped."""
    t = doc.get("timings") or {}
    tokens = [int(x) for x in doc.get("tokens") or []]
    if "prompt_ms" not in t or "predicted_ms" not in t:
        raise DeployError("llama-server's answer has no timings (an older build?)")
    stops = set(stop_ids)
    cut = next((i + 1 for i, tok in enumerate(tokens) if tok in stops), len(tokens))
    tokens = tokens[:cut]
    ttft = float(t["prompt_ms"]) / 1e3
    accepted = int(t.get("draft_n_accepted", 0))
    # the first token comes with the prompt's forward; each later step commits one token plus
    # those of its draft it accepted
    return RunRecord.timed(prompt_len, tokens, ttft, ttft + float(t["predicted_ms"]) / 1e3,
                           steps=max(len(tokens) - accepted, 0), drafted=int(t.get("draft_n", 0)),
                           accepted=accepted)


class LlamaServerPeer(_Peer):
    """llama-server decoding one GGUF (plain, or with `spec`), timed by its own clock."""

    def __init__(self, source: PeerSource, *, threads: int, n_ctx: int, vocab_size: int | None = None,
                 spec=None, draft: Path | None = None, build=None, stop_at_eos: bool = False) -> None:
        from ..deploy import ServerOptions, SpecSettings, locate, read_help, server_argv
        from ..deploy.process import ServerProcess, free_port

        spec = spec or SpecSettings()
        self.source, self.threads, self.n_ctx, self.spec, self.draft = source, int(threads), int(n_ctx), spec, draft
        self.name = server_peer_name(spec.type)
        self.stop_at_eos = stop_at_eos
        self.build = build or locate()
        port = free_port()
        opts = ServerOptions(model=source.path, spec=spec, draft=draft, context=self.n_ctx, threads=self.threads,
                             port=port, parallel=1, jinja=False, metrics=True)
        try:
            self.argv = server_argv(read_help(self.build.server), opts)
            self._proc = ServerProcess(self.argv, host=opts.host, port=port)
        except DeployError as e:
            raise ConfigError(f"{self.name}: {e}") from None
        self._check_vocab(self._n_vocab(), vocab_size)

    def _n_vocab(self) -> int | None:
        from ..deploy.process import http_json

        status, doc = http_json(self._proc.url + "/v1/models", timeout=30)
        try:
            return int(doc["data"][0]["meta"]["n_vocab"]) if status == 200 else None
        except (KeyError, IndexError, TypeError, ValueError):
            return None

    def describe(self) -> dict:
        """What the JSON records: the build (source, CMake flags, compiler, CPU) and every flag."""
        flags = [Path(a).name if a in (str(self.source.path), str(self.draft)) else a for a in self.argv[1:]]
        return {"name": self.name, "library": "llama-server", "version": self.build.source,
                "build": self.build.record(), "flags": flags, "spec_type": self.spec.type,
                "gguf": self.source.path.name, "draft_gguf": self.draft.name if self.draft else None,
                "origin": self.source.origin, "threads": self.threads, "n_ctx": self.n_ctx,
                "timing": "the server's own timings (prompt_ms, predicted_ms)",
                "sampling": "llama.cpp's sampler chain (top_k, top_p, min_p, temperature) at the bench's settings"}

    def decode(self, ids: Sequence[int], max_tokens: int, stop_ids: Sequence[int] = (), rss=None,
               params: SamplingParams = SamplingParams(), ending=None, ended=None) -> RunRecord:
        """One run from an empty cache, timed by the server, ended where `ending` says (its stop
        strings are the server's; `ended`, a watcher in this process, is not needed)."""
        body = completion_body(ids, max_tokens, params, stop_at_eos=bool(stop_ids) or self.stop_at_eos,
                               stop=ending.server_stop() if ending is not None else ())
        try:
            doc = self._proc.post("/completion", body)
        except (DeployError, OSError) as e:
            raise ConfigError(f"{self.name}: {e}") from None
        return dataclasses.replace(record_from_response(doc, len(ids), stop_ids), config=self.name,
                                   peak_rss=self._rss())

    def _rss(self) -> int:
        import psutil

        try:
            return int(psutil.Process(self._proc.proc.pid).memory_info().rss)
        except psutil.Error:
            return 0

    def close(self) -> None:
        proc, self._proc = getattr(self, "_proc", None), None
        if proc is not None:
            proc.close()
