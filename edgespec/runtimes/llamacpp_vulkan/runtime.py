"""llama.cpp on a Vulkan GPU: the llama.cpp backend's Runtime on a Vulkan build of llama.cpp.

Everything a forward does (one `llama_decode` per forward, rollback by `llama_memory_seq_rm`,
VocabTrim drafts fed embeddings) is the llama.cpp backend's own code: this Runtime only opens the
model through the Vulkan build (library.py) with every layer offloaded, so both builds coexist and
`--backend llamacpp` keeps running the CPU build.

Exactness: ggml's Vulkan matrix kernels choose their path by the batch's row count, so a verify
may round unlike one-token forwards. The runtime claims nothing: the engine's exactness probe
(runtimes/exactness.py) measures the widths on the device, as for every backend.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from ...errors import BackendError
from ..base import Capabilities
from ..llamacpp.runtime import MAX_BATCH, LlamaCppRuntime, use_extra_buffer_types
from .library import VISIBLE_ENV, GpuDevice, load_vulkan_library

__all__ = ["LlamaCppVulkanRuntime", "available_devices", "gpu_devices", "gpu_names", "system_info",
           "offload_layers"]

logger = logging.getLogger(__name__)


def gpu_devices() -> list[GpuDevice]:
    """The Vulkan devices llama.cpp can offload to here (loads the Vulkan build)."""
    return load_vulkan_library().devices()


def gpu_names() -> list[str]:
    """Each Vulkan device as "name: description", for `edgespec info`."""
    return [str(d) for d in gpu_devices()]


def available_devices() -> list[str]:
    """CPU (the same build without offloading), plus GPU where a Vulkan device is registered."""
    return ["CPU", "GPU"] if gpu_devices() else ["CPU"]


def system_info() -> str:
    return load_vulkan_library().llama_print_system_info().decode("utf-8", "replace")


def _no_gpu_reason() -> str:
    if VISIBLE_ENV not in os.environ:
        return (f"no Vulkan GPU registered (ggml skips software devices such as Mesa's llvmpipe unless "
                f"{VISIBLE_ENV} lists them, e.g. {VISIBLE_ENV}=0)")
    return f"no Vulkan GPU registered ({VISIBLE_ENV}={os.environ[VISIBLE_ENV]}; is a Vulkan driver installed?)"


def offload_layers(device: str | None, has_gpu: bool) -> int:
    """llama.cpp's n_gpu_layers for `device`: -1 (all) on the GPU, 0 on the CPU; AUTO: the GPU
    where there is one."""
    dev = (device or "AUTO").upper()
    if dev == "CPU" or (dev == "AUTO" and not has_gpu):
        return 0
    if dev not in ("GPU", "AUTO"):
        raise BackendError(f"llamacpp_vulkan: device '{device}' is not available (available: CPU, GPU)")
    if not has_gpu:
        raise BackendError(f"llamacpp_vulkan: {_no_gpu_reason()}")
    return -1


class LlamaCppVulkanRuntime(LlamaCppRuntime):
    """One GGUF model in a llama.cpp context of the Vulkan build, every layer on the GPU."""

    def __init__(self, model_path: str | os.PathLike, *, threads: int | None = None, device: str | None = None,
                 kv_capacity: int | None = None) -> None:
        lib = self._lib = load_vulkan_library()
        path = Path(model_path)
        if not path.is_file():
            raise BackendError(f"GGUF model not found: {path}")
        gpus = lib.devices()
        gpu_layers = offload_layers(device, bool(gpus))
        extra_bufts = self._load(lib, path, gpu_layers, threads, kv_capacity, build="llama.cpp (Vulkan build)")
        self.gpus = tuple(str(d) for d in gpus) if gpu_layers else ()
        if self.gpus:
            logger.info("llama.cpp offloads %s to %s", path.name, ", ".join(self.gpus))
        self.capabilities = Capabilities(
            backend="llamacpp_vulkan", can_trim=True, max_batch_tokens=MAX_BATCH,
            devices=("CPU", "GPU") if gpus else ("CPU",),
            batch_variance=("repacked weights use different kernels for one and several tokens"
                            if extra_bufts and not gpu_layers else None),
            extra={"gpu_layers": gpu_layers, "kv_capacity": self.kv_capacity,
                   "input_embeddings": self._embd is not None, "gpu": "; ".join(self.gpus)})

    def sample(self, sampler) -> int:
        """The token llama.cpp's `sampler` (a llama_sampler of this build) picks from the last
        forward's last logits, read in place (the bench's same-device peer, bench/peer.py)."""
        return int(self._lib.llama_sampler_sample(sampler, self._ctx, -1))

    def kernel_options(self) -> dict:
        # the probe's verdict belongs to this build and these devices
        return {**super(LlamaCppRuntime, self).kernel_options(), "build": self._lib.build, "system": system_info(),
                "extra_bufts": use_extra_buffer_types()}
