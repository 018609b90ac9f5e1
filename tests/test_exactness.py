"""The exactness probe (runtimes/exactness.py) and the decoder's keeping to its verdict, on numpy toy
runtimes that round apart where told: the widths the probe calls exact (wide forwards, the KV rows they
write, a kernel's split points at long contexts, behind a shared body), where it starts, its cached
verdict (per machine and options, checksummed, re-probed when poisoned), and the decoder's verify cap
and prefill chunks. What the engine and onnxruntime do with the verdict, on exported tiny models, is
tests/test_exactness_engine.py's."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.decoding import SamplingParams, SpeculativeDecoder
from edgespec.decoding.limits import DecoderLimits
from edgespec.errors import ConfigError
from edgespec.runtimes import exactness
from edgespec.runtimes.exactness import PROBE_REACH, Exactness, probe, probe_cached, probe_starts, sampled_widths
from tests.toy import ToyRuntime, naive_greedy


class WideRounding(ToyRuntime):
    """A toy whose forwards of `from_width`+ tokens round differently: each returned row is off by
    `delta` (a large delta flips argmaxes, as llama.cpp's did), and with `kv=True` only the cache
    rows they write are off, so the returned rows match and the next forward does not."""

    def __init__(self, *args, from_width: int = 2, delta: float = 1e-4, kv: bool = False, **kw) -> None:
        super().__init__(*args, **kw)
        self.from_width, self.delta, self.kv = from_width, delta, kv
        self.widths: list[int] = []
        self._off: set[int] = set()  # positions written by a wide forward (kv=True)

    def forward(self, token_ids, n_logits=1):
        self.widths.append(len(token_ids))
        start = self.n_past
        out = super().forward(token_ids, n_logits)
        wide = len(token_ids) >= self.from_width
        if wide and self.kv:
            self._off |= set(range(start, self.n_past))
            return out
        if wide or any(p < self.n_past - len(token_ids) for p in self._off):
            out = out + np.float32(self.delta) * (np.arange(out.shape[-1]) % 3 == 0)
        return out

    def trim(self, n_past):
        super().trim(n_past)
        self._off = {p for p in self._off if p < n_past}


def test_a_batch_invariant_runtime_is_exact_at_every_width():
    verdict = probe(ToyRuntime(vocab=40), 9)
    assert verdict.exact == tuple(range(2, 10)) and verdict.exact_width == 9 and verdict.fully_exact
    assert verdict.worst_diff == 0.0 and verdict.probe_ms > 0
    assert verdict.describe() == f"exact verify widths on this machine: 2-9; probed up to {verdict.reach} keys"


def test_the_probe_finds_where_widths_stop_being_exact():
    verdict = probe(WideRounding(vocab=40, from_width=5, delta=3e-4), 8)
    assert verdict.exact == (2, 3, 4) and verdict.exact_width == 4 and not verdict.fully_exact
    assert verdict.worst_diff == pytest.approx(3e-4, rel=1e-2)
    assert verdict.describe().startswith("exact verify widths on this machine: 2-4 (not 5+")


def test_the_probe_reads_the_cache_rows_a_wide_forward_wrote():
    """Rows returned right, K/V written wrong: only the forward after the verify shows it."""
    verdict = probe(WideRounding(vocab=40, from_width=3, kv=True), 6)
    assert verdict.exact == (2,) and verdict.exact_width == 2


class KeySplitRounding(ToyRuntime):
    """A toy whose wide forwards round apart only when their keys go past `keys` (onnxruntime's
    SGEMM summed Gemma 3's 256-deep scores in one pass up to 128 keys, in halves beyond): a row
    computed beside more keys than `keys` while its own position is within them."""

    def __init__(self, *args, keys: int = 128, **kw) -> None:
        super().__init__(*args, **kw)
        self.keys = keys

    def forward(self, token_ids, n_logits=1):
        start = self.n_past
        out = super().forward(token_ids, n_logits)
        if len(token_ids) > 1 and start < self.keys < self.n_past:
            out = out + np.float32(1e-6) * (np.arange(out.shape[-1]) % 2 == 0)
        return out


def test_the_probe_looks_where_long_contexts_change_a_kernels_split():
    """The short prefixes alone would call this runtime exact at every width; a verify at 128 keys
    then parts from plain decoding mid-answer, as onnxruntime's did on Gemma 3 (round 14)."""
    assert probe(KeySplitRounding(vocab=40), 8, starts=(5, 14), sampled=()).fully_exact
    assert probe(KeySplitRounding(vocab=40), 8, sampled=()).exact == (2, 3, 4)  # 124 + 5 keys cross 128
    assert probe(KeySplitRounding(vocab=40, keys=64), 8, sampled=()).exact_width == 4  # from 60
    # from one key before the split, every width crosses it: none is exact
    verdict = probe(KeySplitRounding(vocab=40), 8, threads=2)
    assert verdict.exact == () and verdict.worst_diff == pytest.approx(1e-6, rel=0.02)


@pytest.mark.parametrize("keys, threads", [(144, 2), (272, 4), (528, 4), (80, 1), (512, 2), (2048, 2), (1024, 1)],
                         ids=["2-threads-second", "4-threads-second", "4-threads-twice", "1-thread-second",
                              "sliding-window", "far", "power-of-two"])
def test_the_probe_crosses_every_split_point_of_the_thread_count_and_the_window_edge(keys, threads):
    """The split points measured moved with the thread count (145 keys at 2 threads, 256/272 at
    4), a sliding window ends at 512 keys on Gemma 3, and contexts run to thousands of tokens:
    a runtime that rounds apart only past any of them is not called exact."""
    rt = KeySplitRounding(vocab=40, keys=keys)
    assert probe(rt, 9, sampled=()).fully_exact  # the short prefixes alone miss it
    verdict = probe(rt, 9, threads=threads)
    assert verdict.exact == () and rt.n_past == 0
    assert keys - 1 in probe_starts(9, threads, None)


def test_the_probe_starts_follow_the_thread_count_and_stay_within_the_context():
    assert probe_starts(17, 2, 4096) == (63, 127, 143, 255, 271, 511, 1023, 2047, 4077)
    assert probe_starts(17, 4, 4096) == (63, 127, 255, 271, 511, 527, 1023, 2047, 4077)
    assert probe_starts(17, 1, 300) == (63, 79, 127, 143, 255, 281)  # the last leaves room for the widest verify
    assert probe_starts(9, 2, 1 << 20)[-1] == PROBE_REACH - 11  # a long context is probed up to the reach
    assert sampled_widths(17) == (2, 3, 9, 17) and sampled_widths(2) == (2,) and sampled_widths(1) == ()
    # a sliding window bound from aligned starts: where it first leaves position 0, and where a
    # verify's rows start their windows in two aligned blocks
    assert {510, 765} <= set(probe_starts(17, 2, 4096, window=(512, 256)))
    assert not {510, 765} & set(probe_starts(17, 2, 4096))


def test_the_verdict_says_how_far_the_probe_looked_and_a_longer_reach_looks_farther():
    """reach: the most keys a probed forward attended to (the farthest start, the widest verify and
    the forward after it); a runtime rounding apart only past the default reach is caught when the
    probe is asked to look that far."""
    verdict = probe(ToyRuntime(vocab=40), 9, threads=2)
    assert verdict.reach == probe_starts(9, 2, None)[-1] + 9 + 1 == PROBE_REACH - 1
    far = KeySplitRounding(vocab=40, keys=8192)
    assert probe(far, 9, threads=2).fully_exact  # the default reach stops before 8192 keys
    longer = probe(far, 9, threads=2, reach=16384)
    assert longer.exact == () and longer.reach == 16383
    assert probe(ToyRuntime(vocab=40), 9, threads=2, reach=8192).reach == 8191
    assert probe(ToyRuntime(vocab=40), 9, threads=2, reach=300).reach == 299


def test_a_verdict_cached_before_the_reach_was_recorded_reads_as_the_default_reach():
    old = {"max_width": 9, "exact": list(range(2, 10)), "worst_diff": 0.0, "probe_ms": 1.0}
    assert Exactness.from_dict(old).reach == PROBE_REACH
    assert Exactness.from_dict({**old, "reach": 8191}).reach == 8191
    with pytest.raises(ValueError, match="reach"):
        Exactness.from_dict({**old, "reach": 1})


@pytest.mark.parametrize(("field", "value", "message"), [
    ("max_width", True, "max_width must be an integer in 2..1024, got True"),
    ("max_width", 2000, "max_width must be an integer in 2..1024, got 2000"),
    ("exact", [2, "3"], "exact width must be an integer in 2..9, got '3'"),
    ("worst_diff", float("inf"), "worst_diff must be a finite number >= 0, got inf"),
    ("probe_ms", -1.0, "probe_ms must be a finite number >= 0, got -1.0"),
])
def test_a_cached_verdict_field_out_of_its_bounds_is_named(field, value, message):
    good = {"max_width": 9, "exact": list(range(2, 10)), "worst_diff": 0.0, "probe_ms": 1.0}
    with pytest.raises(ValueError) as e:
        Exactness.from_dict({**good, field: value})
    assert str(e.value) == message


def test_drafting_stops_where_the_probe_stopped_and_says_so_once(caplog):
    """Past the verdict's reach a sequence decodes plainly: a verify there was never compared with
    one-token forwards on this machine. Greedy output is plain output all along."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    dec = SpeculativeDecoder(ToyRuntime(vocab=40), ToyRuntime(vocab=40, noise=0.3), drafter="model",
                             limits=DecoderLimits(exact_reach=20))
    tokens = list(prompt)
    drafted = 0
    with caplog.at_level("WARNING"):
        for step in dec.stream(tokens, SamplingParams(), 30):
            before = len(tokens) - len(step.tokens)
            assert step.drafted == 0 or before + step.drafted <= 20, (before, step.drafted)
            drafted += step.drafted
    assert drafted > 0
    assert tokens[len(prompt):] == naive_greedy(ToyRuntime(vocab=40), prompt, 30)
    told = [r for r in caplog.records if "drafting stops" in r.message]
    assert len(told) == 1 and "--probe-context" in told[0].message
    with pytest.raises(ConfigError, match="exact_reach"):
        DecoderLimits(exact_reach=1)


@pytest.mark.parametrize("body", [WideRounding(vocab=40, from_width=3), KeySplitRounding(vocab=40)],
                         ids=["wide", "key-split"])
def test_the_probe_sees_a_shared_bodys_wide_forwards(body):
    """A shared body keeps rows by token ids: the probe must make it run each wide forward, not
    hand back the reference rows it already holds (which would call every width exact)."""
    from edgespec.runtimes.shared_body import shared_pair
    from tests.test_shared_body import MatrixHead

    target, _ = shared_pair(body, MatrixHead(np.eye(40)), MatrixHead(np.eye(40)[:, :30]))
    expected = probe(body, 8).exact_width
    assert expected < 8 and probe(target, 8).exact_width == expected and target.n_past == 0


@pytest.mark.parametrize("keys", [144, 272, 2048])
def test_the_probe_sees_a_shared_bodys_far_split_points_from_one_extended_prefix(keys):
    """The probe extends one prefix from start to start instead of refilling it; on a shared body
    the rows an earlier start's wide forwards left (kept by token id) must not stand in for the
    next start's one-token references."""
    from edgespec.runtimes.shared_body import shared_pair
    from tests.test_shared_body import MatrixHead

    body = KeySplitRounding(vocab=40, keys=keys)
    target, _ = shared_pair(body, MatrixHead(np.eye(40)), MatrixHead(np.eye(40)[:, :30]))
    assert probe(body, 17, threads=2).exact == ()
    assert probe(target, 17, threads=2).exact == () and target.n_past == 0


def test_the_probe_reads_the_window_of_a_runtime_or_of_a_shared_bodys_runtime():
    from types import SimpleNamespace

    from edgespec.runtimes.exactness import _window
    from edgespec.runtimes.onnxruntime.kv import KVWindow

    plan = SimpleNamespace(window=KVWindow(512, 256, frozenset({0, 1})))
    windowed = SimpleNamespace(kv=SimpleNamespace(plan=plan))
    assert _window(windowed) == (512, 256)
    assert _window(SimpleNamespace(shared=SimpleNamespace(body=windowed))) == (512, 256)
    assert _window(ToyRuntime(vocab=40)) is None
    assert _window(SimpleNamespace(kv=SimpleNamespace(plan=SimpleNamespace(window=None)))) is None


def test_no_exact_width_is_said_plainly():
    verdict = probe(WideRounding(vocab=40, from_width=2), 5)
    assert verdict.exact == () and verdict.exact_width == 1
    assert verdict.describe().startswith("not exact on this machine")
    assert Exactness.from_dict(verdict.to_dict()) == verdict  # the cache round-trips it


def test_the_probe_leaves_the_cache_empty_and_fits_a_small_capacity():
    rt = ToyRuntime(vocab=40)
    rt.kv_capacity = 12
    verdict = probe(rt, 16)
    assert rt.n_past == 0 and verdict.max_width == 10  # capacity 12 leaves room for widths 2..10


def test_a_verdict_is_cached_per_runtime_options_and_retune_probes_again(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    model = tmp_path / "model.bin"
    model.write_bytes(b"weights")
    rt = ToyRuntime(vocab=40)
    kw = dict(backend="toy", version="1", model_files=[model], options={"threads": 2})
    first = probe_cached(rt, 6, **kw)
    calls = rt.calls
    again = probe_cached(rt, 6, **kw)
    assert rt.calls == calls and again.cached and not first.cached and again.exact == first.exact
    probe_cached(rt, 6, **{**kw, "options": {"threads": 1}})  # other kernels: probed anew
    assert rt.calls > calls
    calls = rt.calls
    assert not probe_cached(rt, 6, **kw, retune=True).cached and rt.calls > calls
    model.write_bytes(b"re-exported")  # a new model file: probed anew
    calls = rt.calls
    assert not probe_cached(rt, 6, **kw).cached and rt.calls > calls


def test_the_machine_fingerprint_names_the_cpu_architecture():
    import platform

    assert exactness.machine_fingerprint().startswith(platform.machine())


def test_the_machine_fingerprint_names_the_usable_cpus(monkeypatch):
    """Kernels split their sums by thread count: a verdict from another CPU set is not this one's."""
    import os

    here = exactness.machine_fingerprint()
    assert f"cpus={','.join(map(str, sorted(os.sched_getaffinity(0))))}" in here
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert exactness.machine_fingerprint() != here or sorted(os.sched_getaffinity(0)) == [0]


def _cached_entry(tmp_path, monkeypatch):
    """A toy runtime's verdict cached for real; (runtime, probe kwargs, the cache file)."""
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    model = tmp_path / "model.bin"
    model.write_bytes(b"weights")
    rt = ToyRuntime(vocab=40)
    kw = dict(backend="toy", version="1", model_files=[model], options={"threads": 2})
    probe_cached(rt, 6, **kw)
    (path,) = (tmp_path / "exactness").glob("*.json")
    return rt, kw, path


@pytest.mark.parametrize("poison", [
    pytest.param(lambda d: d["verdict"].update(exact=list(range(2, 34)), max_width=33), id="claims-every-width"),
    pytest.param(lambda d: d["verdict"].update(max_width=1e400), id="max-width-infinite"),
    pytest.param(lambda d: d["verdict"].update(worst_diff="nan"), id="worst-diff-text"),
    pytest.param(lambda d: d["key"].update(machine="another CPU|cpus=0,1,2,3"), id="another-machine"),
    pytest.param(lambda d: d.update(bogus=1), id="unknown-field"),
    pytest.param(lambda d: d.clear(), id="empty"),
])
def test_a_poisoned_or_foreign_verdict_is_probed_again(tmp_path, monkeypatch, caplog, poison):
    import json

    rt, kw, path = _cached_entry(tmp_path, monkeypatch)
    data = json.loads(path.read_text())
    poison(data)
    if "checksum" in data and "verdict" in data:  # also a forger who recomputes the checksum
        data["checksum"] = exactness._checksum({"verdict": data["verdict"], "key": data["key"]})
    path.write_text(json.dumps(data))
    calls = rt.calls
    with caplog.at_level("WARNING"):
        verdict = probe_cached(rt, 6, **kw)
    assert not verdict.cached and rt.calls > calls and verdict.max_width == 6
    assert "discarding the cached exactness verdict" in caplog.text
    assert probe_cached(rt, 6, **kw).cached  # the re-probe replaced the entry


def test_an_edited_verdict_fails_its_checksum(tmp_path, monkeypatch, caplog):
    import json

    rt, kw, path = _cached_entry(tmp_path, monkeypatch)
    data = json.loads(path.read_text())
    data["verdict"]["exact"] = data["verdict"]["exact"][:1]  # a narrower claim, still well formed
    data["verdict"]["exact_width"] = 2
    path.write_text(json.dumps(data))
    with caplog.at_level("WARNING"):
        assert not probe_cached(rt, 6, **kw).cached
    assert "checksum does not match" in caplog.text


def test_a_remembered_mode_the_backend_lacks_is_settled_again(tmp_path, monkeypatch, caplog):
    import json

    from edgespec.runtimes import exact_mode_memory

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    model = tmp_path / "model.onnx"
    model.write_bytes(b"weights")
    recall, remember = exact_mode_memory("onnxruntime", [model], {"threads": 1})
    assert recall() is None
    remember({"pad_rows": True})
    assert recall() == {"pad_rows": True}
    (path,) = (tmp_path / "exactness").glob("*.json")
    for bogus in ({"bogus": 1}, {"pad_rows": [1]}, [1, 2], "x"):
        path.write_text(json.dumps(bogus))
        with caplog.at_level("WARNING"):
            assert recall() is None
    assert "discarding" in caplog.text


# -- the decoder keeps to the exact widths ---------------------------------------------------

def _greedy(decoder: SpeculativeDecoder, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in decoder.stream(tokens, SamplingParams(), n):
        pass
    return tokens[len(prompt):]


def test_verifies_stay_within_the_exact_widths_and_output_equals_plain():
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = naive_greedy(ToyRuntime(vocab=40), prompt, 40)
    # wide forwards flip argmaxes: unbounded, speculative output leaves plain's
    loose = WideRounding(vocab=40, from_width=4, delta=50.0)
    assert _greedy(SpeculativeDecoder(loose, ToyRuntime(vocab=40), drafter="model"), prompt, 40) != plain
    capped = WideRounding(vocab=40, from_width=4, delta=50.0)
    draft = ToyRuntime(vocab=40)
    dec = SpeculativeDecoder(capped, draft, drafter="model", limits=DecoderLimits(verify_width=3))
    assert _greedy(dec, prompt, 40) == plain
    verifies = capped.widths[1:]  # after the prefill
    assert max(verifies) == 3  # the default k=4 would verify 5 at a time


def test_a_draft_on_the_target_body_keeps_its_lookahead_within_the_width():
    from edgespec.decoding.drafters import ModelDrafter
    from edgespec.decoding.policy import FixedK

    draft = WideRounding(vocab=40, from_width=99)  # records widths only
    drafter = ModelDrafter(draft, 40, guess=lambda tokens, drafts: [7, 8, 9, 10], max_width=3)
    drafter.propose([1, 2, 3, 4, 5], 4, FixedK(4), SamplingParams(), np.random.default_rng(0))
    assert max(draft.widths[1:]) <= 3


def test_widths_are_checked():
    with pytest.raises(ConfigError, match="verify_width"):
        DecoderLimits(verify_width=0)
    for name, least in (("context_limit", 2), ("max_draft", 0), ("draft_width", 1), ("max_batch", 2)):
        with pytest.raises(ConfigError, match=f"{name} must be an integer >= {least}"):
            DecoderLimits(**{name: least - 1})
        with pytest.raises(ConfigError, match=name):
            DecoderLimits(**{name: True})  # a bool is no width
        assert getattr(DecoderLimits(**{name: least}), name) == least
    with pytest.raises(ConfigError, match="limits must be a DecoderLimits"):
        SpeculativeDecoder(ToyRuntime(), ToyRuntime(), limits={"verify_width": 3})


# -- prefill chunks at absolute positions -----------------------------------------------------

def test_prefill_chunks_sit_at_absolute_positions_whatever_the_cache_holds():
    """A server reuses the KV prefix an earlier request left: the rest of a prompt is then fed in
    forwards that end at multiples of the chunk size, as on a fresh engine, so the rows the two
    compute past the prefix come from the same forwards."""
    from edgespec.decoding.cache import TrackedCache

    fresh, reused = WideRounding(vocab=40), WideRounding(vocab=40)
    ids = list(range(3, 23))
    TrackedCache(fresh, max_batch=4).feed(ids, n_logits=1)
    cache = TrackedCache(reused, max_batch=4)
    cache.feed(ids[:6], n_logits=1)
    reused.widths.clear()
    cache.feed(ids[6:], n_logits=1)
    assert fresh.widths == [4, 4, 4, 4, 4]
    assert reused.widths == [2, 4, 4, 4]  # 6..8, then whole chunks: the fresh engine's forwards
    verify = TrackedCache(WideRounding(vocab=40), max_batch=4)
    verify.feed(ids[:7], n_logits=1)
    verify.rt.widths.clear()
    verify.feed(ids[7:10], n_logits=3)  # rows whose logits are asked stay in one forward
    assert verify.rt.widths == [3] and verify.ids == ids[:10]


def test_independent_requests_keep_only_whole_chunks_of_an_earlier_request():
    """A server's request re-feeds what an earlier request computed outside whole chunks at
    absolute positions: its forwards are then a fresh decoder's, while a chat reuses it all."""
    from edgespec.decoding import SamplingParams, SpeculativeDecoder
    from edgespec.decoding.limits import DecoderLimits

    def widths(independent: bool, history: bool) -> list[int]:
        rt = WideRounding(vocab=40, from_width=99)  # records the width of every forward
        dec = SpeculativeDecoder(rt, None, limits=DecoderLimits(max_batch=4))
        dec.independent_requests = independent
        if history:
            list(dec.stream(list(range(3, 13)), SamplingParams(), 3, ()))  # 10 prompt ids, 3 decodes
        rt.widths.clear()
        list(dec.stream(list(range(3, 21)), SamplingParams(), 2, ()))  # shares the first 10 ids
        return rt.widths

    fresh = widths(True, history=False)
    assert fresh == [4, 4, 4, 4, 1, 1, 1]  # 17 ids in whole chunks, the last one, then decodes
    assert widths(True, history=True) == [4, 4, 1, 1, 1]  # 0..8 kept: whole chunks the first computed
    assert widths(False, history=True) == [2, 4, 1, 1, 1]  # reuses all 10 shared rows, then aligns
