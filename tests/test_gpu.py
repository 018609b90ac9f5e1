"""The llama.cpp backend on a Vulkan GPU (runtimes/llamacpp_vulkan).

The first tests need no GPU: how the Vulkan build is found, refused and bound. The others run
where the Vulkan build of llama.cpp and a Vulkan device are there (the `.ci/gpu` tier: Mesa's
lavapipe, a software Vulkan device, with GGML_VK_VISIBLE_DEVICES=0) and are skipped with a
one-line reason elsewhere: tiny random-weight models here, the real default model in
tests/test_gpu_default.py (slow tier)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from edgespec.errors import BackendError
from edgespec.runtimes import BACKENDS
from edgespec.runtimes.llamacpp_vulkan import library
from edgespec.runtimes.llamacpp_vulkan.library import LIBS_ENV, find_library_dir
from edgespec.runtimes.llamacpp_vulkan.runtime import offload_layers

GGUF = ("gguf",)
GPU_ATOL = 2e-2  # a Vulkan device against the CPU build, fp32 tiny model
SEEDS = 306  # the sampled oracle's check B on a software device: power 0.99 at TV 0.015


# ---------------------------------------------------------------- no GPU needed


def test_registry_row_drives_gpus_and_runs_gguf():
    info = BACKENDS["llamacpp_vulkan"]
    assert (info.bundle_format, info.extra, info.accelerators) == ("gguf", "gpu", True)
    assert info.shared_body is None and info.exact_modes == ()


def test_offload_layers_by_device():
    assert offload_layers("GPU", True) == -1
    assert offload_layers(None, True) == -1  # AUTO
    assert offload_layers("cpu", False) == 0
    assert offload_layers("auto", False) == 0  # AUTO falls back to the CPU, GPU does not
    with pytest.raises(BackendError, match="GGML_VK_VISIBLE_DEVICES"):
        offload_layers("GPU", False)
    with pytest.raises(BackendError, match="'NPU' is not available"):
        offload_layers("NPU", True)


def test_library_folder_from_env_or_an_installed_wheel(monkeypatch, tmp_path):
    monkeypatch.setenv(LIBS_ENV, str(tmp_path / "missing"))
    with pytest.raises(BackendError, match="is not a folder"):
        find_library_dir()
    monkeypatch.setenv(LIBS_ENV, str(tmp_path))
    assert find_library_dir() == tmp_path
    monkeypatch.delenv(LIBS_ENV)
    site = tmp_path / "site"
    (site / "inferna_vulkan.libs").mkdir(parents=True)
    monkeypatch.setattr("sys.path", [str(tmp_path / "elsewhere"), str(site)])
    assert find_library_dir() == site / "inferna_vulkan.libs"
    monkeypatch.setattr("sys.path", [str(tmp_path / "elsewhere")])
    with pytest.raises(BackendError, match="no Vulkan build of llama.cpp found.*inferna-vulkan==0.7.0"):
        find_library_dir()


def test_an_unknown_build_is_refused_before_it_is_called(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'edgespec[llamacpp]')")
    (tmp_path / "libllama-0123abcd.so.0.9.0").write_bytes(b"\x7fELF not really")
    with pytest.raises(BackendError, match="has not checked the ABI of; known: libllama-af9aab63"):
        library.VulkanLlama(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BackendError, match="has no libllama-"):
        library.VulkanLlama(empty)


def test_context_params_gain_one_pointer_before_the_booleans():
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    cpu = llama_cpp.llama_context_params
    vk = library._context_params_type(cpu)
    assert ctypes.sizeof(vk) == ctypes.sizeof(cpu) + 8
    names = [n for n, *_ in cpu._fields_]
    at = names.index("embeddings")
    for name in names[:at]:
        assert getattr(vk, name).offset == getattr(cpu, name).offset, name
    for name in names[at:]:
        assert getattr(vk, name).offset == getattr(cpu, name).offset + 8, name
    assert vk._vulkan_build_pointer.offset == cpu.embeddings.offset


def test_the_known_build_default_params_match_the_bindings():
    """The measured layout, checked on the build itself where it is installed: the bytes its
    llama_context_default_params writes fill exactly the re-bound struct (x86-64 only: the
    struct is returned through a hidden first pointer there)."""
    lib = _vulkan_library_or_skip()
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("the struct-size check reads the x86-64 return convention")
    for fn, cls in (("llama_context_default_params", lib._ctx_params),
                    ("llama_model_default_params", lib._decl.llama_model_params)):
        raw = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)((fn, lib._llama))
        buf = (ctypes.c_ubyte * 1024)(*([0xAA] * 1024))
        raw(ctypes.addressof(buf))
        written = max(i for i, b in enumerate(bytes(buf)) if b != 0xAA) + 1
        assert ctypes.sizeof(cls) - 8 < written <= ctypes.sizeof(cls), fn
    params = lib.llama_context_default_params()
    assert (params.n_ctx, params.n_ubatch, params.n_seq_max) == (512, 512, 1)
    assert (params.offload_kqv, params.no_perf, params.swa_full, params.kv_unified) == (True, True, True, False)


# ---------------------------------------------------------------- on a Vulkan device


def _vulkan_library_or_skip():
    try:
        return library.load_vulkan_library()
    except BackendError as e:
        pytest.skip(str(e).split(":")[0])  # the reason, without the install hint


@pytest.fixture(scope="module")
def vulkan():
    """The loaded Vulkan build with at least one device, or the tests skip."""
    lib = _vulkan_library_or_skip()
    if not lib.devices():
        pytest.skip("no Vulkan device (lavapipe needs mesa-vulkan-drivers and GGML_VK_VISIBLE_DEVICES=0)")
    return lib


def test_devices_are_listed_with_names(vulkan):
    from edgespec.runtimes import backend_devices
    from edgespec.runtimes.llamacpp_vulkan.runtime import gpu_names

    names = gpu_names()
    assert names and all(n.startswith("Vulkan") and ": " in n for n in names)
    assert backend_devices("llamacpp_vulkan") == ["CPU", "GPU"]
    assert vulkan.backends == ["cpu", "vulkan"]


def _open(path, **kw):
    from edgespec.runtimes import open_runtime

    return open_runtime("llamacpp_vulkan", path, threads=2, **kw)


def test_gpu_logits_match_the_cpu_build_and_roll_back(vulkan, zoo):
    """A tiny fp32 model on the GPU and on llama-cpp-python's CPU build, in one process: the
    same logits up to summation order, and a rollback recomputes what it removed."""
    from edgespec.bundle import load_bundle
    from edgespec.runtimes import open_runtime
    from tests.tiny import LONG_PROMPT

    b = load_bundle(zoo.bundle("gemma3", None, formats=GGUF))
    path = b.file(b.manifest.target.formats["gguf"].file)
    ids = zoo.hf_tokenizer("gemma3")(LONG_PROMPT).input_ids[:24]
    with open_runtime("llamacpp", path, threads=2) as cpu, _open(path, device="GPU") as gpu:
        assert gpu.capabilities.extra["gpu_layers"] == -1 and gpu.capabilities.extra["gpu"].startswith("Vulkan")
        ref = cpu.forward(ids, n_logits=len(ids))
        got = gpu.forward(ids, n_logits=len(ids))
        # the device rounds unlike the CPU build (dev/gpu/NOTES.md)
        np.testing.assert_allclose(got, ref, atol=GPU_ATOL)
        gpu.trim(10)
        assert gpu.n_past == 10
        again = gpu.forward(ids[10:], n_logits=len(ids) - 10)
        # a stale cache would be whole logits apart; the same device recomputes within rounding
        np.testing.assert_allclose(again, got[10:], atol=2e-3)


def drafting_engine(path, **kw):
    """An engine that drafts on the device: at the widths the probe found exact there, or, where it
    found none (Mesa's lavapipe: a software device whose wide forwards round apart), under
    allow_inexact, which the test says. Returns (engine, the probe's verdict, whether inexact)."""
    import edgespec

    engine = edgespec.load(path, **kw)
    verdict = engine.opened.exactness
    if engine.opened.inexact_refusal is None:
        return engine, verdict, False
    engine.close()
    print(f"\n{verdict.describe()}: drafting anyway (allow_inexact) to test the speculative path on this device")
    return edgespec.load(path, allow_inexact=True, **kw), verdict, True


def assert_same_or_near_tie(plain, ids: list[int], got: list[int], want: list[int], verdict, inexact: bool) -> None:
    """Speculative greedy == plain greedy; where drafting ran at widths the probe found inexact, the
    two may part only where plain's two likeliest tokens are within a few of the probe's worst
    difference (a near-tie the rounding may flip), which the test then says."""
    if got == want:
        return
    assert inexact, f"speculative {got} != plain {want} at exact widths"
    i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
    plain.target.reset()
    row = np.sort(plain.target.forward(ids + want[:i])[-1])
    plain.target.reset()
    gap = float(row[-1] - row[-2])
    assert gap <= max(4 * verdict.worst_diff, 1e-3), f"parted at token {i} where plain's top two are {gap:.3g} apart"
    print(f"\nparted from plain at token {i}, a near-tie ({gap:.2g} apart; the probe saw {verdict.worst_diff:.2g})")


def test_speculative_greedy_equals_plain_on_the_gpu(vulkan, zoo):
    """Speculative greedy == plain greedy token for token on the device, drafting every run: at the
    widths the probe found exact there, else under allow_inexact (and then equal up to near-ties)."""
    import edgespec
    from edgespec.decoding import SamplingParams
    from tests.zoo import AGREEING

    path = zoo.bundle("gemma3", AGREEING, formats=GGUF)
    # two drafts: the probe's forwards grow with the widths, each dear on a software GPU
    spec, verdict, inexact = drafting_engine(path, backend="llamacpp_vulkan", device="GPU", k=2)
    with spec, edgespec.load(path, backend="llamacpp_vulkan", device="GPU", use_draft=False) as plain:
        assert verdict is not None and verdict.max_width >= 2
        ids = spec.tokenizer.encode("The quick brown fox")
        outs, drafted = [], 0
        for engine in (spec, plain):
            tokens = list(ids)
            for step in engine.decoder.stream(tokens, SamplingParams(), 16):
                drafted += step.drafted
            outs.append(tokens[len(ids):])
        assert len(outs[0]) == 16 and drafted > 0
        assert_same_or_near_tie(plain, ids, outs[0], outs[1], verdict, inexact)


def test_bench_on_the_gpu_records_the_device_the_verdict_and_a_same_device_peer(vulkan, zoo, tmp_path):
    """`edgespec bench --device GPU`: the JSON names the device, the probe's verdict on it, and a
    llama.cpp column decoded by the Vulkan build on the same GPU (not llama-cpp-python's CPU build)."""
    from edgespec.bench.measure import PEER
    from edgespec.bench.schema import load_runs
    from tests.test_bench import run_cli
    from tests.zoo import AGREEING

    bundle = zoo.bundle("gemma3", AGREEING, formats=GGUF)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "class": "code", "text": "The quick brown fox"}\n')
    out = tmp_path / "r.json"
    # --allow-inexact: where the probe finds no exact width (lavapipe) bench has nothing to compare otherwise
    proc = run_cli("bench", str(bundle), "--device", "GPU", "--prompts", str(prompts), "--repeat", "1",
                   "--warmup", "0", "--max-tokens", "4", "--threads", "2", "--allow-inexact", "--json", str(out),
                   "--report", str(tmp_path / "rep"))
    assert proc.returncode == 0, proc.stderr
    (doc,) = load_runs(out)
    assert doc["backend"]["name"] == "llamacpp_vulkan" and doc["backend"]["device"] == "GPU"
    verdict = doc["exactness"]
    assert verdict is not None and verdict["max_width"] >= 2 and verdict["summary"]
    peer = doc["peer"]
    assert doc["configs"][-1] == PEER and peer["library"] == "llama.cpp (Vulkan build)"
    assert peer["device"] == "GPU" and peer["gpu"].startswith("Vulkan") and peer["gpu_layers"] == -1
    assert peer["version"].startswith("llama.cpp b") and peer["gguf"] == "model.gguf"
    overall = doc["overall"]
    assert overall[PEER]["tok_s"] > 0 and overall[PEER]["new_tokens"] == 4
    # the same fp32 GGUF on the same device, greedy: the peer writes edgespec plain's text
    assert overall[PEER]["agree_prompts"] == 1
    assert f"on the GPU {peer['gpu']}" in (tmp_path / "rep" / "report.md").read_text()


# ---------------------------------------------------------------- draft on the CPU, target on the GPU

CPU_DRAFT = {"draft_backend": "llamacpp", "draft_device": "CPU"}


def _greedy_tokens(engine, prompt: str, n: int) -> tuple[list[int], int]:
    """`n` greedy tokens after `prompt`, and how many tokens were drafted on the way."""
    from edgespec.decoding import SamplingParams

    ids = engine.tokenizer.encode(prompt)
    tokens, drafted = list(ids), 0
    for step in engine.decoder.stream(tokens, SamplingParams(), n):
        drafted += step.drafted
    return tokens[len(ids):], drafted


def test_draft_on_the_cpu_build_target_on_the_gpu(vulkan, zoo):
    """--device GPU --draft-backend llamacpp --draft-device CPU: the target on the Vulkan device,
    the draft on llama-cpp-python's CPU build, each runtime saying where it runs; the cost policy
    measures both sides' step costs; greedy speculative == plain wherever the probe lets it draft."""
    import edgespec
    from tests.zoo import AGREEING

    path = zoo.bundle("gemma3", AGREEING, formats=GGUF)
    with edgespec.load(path, backend="llamacpp_vulkan", device="GPU", policy="cost", **CPU_DRAFT) as spec, \
            edgespec.load(path, backend="llamacpp_vulkan", device="GPU", use_draft=False) as plain, \
            edgespec.load(path, backend="llamacpp_vulkan", device="GPU", policy="cost", allow_inexact=True,
                          **CPU_DRAFT) as lenient:
        verdict, refusal = spec.opened.exactness, spec.opened.inexact_refusal
        assert verdict is not None and (refusal is None) == bool(verdict.exact)
        # a refused draft is not even opened; under allow_inexact it always is
        for engine in (spec, lenient) if refusal is None else (lenient,):
            t, d = engine.target.capabilities, engine.draft.capabilities
            assert (t.backend, t.extra["gpu_layers"]) == ("llamacpp_vulkan", -1) and t.extra["gpu"].startswith("Vulkan")
            assert (d.backend, d.extra["gpu_layers"]) == ("llamacpp", 0)
        assert (spec.draft is None) == (refusal is not None)
        want, _ = _greedy_tokens(plain, "The quick brown fox", 16)
        got, drafted = _greedy_tokens(spec, "The quick brown fox", 16)
        assert len(want) == 16 and got == want
        # drafting only where the probe allows it; otherwise the reason says why not
        assert (drafted > 0) == (refusal is None) and (refusal is None or "no verify width is exact" in refusal)
        # allow_inexact drafts on the CPU whatever the probe found; the cost policy has timed both sides
        _, drafted = _greedy_tokens(lenient, "The quick brown fox", 16)
        assert drafted > 0
        learned = lenient.decoder.policy.snapshot()
        assert learned["sources"]["model"]["cost"] > 0 and learned["verify"], learned


def test_overlapped_drafting_on_the_cpu_while_the_gpu_verifies(vulkan, zoo):
    """--overlap with the draft on the CPU build and the target on the Vulkan device (drafting
    forced with allow_inexact, a fixed draft length): the verifies ran while the draft drafted on,
    some steps used the drafts made meanwhile, and the text is the sequential loop's (the same
    drafts, so the same verify forwards)."""
    import edgespec
    from tests.zoo import AGREEING

    path = zoo.bundle("gemma3", AGREEING, formats=GGUF)
    kw = dict(backend="llamacpp_vulkan", device="GPU", k=3, allow_inexact=True, **CPU_DRAFT)
    with edgespec.load(path, overlap=True, **kw) as overlapped, edgespec.load(path, **kw) as sequential:
        got, drafted = _greedy_tokens(overlapped, "The quick brown fox", 16)
        want, _ = _greedy_tokens(sequential, "The quick brown fox", 16)
        stats = overlapped.decoder.overlap
    assert got == want and drafted > 0
    assert stats.overlapped > 0 and stats.steps_ahead > 0, stats


def test_sampled_speculative_on_the_gpu_follows_the_targets_law(vulkan, zoo):
    """The exact oracle (tests/oracle.py) with the draft on the CPU and the target on the GPU: a
    software device's forwards are dear, so check B runs SEEDS seeds, not the fast tier's 919: power
    0.99 against TV 0.02 on the first 4 tokens' law (0.005 for check A, 0.015 for B), false alarms 1e-4.
    The law is the device's own (its one-token rows). Where the probe found no exact width on the
    device (lavapipe), drafting runs under allow_inexact: a verify's rows then differ from
    one-token rows by up to the probe's worst difference, and a run may part from plain decoding
    only at a draw that rounding of that size can flip (checked run by run, counted, printed)."""
    import time

    from edgespec.decoding import SamplingParams
    from tests import oracle
    from tests.zoo import AGREEING

    params = SamplingParams(temperature=1.0, top_k=3)
    path = zoo.bundle("gemma3", AGREEING, formats=GGUF)
    spec, verdict, inexact = drafting_engine(path, backend="llamacpp_vulkan", device="GPU", policy="fixed", k=2,
                                             threads=2, **CPU_DRAFT)
    with spec:
        ids = spec.tokenizer.encode("The quick brown fox")
        rows = oracle.PlainRows(spec.target, ids, spec.opened.limits.max_batch)
        t0 = time.perf_counter()
        statement = oracle.check_reference("GPU", rows, len(ids), params).statement(SEEDS)
        rows.release()
        drafted = []

        def run(seed: int) -> list[int]:
            out = [t for r in spec.stream(ids, max_tokens=oracle.LENGTH, temperature=1.0, top_k=3, seed=seed)
                   for t in r.token_ids]
            drafted.append(spec.last_stats.drafted)
            return out

        parted = oracle.check_path("GPU target, CPU draft, k=2", run, rows, len(ids), params,
                                   rounding=verdict.worst_diff if inexact else None, seeds=SEEDS)
    tail = (f" Drafting at widths the probe found inexact ({verdict.describe()}): {parted} of {SEEDS} runs "
            "parted from plain decoding, each at a near-tie that rounding flips." if inexact else "")
    print(f"\n{statement}{tail} [{time.perf_counter() - t0:.0f} s]")
    assert sum(drafted) > SEEDS


def test_the_same_device_peer_samples_with_llama_cpps_chain(vulkan, zoo):
    """VulkanPeer's sampled decode: seeded runs repeat, other seeds wander, and greedy is the
    device's own argmax text (llama.cpp's greedy sampler on the Vulkan build)."""
    from edgespec.bench.measure import PEER
    from edgespec.bench.peer import PeerSource, VulkanPeer
    from edgespec.bundle import load_bundle
    from edgespec.decoding import SamplingParams

    b = load_bundle(zoo.bundle("gemma3", None, formats=GGUF))
    path = b.file(b.manifest.target.formats["gguf"].file)
    ids = zoo.hf_tokenizer("gemma3")("The quick brown fox").input_ids
    with VulkanPeer(PeerSource(path, "given"), threads=2, n_ctx=128) as peer:
        assert peer.describe()["device"] == "GPU" and peer.describe()["gpu"].startswith("Vulkan")
        greedy = peer.decode(ids, 6)
        hot = [peer.decode(ids, 6, params=SamplingParams(temperature=1.5, seed=s)).tokens for s in (1, 1, 2, 3, 4)]
        rt = peer._rt
        rt.reset()
        want, logits = [], rt.forward(ids)
        for _ in range(6):
            want.append(int(np.argmax(logits[-1])))
            logits = rt.forward(want[-1:])
    assert greedy.config == PEER and greedy.tokens == want and greedy.ttft_s > 0
    assert hot[0] == hot[1] and len(hot[0]) == 6 and len({tuple(t) for t in hot}) > 1
