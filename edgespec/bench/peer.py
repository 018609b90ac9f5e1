"""The peer an edge user already has: llama-cpp-python's own plain decode of a GGUF.

`edgespec bench` runs it in its own process, interleaved with edgespec's configurations on every
prompt and repeat, fed edgespec's prompt token ids (so both decode the same prompt, whatever either
tokenizer or chat formatting would do) and timed as edgespec is timed: decode tokens/s after the
first token. It goes through `Llama.generate`, the loop `create_completion` uses, with llama.cpp's
sampler chain at the bench's settings (greedy, or temperature, top-k, top-p and min-p with no
repetition penalty) and default settings otherwise (mmap, its own weight repacking): what a user
of llama-cpp-python gets, not edgespec's tuned llama.cpp backend. llama.cpp applies the
temperature after top-p and min-p, edgespec before them (decoding/sampling.py), so at the same
settings the two sample from slightly different distributions; the work per token is the same.

llama_cpp is imported only when a peer is opened; without it the bench runs without the column.

With the target on a GPU the peer must run on that GPU too, or the column compares devices, not
decoders: VulkanPeer is the Vulkan build of llama.cpp (runtimes/llamacpp_vulkan) decoding the same
GGUF plainly, one llama_decode per token with every layer offloaded, sampled by that build's own
sampler chain at the same settings. llama-cpp-python's `Llama` cannot drive that build (its
functions are bound to its own CPU library), so the loop is `generate`'s, written out.
"""
from __future__ import annotations

import abc
import importlib
import importlib.util
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..decoding import SamplingParams
from ..errors import ConfigError
from .measure import PEER, RunRecord

__all__ = ["PEER", "INSTALL_HINT", "PeerSource", "LlamaCppPeer", "VulkanPeer", "find_peer_gguf", "check_gguf",
           "missing_reason", "vulkan_missing_reason", "sampler_settings", "on_gpu"]

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'edgespec[llamacpp]'"
DEFAULT_N_CTX = 4096  # edgespec's own default context: prompts that fit edgespec fit the peer


@dataclass(frozen=True)
class PeerSource:
    """The GGUF the peer decodes and why that one."""

    path: Path
    origin: str  # "given" (--peer-gguf), "source" (the GGUF the target was exported from), "bundle" (its GGUF)


def check_gguf(path: str | os.PathLike) -> Path:
    """`path` if it is a readable GGUF file, else a one-line ConfigError."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"--peer-gguf: file not found: {p}")
    try:
        with p.open("rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        raise ConfigError(f"--peer-gguf: cannot read {p}: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise ConfigError(f"--peer-gguf: {p} is not a GGUF file (bad magic bytes)")
    return p


def _source_gguf(source: dict) -> Path | None:
    """The GGUF a target was exported from, when edgespec can find it: a preset's packaged model
    (the default Gemma 3 270M) of that name and checksum. A user's own GGUF has no known place
    (the manifest keeps no local paths): pass it with --peer-gguf."""
    from ..models.catalog import PRESETS, preset_source

    for name, preset in PRESETS.items():
        if importlib.util.find_spec(preset.gguf_package) is None:
            continue
        pkg = importlib.import_module(preset.gguf_package)
        if getattr(pkg, "MODEL_NAME", None) != source.get("name"):
            continue
        try:
            path = preset_source(name)  # assembles the file from its package if the cache lost it
        except (OSError, ValueError) as e:  # a damaged cache copy, a full disk
            logger.warning("cannot assemble %s: %s", source.get("name"), e)
            return None
        want = source.get("sha256")
        if want:
            from ..exporters.sources import sha256_of  # hashlib only; no torch

            if sha256_of([path]) != want:
                logger.warning("%s differs from the GGUF the bundle was exported from (checksum)", path)
                return None
        return path
    return None


def find_peer_gguf(bundle, given: str | os.PathLike | None = None) -> PeerSource | None:
    """The GGUF to measure llama.cpp on: `given`, else the GGUF the bundle's target came from when
    it can be found, else the bundle's own GGUF target; None when there is none (an ONNX/OpenVINO
    bundle exported from a Hugging Face folder)."""
    if given is not None:
        return PeerSource(check_gguf(given), "given")
    target = bundle.manifest.target
    if target.source.get("kind") == "gguf":
        path = _source_gguf(target.source)
        if path is not None:
            return PeerSource(path, "source")
    art = target.formats.get("gguf")
    if art is not None:
        return PeerSource(bundle.file(art.file), "bundle")
    if target.source.get("kind") == "gguf":
        logger.warning("the bundle's target came from %s, which edgespec cannot find; pass --peer-gguf FILE to "
                       "measure llama.cpp on it", target.source.get("name"))
    return None


def missing_reason() -> str | None:
    """Why the peer cannot run here (one line with the fix), or None when llama-cpp-python imports."""
    try:
        importlib.import_module("llama_cpp")
    except ImportError:
        return f"llama-cpp-python is not installed ({INSTALL_HINT})"
    except OSError as e:  # the shared library did not load
        return f"llama-cpp-python cannot load llama.cpp ({str(e).splitlines()[0] if str(e) else e})"
    return None


def _version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None


def sampler_settings(params: SamplingParams) -> dict:
    """llama-cpp-python's `generate` keywords for `params`: its greedy sampler at temperature 0,
    else its chain with the same knobs (0 turns top-k off in both)."""
    if params.greedy:
        return {"top_k": 1, "top_p": 1.0, "min_p": 0.0, "temp": 0.0}
    return {"top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p,
            "temp": params.temperature}


def _timed(prompt_len: int, tokens: Iterator[int], max_tokens: int, stop_ids: Sequence[int], rss,
           ended: Callable[[list[int]], bool] | None = None) -> RunRecord:
    """Drain `tokens` (a peer's decode loop, started lazily) to `max_tokens`, a stop id or the
    token after which `ended` (endings.watcher, on the new tokens) says the reply has ended, timed
    as measure.measure_run times edgespec; the record's config/class/prompt fields are left for
    the caller. The loop is closed at the last token kept, before it evaluates one more."""
    if rss is not None:
        rss.mark()
    out: list[int] = []
    stops = set(stop_ids)
    first = None
    t0 = time.perf_counter()
    try:
        for tok in tokens:
            if first is None:
                first = time.perf_counter() - t0
            out.append(int(tok))
            if len(out) >= max_tokens or tok in stops or ended is not None and ended(out):
                break
    finally:
        tokens.close()
    total_s = time.perf_counter() - t0
    return RunRecord.timed(prompt_len, out, total_s if first is None else first, total_s,
                           steps=len(out),  # one forward per token
                           config=PEER, peak_rss=0 if rss is None else rss.mark())


class _Peer(abc.ABC):
    """What both peers share: the vocabulary check against the bundle's target and closing."""

    name = PEER

    def _check_vocab(self, n_vocab: int, vocab_size: int | None) -> None:
        if vocab_size is not None and n_vocab != vocab_size:
            self.close()
            raise ConfigError(f"the peer GGUF {self.source.path.name} has {n_vocab} tokens, the bundle's target "
                              f"{vocab_size}: not the same model (--peer-gguf)")

    @abc.abstractmethod
    def close(self) -> None:
        """Free the peer's model (idempotent)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LlamaCppPeer(_Peer):
    """llama-cpp-python's plain decode of one GGUF, timed like an edgespec run."""

    def __init__(self, source: PeerSource, *, threads: int, n_ctx: int = DEFAULT_N_CTX,
                 vocab_size: int | None = None) -> None:
        reason = missing_reason()
        if reason is not None:
            raise ConfigError(reason)
        import llama_cpp

        self.source, self.threads, self.n_ctx = source, int(threads), int(n_ctx)
        try:
            self._llm = llama_cpp.Llama(model_path=str(source.path), n_threads=self.threads,
                                        n_threads_batch=self.threads, n_ctx=self.n_ctx, verbose=False)
        except (ValueError, RuntimeError, OSError) as e:  # llama-cpp-python's "Failed to load model from file"
            raise ConfigError(f"llama.cpp cannot load {source.path.name}: {str(e).splitlines()[0]}") from None
        self._check_vocab(self._llm.n_vocab(), vocab_size)

    def describe(self) -> dict:
        """What the JSON records about the peer (a file name, no local path)."""
        return {"name": PEER, "library": "llama-cpp-python", "version": _version(), "gguf": self.source.path.name,
                "origin": self.source.origin, "threads": self.threads, "n_ctx": self.n_ctx,
                "sampling": "llama.cpp's sampler chain at the bench's settings"}

    def decode(self, ids: Sequence[int], max_tokens: int, stop_ids: Sequence[int] = (), rss=None,
               params: SamplingParams = SamplingParams(), ending=None, ended=None) -> RunRecord:
        """Decode up to `max_tokens` tokens after `ids` from an empty cache, timed (greedy unless
        `params` say otherwise), ending where `ended` says (measure.run_bench)."""
        llm = self._llm
        llm.reset()  # n_tokens = 0: generate() then reuses no cached prefix, every run prefills
        if params.seed is not None:
            llm.set_seed(params.seed)
        gen = llm.generate(list(ids), **sampler_settings(params), repeat_penalty=1.0, reset=True)
        return _timed(len(ids), gen, max_tokens, stop_ids, rss, ended)

    def close(self) -> None:
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None and hasattr(llm, "close"):
            llm.close()


def on_gpu(runtime) -> bool:
    """Whether a runtime offloads its layers to a GPU (llama.cpp's n_gpu_layers, where it has one)."""
    return bool(runtime.capabilities.extra.get("gpu_layers"))


def vulkan_missing_reason() -> str | None:
    """Why the Vulkan build of llama.cpp cannot run a GPU peer here (one line), or None."""
    from ..errors import BackendError
    from ..runtimes.llamacpp_vulkan.library import load_vulkan_library

    try:
        lib = load_vulkan_library()
    except BackendError as e:
        return str(e)
    return None if lib.devices() else "the Vulkan build of llama.cpp registered no GPU"


LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.h: a random seed per sampler


class VulkanPeer(_Peer):
    """The Vulkan build of llama.cpp's plain decode of one GGUF on the GPU, timed like an edgespec run."""

    def __init__(self, source: PeerSource, *, threads: int, n_ctx: int = DEFAULT_N_CTX,
                 vocab_size: int | None = None) -> None:
        from ..errors import BackendError
        from ..runtimes.llamacpp_vulkan.runtime import LlamaCppVulkanRuntime

        self.source, self.threads, self.n_ctx = source, int(threads), int(n_ctx)
        try:
            self._rt = LlamaCppVulkanRuntime(source.path, threads=self.threads, device="GPU", kv_capacity=self.n_ctx)
        except BackendError as e:
            raise ConfigError(f"llama.cpp (Vulkan build) cannot run {source.path.name}: {e}") from None
        self._lib = self._rt._lib
        self._check_vocab(self._rt.vocab_size, vocab_size)

    def describe(self) -> dict:
        """What the JSON records about the peer: the build and the GPU it decoded on."""
        rt = self._rt
        return {"name": PEER, "library": "llama.cpp (Vulkan build)", "version": self._lib.build,
                "device": "GPU", "gpu": "; ".join(rt.gpus), "gpu_layers": rt.capabilities.extra["gpu_layers"],
                "gguf": self.source.path.name, "origin": self.source.origin, "threads": self.threads,
                "n_ctx": self.n_ctx, "sampling": "llama.cpp's sampler chain at the bench's settings"}

    def _sampler(self, params: SamplingParams):
        """llama.cpp's chain as llama-cpp-python builds it for `generate` with these settings."""
        lib = self._lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if params.greedy:
            parts = [lib.llama_sampler_init_greedy()]
        else:
            seed = LLAMA_DEFAULT_SEED if params.seed is None else int(params.seed) & 0xFFFFFFFF
            parts = [lib.llama_sampler_init_top_k(params.top_k), lib.llama_sampler_init_top_p(params.top_p, 1),
                     lib.llama_sampler_init_min_p(params.min_p, 1), lib.llama_sampler_init_temp(params.temperature),
                     lib.llama_sampler_init_dist(seed)]
        for part in parts:
            lib.llama_sampler_chain_add(chain, part)  # the chain owns them from here
        return chain

    def decode(self, ids: Sequence[int], max_tokens: int, stop_ids: Sequence[int] = (), rss=None,
               params: SamplingParams = SamplingParams(), ending=None, ended=None) -> RunRecord:
        """As LlamaCppPeer.decode: up to `max_tokens` tokens after `ids` from an empty cache, timed."""
        self._rt.reset()
        sampler = self._sampler(params)
        try:
            return _timed(len(ids), self._tokens(ids, sampler), max_tokens, stop_ids, rss, ended)
        finally:
            self._lib.llama_sampler_free(sampler)

    def _tokens(self, ids: Sequence[int], sampler) -> Iterator[int]:
        """generate()'s loop: the prompt in one forward, then a forward per sampled token."""
        rt = self._rt
        rt.forward(list(ids), n_logits=1)
        while True:
            tok = rt.sample(sampler)
            yield tok
            rt.forward([tok], n_logits=1)

    def close(self) -> None:
        rt, self._rt = getattr(self, "_rt", None), None
        if rt is not None:
            rt.close()
