"""The exact oracle (tests/oracle.py) through the Engine on every backend of the fast tier (tiny
random-weight models on onnxruntime, OpenVINO and llama.cpp), the draft on the target's body,
the overlapped decoder and draft trees on onnxruntime, and a conversation continued over several
turns. Each test prints its power statement and its time.

The exact law is enumerated from the target's own rows as plain decoding computes them (the
engine's target runtime, before the runs): the engine then drafts only at the verify widths the
probe found exact here, so a correct path is plain decoding bit for bit and check B cannot raise
a false alarm. One thread per model: the runs are many and short."""
from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

from edgespec.decoding import FixedK, SamplingParams, SpeculativeDecoder
from edgespec.decoding.recycling import RecyclingDrafter
from tests import oracle
from tests.tiny import PROMPTS
from tests.zoo import AGREEING, DISAGREEING

PARAMS = SamplingParams(temperature=1.0, top_k=3)
FORMATS = {"onnxruntime": ("onnx",), "openvino": ("openvino",), "llamacpp": ("gguf",)}


def _load(zoo, backend: str, draft: str | None = AGREEING, export: dict | None = None, model: str = "gemma3", **kw):
    pytest.importorskip({"onnxruntime": "onnxruntime", "openvino": "openvino", "llamacpp": "llama_cpp"}[backend])
    from edgespec.engine.engine import load

    return load(zoo.bundle(model, draft, formats=FORMATS[backend], **(export or {})), backend=backend,
                threads=1, **kw)


class Checked:
    """Checks A and B on one engine and prompt: the exact law from the engine's own target rows."""

    def __init__(self, name: str, engine, ids: list[int] | None = None) -> None:
        self.name, self.engine = name, engine
        self.ids = engine.tokenizer.encode(PROMPTS[1]) if ids is None else ids
        self.rows = oracle.PlainRows(engine.target, self.ids, engine.opened.limits.max_batch)
        t0, cpu = time.perf_counter(), time.process_time()
        self.verdict = oracle.check_reference(name, self.rows, len(self.ids), PARAMS)
        self.rows.release()  # every row the reference needs is memoised: the engine has its target back
        print(f"\n[check A, {name}: {time.perf_counter() - t0:.1f} s, {time.process_time() - cpu:.1f} s of CPU]")
        stops = self.engine.tokenizer.stop_ids
        assert not any(t in stops for seq in oracle.exact_law(self.rows, PARAMS).sequences for t in seq), \
            "a stop token in the law: the engine would end early"

    def path(self, path: str, run, depth: int = oracle.LENGTH) -> None:
        t0, cpu = time.perf_counter(), time.process_time()
        oracle.check_path(path, run, self.rows, len(self.ids), PARAMS, depth)
        print(f"\n{path}: {self.verdict.statement()} [check B: {oracle.N_SEEDS} seeds x {depth} tokens, "
              f"{time.perf_counter() - t0:.1f} s, {time.process_time() - cpu:.1f} s of CPU]")

    def through_the_api(self, drafted: list[int], depth: int = oracle.LENGTH):
        """run(seed) through Engine.stream, the API users call."""
        def run(seed: int) -> list[int]:
            out = [t for r in self.engine.stream(self.ids, max_tokens=depth, temperature=PARAMS.temperature,
                                                 top_k=PARAMS.top_k, seed=seed) for t in r.token_ids]
            drafted.append(self.engine.last_stats.drafted)
            return out
        return run

    def through(self, decoder, drafted: list[int], depth: int):
        """run(seed) through a decoder on the engine's runtimes."""
        def run(seed: int) -> list[int]:
            tokens = list(self.ids)
            drafted.append(sum(s.drafted for s in decoder.stream(tokens, _seeded(seed), depth)))
            return tokens[len(self.ids):]
        return run


def _seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=PARAMS.temperature, top_k=PARAMS.top_k, seed=seed)


@pytest.mark.parametrize("backend", list(FORMATS))
def test_every_backend_with_the_default_drafting(zoo, backend):
    """Drafter auto (prompt lookup + the draft model) with three drafts a step, through the API."""
    with _load(zoo, backend, policy="fixed", k=3) as engine:
        assert engine.drafter_name == "both" and engine.opened.limits.verify_width >= 4, engine.describe()
        checked, drafted = Checked(backend, engine), []
        checked.path(f"{backend}, both, k=3", checked.through_the_api(drafted))
    assert sum(drafted) > oracle.N_SEEDS


def test_the_draft_on_the_targets_body(zoo):
    """OpenVINO's draft on the target's body (a self-draft: one body, two heads)."""
    with _load(zoo, "openvino", draft_body="shared", policy="fixed", k=3) as engine:
        assert engine.shared_body
        checked, drafted = Checked("openvino, shared body", engine), []
        checked.path("openvino, draft on the target's body, both, k=3", checked.through_the_api(drafted))
    assert sum(drafted) > oracle.N_SEEDS


def test_the_overlapped_decoder_and_trees_on_onnxruntime(zoo):
    with _load(zoo, "onnxruntime", overlap=True, draft_body="own", policy="fixed", k=2) as engine:
        assert engine.decoder.blocker is None
        checked, drafted = Checked("onnxruntime", engine), []
        checked.path("onnxruntime, overlapped, both, k=2", checked.through(engine.decoder, drafted, 10), 10)
        stats = engine.decoder.overlap
        assert sum(drafted) > 0 and stats.overlapped > 0 and stats.steps_ahead > 0, stats
    with _load(zoo, "onnxruntime", None, {"tree": True}, drafter="recycle", k=3) as engine:
        trees = SpeculativeDecoder(engine.target, drafter=RecyclingDrafter(engine.target.vocab_size, shape=(2, 1)),
                                   policy=FixedK(3))
        checked, drafted = Checked("onnxruntime, tree bundle", engine), []
        checked.path("onnxruntime, recycled trees (2, 1)", checked.through(trees, drafted, 8), 8)
        assert engine.target.capabilities.trees and sum(drafted) > oracle.N_SEEDS


@contextlib.contextmanager
def _decoding_with(engine, decoder):
    """The engine decoding with `decoder` (a variant on its runtimes), its caches emptied before and after."""
    own = engine.decoder
    for rt in (engine.target, engine.draft):
        if rt is not None:
            rt.reset()
    engine.decoder = decoder
    try:
        yield
    finally:
        engine.decoder = own
        for rt in (engine.target, engine.draft):
            if rt is not None:
                rt.reset()


TURNS = ("hello world code", "the cat and the dog", "one two three")


def _conversation(session, seed: int) -> list[list[int]]:
    """The first tokens of each reply of a conversation of three turns, sampled with `seed`."""
    session.reset()
    return [[t for r in session.send(text, max_tokens=oracle.LENGTH, temperature=PARAMS.temperature,
                                      top_k=PARAMS.top_k, seed=seed) for t in r.token_ids] for text in TURNS]


def test_a_conversation_continued_over_several_turns(zoo):
    """ChatSession on onnxruntime: each turn reuses the caches the last left (a prompt that grows
    by the reply and the next message). The first turn's reply against the oracle (its prompt is
    fixed); every turn's against plain decoding of the same conversation with the same seed, the
    same engine: turn by turn identical, so each later turn too follows the target's law given
    the conversation before it."""
    # a model with a chat template: its end of turn is a stop id (the law holds none), never a
    # stop string cutting a reply's text; a draft the target often rejects (caches roll back)
    with _load(zoo, "onnxruntime", DISAGREEING, model="qwen2", policy="fixed", k=3) as engine:
        session = engine.chat()
        assert session.format.transcript is None
        first = session.format.prompt(engine.tokenizer, [{"role": "user", "content": TURNS[0]}]).tokens
        checked = Checked("onnxruntime, chat turn 1", engine, first)
        plain = engine.variant(plain=True)
        replies: dict[int, list[list[int]]] = {}
        t0, cpu = time.perf_counter(), time.process_time()
        for seed in range(oracle.N_SEEDS):
            with _decoding_with(engine, plain):
                replies[seed] = _conversation(session, seed)
        print(f"\n[plain conversations: {time.perf_counter() - t0:.1f} s, {time.process_time() - cpu:.1f} s of CPU]")
        drafted = []

        def run(seed: int) -> list[int]:
            got = _conversation(session, seed)
            drafted.append(sum(s.drafted for s in session.turn_stats))
            assert got == replies[seed], f"seed {seed}: {got}, plain decoding of the conversation {replies[seed]}"
            return got[0]

        checked.path("onnxruntime, a conversation of three turns, both, k=3", run)
    assert sum(drafted) > oracle.N_SEEDS and all(len(r) == oracle.LENGTH for rs in replies.values() for r in rs[:1])
    assert np.mean([len(r) for rs in replies.values() for r in rs]) > oracle.LENGTH - 1  # replies rarely end early
