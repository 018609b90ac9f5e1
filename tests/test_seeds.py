"""A seed repeats a sampled text whatever the draft lengths were: in the API, the CLI and the
server, with a clock that lies so that the cost policy picks other draft lengths run after run.

The draws are keyed by seed and position (edgespec/decoding/draws.py) and every committed token
is the target's own draw at its position, so the text is the one plain decoding gives with the
seed. docs/api.md says what exactly is promised."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from edgespec.bundle import load_bundle
from edgespec.engine.engine import Engine, resolve
from tests.zoo import DISAGREEING

PROMPT = "if new water road snow cat dog cat to sun world and if with"
SAMPLING = dict(temperature=0.9, seed=7, max_tokens=24)
CHAT_SAMPLING = dict(temperature=0.7, top_p=0.95, top_k=40, seed=11, max_tokens=24)


class LyingClock:
    """Seconds that pass at a random pace: each reading adds an exponential draw of mean `mean`."""

    def __init__(self, seed: int, mean: float = 0.004) -> None:
        self.rng, self.mean, self.now = random.Random(seed), mean, 0.0

    def __call__(self) -> float:
        self.now += self.rng.expovariate(1 / self.mean)
        return self.now


def _engine(path, clock=None, **kw) -> Engine:
    """The default drafting (prompt lookup + the draft model, the cost policy) reading `clock`."""
    b = load_bundle(path)
    plan = resolve(b, threads=1, **kw)
    return Engine(b, plan=plan) if clock is None else Engine(b, plan=plan, clock=clock)


@pytest.fixture(scope="module")
def path(zoo):
    return zoo.bundle("qwen2", DISAGREEING)  # a chat template; a draft the target often rejects


@pytest.fixture(scope="module")
def plain_texts(path):
    """What plain decoding writes with each seed: the text every drafted run must repeat."""
    with _engine(path, use_draft=False) as plain:
        return {"api": plain.generate(PROMPT, **SAMPLING), "chat": plain.generate(PROMPT, **CHAT_SAMPLING)}


def test_the_api_repeats_a_seed_whatever_the_clock_says(path, plain_texts):
    lengths = []
    for lie in (1, 2, 3):
        with _engine(path, LyingClock(lie)) as engine:
            assert engine.drafter_name == "both" and engine.policy_name == "cost"
            for name, kw in (("api", SAMPLING), ("chat", CHAT_SAMPLING)):
                assert engine.generate(PROMPT, **kw) == plain_texts[name], (lie, name)
                lengths.append(tuple(engine.last_stats.k_history))
            # and again on the same engine, whose policy has learned from the first runs
            assert engine.generate(PROMPT, **SAMPLING) == plain_texts["api"]
            lengths.append(tuple(engine.last_stats.k_history))
    assert any(sum(k) for k in lengths), "nothing was drafted"
    assert len(set(lengths)) > 2, lengths  # the lies moved the draft lengths


def test_a_chat_repeats_a_seed_turn_by_turn(path):
    turns = ["hello world", "the cat and the dog", "one two three"]
    replies = []
    for lie in (None, 4, 5):
        kw = {"use_draft": False} if lie is None else {}
        with _engine(path, None if lie is None else LyingClock(lie), **kw) as engine:
            session = engine.chat()
            replies.append([''.join(r.text for r in session.send(t, **CHAT_SAMPLING)) for t in turns])
    assert replies[0] == replies[1] == replies[2] and all(replies[0])


_LYING_CLI = """
import random, sys, time
rng, now = random.Random({lie}), [0.0]
def lie():  # installed before edgespec is imported: every clock it reads lies
    now[0] += rng.expovariate(250.0)
    return now[0]
time.perf_counter = lie
from edgespec.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _cli(path, lie: int | None, *extra: str) -> subprocess.CompletedProcess:
    code = _LYING_CLI.format(lie=lie) if lie is not None else "import sys; from edgespec.cli import main; " \
                                                              "sys.exit(main(sys.argv[1:]))"
    args = ["generate", str(path), PROMPT, "--temperature", "0.9", "--seed", "7", "--max-tokens", "24", "--threads",
            "1", "--stats", *extra]
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_the_cli_repeats_a_seed_whatever_the_clock_says(path, plain_texts):
    plain = _cli(path, None, "--no-draft")
    runs = [_cli(path, lie) for lie in (1, 2)]
    assert plain.stdout.rstrip("\n") == plain_texts["api"]
    assert all(r.stdout == plain.stdout for r in runs), [r.stdout for r in runs]
    assert all("acceptance" in r.stderr for r in runs), [r.stderr for r in runs]  # they drafted


def test_the_server_repeats_a_seed_whatever_the_clock_says(path, plain_texts):
    pytest.importorskip("fastapi")
    import httpx

    from edgespec.server import ServerConfig, create_app
    from tests.test_server import running

    lengths = []
    with _engine(path, LyingClock(6)) as engine, running(create_app(engine, ServerConfig(model_id="m"))) as url:
        for _ in range(3):  # the clock keeps lying, and the policy keeps learning from it
            body = {"model": "m", "prompt": PROMPT, **SAMPLING}
            got = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
            assert got["choices"][0]["text"] == plain_texts["api"], json.dumps(got)
            lengths.append(tuple(engine.last_stats.k_history))
            chat = {"model": "m", "messages": [{"role": "user", "content": "hello world"}], **CHAT_SAMPLING}
            first = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120).json()
            again = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120).json()
            assert first["choices"][0]["message"] == again["choices"][0]["message"]
    assert any(sum(k) for k in lengths) and len(set(lengths)) > 1, lengths
