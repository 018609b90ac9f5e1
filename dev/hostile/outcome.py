"""What a hostile case came to, as one of a few classes (pure functions, no I/O).

The rule the classes test: bad input gets one line (CLI: a non-zero exit and one error line on
stderr; Python API: an `edgespec.errors` type with a one-line message) or an OpenAI-shaped 4xx
(server); a good input succeeds. A traceback, a hang, a file left behind or data lost is a
failure whatever the case expected.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["CLASSES", "FAILURES", "Outcome", "Case", "case", "from_process", "from_exception", "from_http"]

ONE_LINE, HTTP_4XX, HTTP_REFUSED, SUCCESS = "one-line error", "4xx", "5xx error reply", "success"
TRACEBACK, HANG, LEFT_BEHIND, DATA_LOST = "traceback", "hang", "files left behind", "data lost"
CLASSES = (ONE_LINE, HTTP_4XX, HTTP_REFUSED, SUCCESS, TRACEBACK, HANG, LEFT_BEHIND, DATA_LOST)
FAILURES = frozenset({TRACEBACK, HANG, LEFT_BEHIND, DATA_LOST})


@dataclass(frozen=True)
class Outcome:
    cls: str
    detail: str  # the error line, the status and code, or what went wrong


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ": error:" in line]


def from_process(returncode: int | None, stderr: str, ok_codes: tuple[int, ...] = (0,)) -> Outcome:
    """A CLI run: `returncode` None when it was killed at its time limit."""
    if returncode is None:
        return Outcome(HANG, "killed at the time limit")
    if "Traceback (most recent call last)" in stderr:
        return Outcome(TRACEBACK, stderr.strip().splitlines()[-1][:200])
    if returncode in ok_codes:
        return Outcome(SUCCESS, f"exit {returncode}")
    errors = _error_lines(stderr)
    if len(errors) == 1:
        return Outcome(ONE_LINE, f"exit {returncode}: {errors[0][:200]}")
    # a non-zero exit without exactly one error line: the user cannot tell what went wrong
    tail = stderr.strip().splitlines()[-1][:200] if stderr.strip() else "(no message)"
    return Outcome(TRACEBACK, f"exit {returncode} with {len(errors)} error lines: {tail}")


def from_exception(e: BaseException | None, edgespec_error: type) -> Outcome:
    """A Python API call: None when it returned."""
    if e is None:
        return Outcome(SUCCESS, "returned")
    msg = str(e)
    if isinstance(e, edgespec_error) and msg and "\n" not in msg:
        return Outcome(ONE_LINE, f"{type(e).__name__}: {msg[:200]}")
    return Outcome(TRACEBACK, f"{type(e).__name__}: {msg.splitlines()[0][:200] if msg else ''}")


def from_http(status: int | None, body: bytes, error: str | None = None) -> Outcome:
    """A server reply (`status` None: no reply, `error` says why)."""
    if status is None:
        return Outcome(TRACEBACK, f"no reply: {error}")
    if status < 400:
        return Outcome(SUCCESS, str(status))
    try:
        err = json.loads(body)["error"]
        shaped = set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"]
    except (ValueError, KeyError, TypeError):
        shaped = False
    if not shaped:
        return Outcome(TRACEBACK, f"{status} without an OpenAI-shaped error: {body[:120]!r}")
    return Outcome(HTTP_4XX if status < 500 else HTTP_REFUSED, f"{status} {err['code']}")


@dataclass(frozen=True)
class Case:
    """One hostile input: `run` (given the fixtures) returns its Outcome; `expect`: the classes
    the published behaviour allows (failures are never allowed)."""

    group: str
    name: str
    expect: frozenset
    run: object  # Callable[[Fixtures], Outcome]
    needle: str | None = None  # text an error must hold: it names the bad input, not something else


def case(group: str, name: str, expect, run, needle: str | None = None) -> Case:
    return Case(group, name, frozenset([expect] if isinstance(expect, str) else expect), run, needle)
