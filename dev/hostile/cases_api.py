"""Hostile inputs through the Python API (in this process, each call under a time limit) and the
engine's caches (poisoned between two CLI runs)."""
from __future__ import annotations

import json
import threading
from pathlib import Path

from fixtures import Fixtures
from outcome import DATA_LOST, HANG, ONE_LINE, SUCCESS, Outcome, case, from_exception

__all__ = ["api_cases", "cache_cases", "TRUSTED"]

TRUSTED = "poisoned cache trusted"
CONTEXT = 64  # the engine's max_context here, so a long prompt is quickly too long


def call(fn, timeout_s: float) -> Outcome:
    """`fn()` in a thread under a time limit: its Outcome (a hung thread is left behind, daemon)."""
    from edgespec.errors import EdgespecError

    box: dict = {}

    def target() -> None:
        try:
            fn()
            box["e"] = None
        except BaseException as e:  # noqa: BLE001 - classifying whatever a caller would see is the point
            box["e"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return Outcome(HANG, f"still running after {timeout_s:g} s")
    return from_exception(box["e"], EdgespecError)


class _Engine:
    """One engine for the generate and chat cases, opened on first use."""

    def __init__(self) -> None:
        self.engine = None

    def __call__(self, fx: Fixtures):
        if self.engine is None:
            from edgespec.engine.engine import load

            self.engine = load(fx.bundle, k=3, drafter="model", max_context=CONTEXT)
        return self.engine


_ENGINE = _Engine()


def _generate(prompt, **kw):
    def run(fx: Fixtures) -> Outcome:
        e = _ENGINE(fx)
        out = call(lambda: e.generate(prompt, **{"max_tokens": 4, "wait": True, **kw}), fx.timeout_s)
        after = call(lambda: e.generate("the cat", max_tokens=2, wait=True), fx.timeout_s)
        if after.cls != SUCCESS:  # the engine must stay usable after a caller's mistake
            return Outcome(after.cls, f"the next generate failed: {after.detail}")
        return out
    return run


def _send(message):
    def run(fx: Fixtures) -> Outcome:
        chat = _ENGINE(fx).chat()
        for _ in chat.send("Hello", max_tokens=2):
            pass
        before = list(chat.messages)
        out = call(lambda: list(chat.send(message, max_tokens=2)), fx.timeout_s)
        if list(chat.messages) != before:
            return Outcome(DATA_LOST, f"the chat history changed ({out.detail})")
        return out
    return run


def _load(**kw):
    def run(fx: Fixtures) -> Outcome:
        from edgespec.engine.engine import load

        def opened() -> None:
            with load(kw.pop("bundle", fx.bundle), **kw) as e:
                e.generate("the cat", max_tokens=2, wait=True)
        return call(opened, fx.timeout_s)
    return run


def api_cases() -> list:
    long_prompt = "the cat sat on the mat " * 40
    gen = [
        ("generate(None)", (None,), {}), ("generate(123)", (123,), {}), ('generate("")', ("",), {}),
        ("a lone surrogate in the prompt", ("bad \ud800 surrogate",), {}),
        ('temperature="0.5"', ("the cat",), {"temperature": "0.5"}), ("top_p=None", ("the cat",), {"top_p": None}),
        ('min_p="0"', ("the cat",), {"min_p": "0"}), ("stop=[None]", ("the cat",), {"stop": [None]}),
        ('stop=[""]', ("the cat",), {"stop": [""]}), ("stop=5", ("the cat",), {"stop": 5}),
        ("token id -1", ([-1],), {}), ("token id past the vocabulary", ([10 ** 6],), {}),
        ("token id True", ([True],), {}), ("token id 5.0", ([5.0],), {}),
        ("a prompt longer than the context", (long_prompt,), {}),
        ("max_tokens=-1", ("the cat",), {"max_tokens": -1}), ('max_tokens="2"', ("the cat",), {"max_tokens": "2"}),
    ]
    cases = [case("Python API", n, ONE_LINE, _generate(*a, **kw)) for n, a, kw in gen]
    cases += [case("Python API", f"chat().send({n})", ONE_LINE, _send(m))
              for n, m in (("123", 123), ("None", None), ("a lone surrogate", "hi \udcff"))]
    cases += [case("Python API", f"load({k}={v!r:.20})", expect, _load(**{k: v})) for k, v, expect in (
        ("memory_budget", "nan", ONE_LINE), ("memory_budget", "inf", ONE_LINE), ("memory_budget", "9" * 400, ONE_LINE),
        ("memory_budget", "1.5 parsecs", ONE_LINE), ("threads", 64, SUCCESS), ("threads", -1, ONE_LINE),
        ("max_context", 100000, ONE_LINE), ("k", -1, ONE_LINE), ("bundle", "/nonexistent/bundle", ONE_LINE))]
    return cases


# -- caches ------------------------------------------------------------------------------------

def _entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*.json") if p.is_file() and "bundles" not in p.parts)


def _poisons(data) -> dict[str, str]:
    """Hostile versions of one cache entry's JSON text."""
    text = json.dumps(data)

    def numbers(d, value):
        if isinstance(d, dict):
            return {k: numbers(v, value) for k, v in d.items()}
        if isinstance(d, list):
            return [numbers(v, value) for v in d]
        return value if isinstance(d, (int, float)) and not isinstance(d, bool) else d

    out = {"not JSON": "{half", "empty object": "{}", "a list": "[1, 2]", "bogus field": "{\"bogus\": 1}",
           "numbers 1e400": json.dumps(numbers(data, 1.5)).replace("1.5", "1e400"),
           "numbers 0": json.dumps(numbers(data, 0)), "numbers negative": json.dumps(numbers(data, -3)),
           "numbers as text": json.dumps(numbers(data, "7"))}
    if isinstance(data, dict):
        out["unknown key added"] = json.dumps({**data, "surprise": True})
    if isinstance(data, dict) and isinstance(data.get("verdict"), dict) and isinstance(data.get("key"), dict):
        out.update(_verdict_poisons(data))
    return {k: v for k, v in out.items() if v != text}


def _verdict_poisons(data: dict) -> dict[str, str]:
    """A probe verdict edited to claim every width exact, and one copied from another machine
    (its checksum made whole again, as a copied file's is)."""
    from edgespec.runtimes.exactness import _checksum

    wide = json.loads(json.dumps(data))
    wide["verdict"].update(max_width=33, exact=list(range(2, 34)), exact_width=33)
    foreign = {k: v for k, v in json.loads(json.dumps(data)).items() if k != "checksum"}
    foreign["key"]["machine"] = "aarch64|Linux||Cortex-A76|fp asimd|cpus=0,1,2,3"
    return {"every width 2..33 claimed exact": json.dumps(wide),
            "copied from another machine": json.dumps({**foreign, "checksum": _checksum(foreign)})}


def cache_cases(fx: Fixtures) -> list:
    """A first run fills the cache; each entry it wrote is then poisoned in turn and a run must
    succeed and write the entry again (discarded and measured again, never believed)."""
    args = ("generate", str(fx.bundle), "the cat", "--max-tokens", "4")
    cache = fx.work / "cache-poison"  # its own: only the entries this command reads
    env = fx.env(EDGESPEC_CACHE=str(cache))
    first = fx.cli(*args, env=env)
    if first.cls != SUCCESS:
        return [case("caches", "the first run that fills the cache", SUCCESS, lambda _: first)]
    cases = []
    for entry in _entries(cache):
        good = entry.read_text()
        for name, poison in _poisons(json.loads(good)).items():
            def run(fx, entry=entry, poison=poison, good=good):
                entry.write_text(poison)
                out = fx.cli(*args, env=env)
                now = entry.read_text() if entry.exists() else None
                entry.write_text(good)
                if out.cls == SUCCESS and now == poison:
                    return Outcome(TRUSTED, "the poisoned entry was left as it was (believed, not measured again)")
                return out
            cases.append(case("caches", f"{entry.parent.name}/{entry.stem[:8]}: {name}", SUCCESS, run))
    return cases
