"""Session fixtures: the tiny model zoo (tests/zoo.py), exported once per session."""
from __future__ import annotations

from typing import Iterator

import pytest

from tests.zoo import TinyZoo


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory) -> Iterator[None]:
    """Tests never read or fill the user's edgespec cache (bundles, compiled models)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGESPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> Iterator[TinyZoo]:
    for module in ("torch", "transformers", "onnxruntime"):
        pytest.importorskip(module, reason=f"exporting tiny models needs {module} (pip install 'edgespec[all]')")
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: more threads only contend (40x slower on 2 cores)
    yield TinyZoo(tmp_path_factory.mktemp("tiny"))
    torch.set_num_threads(threads)
