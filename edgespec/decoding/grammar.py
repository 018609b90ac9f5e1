"""Structured output: what a reply must match, compiled for a tokenizer, followed token by token.

  ResponseFormat   what the caller asks for (a JSON schema, any JSON object, a regular expression,
                   a GBNF or Lark grammar): one frozen value, validated when it is built
  GrammarCompiler  an engine's compiler: the grammar engine's view of the tokenizer (built once, on
                   first use) and the formats compiled for it (cached), within a size and time limit
  Grammar          one compiled format; `constraint()` starts following it
  Constraint       one generation's grammar state: which tokens may follow the committed ones (and
                   any drafts after them), and which the grammar forces

The grammar engine is llguidance (docs/dependencies.md says why it and not xgrammar): it computes
the set of allowed tokens from the grammar and the tokenizer's token bytes, and forced text.

How decoding uses it (docs/structured-output.md): the constrained distribution at a position is
the target's, masked by the grammar and renormalised. Where the mask allows a single token (text
the grammar forces: llguidance allows only its canonical tokenization) that token has probability
one, so it is committed without a target forward and fed with the next verify. Drafts are drawn
from masked draft rows and every verified row is masked, so the speculative loop keeps the
constrained distribution exactly, as it keeps the unconstrained one.
"""
from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from edgespec.errors import ConfigError, GrammarError

if TYPE_CHECKING:
    from edgespec.decoding.draft import Draft
    from edgespec.decoding.tree import DraftTree

__all__ = ["FORMAT_KINDS", "MAX_SPEC_BYTES", "Constraint", "Grammar", "GrammarCompiler", "GrammarError",
           "GrammarLimits", "MaskedRows", "ResponseFormat", "response_format"]

logger = logging.getLogger(__name__)

FORMAT_KINDS = ("json_schema", "json_object", "regex", "grammar")
# the largest schema, expression or grammar text accepted: far more than any real schema, small
# enough that the text alone cannot make compiling it slow
MAX_SPEC_BYTES = 256 << 10
# JSON without free whitespace, with the separators most models have seen (OpenAI's, Python's
# json.dumps): a small model given free whitespace may write spaces or newlines without end, and
# fixed separators are text the grammar forces. A schema's own "x-guidance" object overrides these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHED = 32  # compiled formats an engine keeps (a server sees a few schemas again and again)


def _first_line(text: object, limit: int = 300) -> str:
    """A multi-line engine message as one line: its lines joined, without the caret pointers and
    the listed source lines that point at the error."""
    lines = [line.strip() for line in str(text).strip().splitlines()]
    kept = [line for line in lines if line and not re.fullmatch(r"[\^~\s|]+|\d+\s*\|.*", line)]
    joined = " ".join(kept) or "unknown error"
    return joined if len(joined) <= limit else joined[:limit - 3] + "..."


@dataclass(frozen=True)
class ResponseFormat:
    """What a reply must match; frozen, and validated when built.

    kind: "json_schema" (spec: the schema as JSON text), "json_object" (any JSON object; no spec),
    "regex" (spec: a regular expression the whole reply matches, Rust `regex` syntax) or "grammar"
    (spec: a llama.cpp GBNF grammar, or llguidance's Lark syntax). name: how messages call it (an
    OpenAI json_schema's name). Build it with the class methods: ResponseFormat.json_schema(schema),
    .json_object(), .regex(pattern), .grammar(text), .from_openai(response_format)."""

    kind: str
    spec: str = ""
    name: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in FORMAT_KINDS:
            raise ConfigError(f"response format kind must be one of {', '.join(FORMAT_KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ConfigError(f"the {self.kind} must be text, got {type(self.spec).__name__}")
        if len(self.spec.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
            raise GrammarError(f"the {self.kind.replace('_', ' ')} is larger than {MAX_SPEC_BYTES >> 10} KiB")
        if self.kind == "json_object" and self.spec:
            raise ConfigError("a json_object response format takes no schema; use json_schema for one")
        if self.kind in ("regex", "grammar") and not self.spec.strip():
            raise ConfigError(f"the {self.kind} is empty")
        if self.kind == "json_schema":
            _check_schema(self.spec)
        if self.name is not None and not isinstance(self.name, str):
            raise ConfigError(f"the response format's name must be text, got {type(self.name).__name__}")

    @classmethod
    def json_schema(cls, schema: dict | bool | str, *, name: str | None = None) -> ResponseFormat:
        """A reply that is JSON valid against `schema` (a dict, or its JSON text)."""
        if not isinstance(schema, str):
            try:
                schema = json.dumps(schema, ensure_ascii=False)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"the JSON schema is not JSON: {e}") from None
        return cls("json_schema", schema, name)

    @classmethod
    def json_object(cls) -> ResponseFormat:
        """A reply that is any JSON object (OpenAI's "json_object")."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> ResponseFormat:
        """A reply that the regular expression matches whole."""
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, text: str, *, name: str | None = None) -> ResponseFormat:
        """A reply in the language of a GBNF grammar (llama.cpp's; its `root` rule) or a Lark one
        (llguidance's syntax; its `start` rule)."""
        return cls("grammar", text, name)

    @classmethod
    def from_openai(cls, body: Any) -> ResponseFormat | None:
        """OpenAI's `response_format` object: {"type": "text"} (None: no format), {"type":
        "json_object"} or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}."""
        if not isinstance(body, dict):
            raise ConfigError(f"response_format must be an object, got {type(body).__name__}")
        kind = body.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind != "json_schema":
            raise ConfigError(f"response_format type must be text, json_object or json_schema, got {kind!r}")
        spec = body.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ConfigError("a json_schema response_format needs json_schema.schema")
        return cls.json_schema(spec["schema"], name=spec.get("name"))

    def describe(self) -> str:
        """The format as messages name it, e.g. "the JSON schema 'person'"."""
        if self.kind == "grammar":
            return f"the {self.name} grammar" if self.name else "the grammar"
        named = f" '{self.name}'" if self.name else ""
        return {"json_schema": f"the JSON schema{named}", "json_object": "a JSON object",
                "regex": "the regular expression"}[self.kind]

    def llguidance_grammar(self) -> str:
        """The format as llguidance's grammar text (a GBNF grammar converted to Lark first)."""
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(self.spec)
        except Exception as e:  # noqa: BLE001 - the converter raises several kinds on bad input
            raise GrammarError(f"{self.describe()} is not valid GBNF or Lark: {_first_line(e)}") from None
        return LLMatcher.grammar_from_lark(lark)


def _check_schema(text: str) -> None:
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ConfigError(f"a JSON schema is an object (or true/false), got {type(schema).__name__}")


def response_format(value: ResponseFormat | dict | None) -> ResponseFormat | None:
    """`value` as a ResponseFormat: one already, None, or OpenAI's response_format object."""
    if value is None or isinstance(value, ResponseFormat):
        return value
    if isinstance(value, dict):
        return ResponseFormat.from_openai(value)
    raise ConfigError(f"response_format must be a ResponseFormat or OpenAI's response_format object, "
                      f"got {type(value).__name__}")


# ---------------------------------------------------------------- compiling


@dataclass(frozen=True)
class GrammarLimits:
    """How much a grammar may cost: compile time (wall clock) and llguidance's own bounds on work
    and size (its ParserLimits; each unit of fuel is a few tens of nanoseconds)."""

    compile_timeout_s: float = 5.0
    max_grammar_size: int = 500_000  # symbols in the grammar's productions
    initial_lexer_fuel: int = 2_000_000  # building the lexer: tens of milliseconds, bounded
    step_lexer_fuel: int = 400_000  # one token's mask: bounded so no step stalls the stream
    max_lexer_states: int = 250_000  # lexer states built while decoding (1-2 kB each)

    def parser_limits(self):
        from llguidance import LLParserLimits

        return LLParserLimits(max_grammar_size=self.max_grammar_size, initial_lexer_fuel=self.initial_lexer_fuel,
                              step_lexer_fuel=self.step_lexer_fuel, max_lexer_states=self.max_lexer_states,
                              verbose_errors=False)


def _bounded(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """fn() on a thread of its own, waited for at most `timeout_s`. llguidance's fuel bounds the
    work itself; this bounds the wall clock a caller waits (a busy machine), as a one-line error."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e

    worker = threading.Thread(target=run, name="edgespec-grammar", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise GrammarError(f"{what} did not compile within {timeout_s:g} s; simplify it")
    if "error" in box:
        raise box["error"]
    return box["value"]


class GrammarCompiler:
    """Compiles ResponseFormats for one tokenizer. `tokenizer_json` gives the tokenizer's
    tokenizer.json text (asked once, on the first compile: building llguidance's tokenizer from a
    large vocabulary takes a second); `vocab_size` is the target's logits width; `stop_ids` the
    tokens that end a reply, which the grammar allows wherever the reply may end."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, stop_ids: Sequence[int],
                 limits: GrammarLimits = GrammarLimits()) -> None:
        self._tokenizer_json, self.vocab_size = tokenizer_json, vocab_size
        self.stop_ids = tuple(sorted(int(i) for i in stop_ids))
        self.limits = limits
        self._lock = threading.Lock()
        self._cache: OrderedDict[ResponseFormat, Grammar] = OrderedDict()

    @cached_property
    def tokenizer(self):
        from llguidance import LLTokenizer

        tok = LLTokenizer(self._tokenizer_json(), eos_token=list(self.stop_ids) or None)
        logger.debug("grammar tokenizer: %d tokens, canonical %s", tok.vocab_size, tok.is_canonical)
        return tok

    def compile(self, fmt: ResponseFormat) -> Grammar:
        """The compiled `fmt` (cached); a GrammarError names what is wrong with it."""
        if not isinstance(fmt, ResponseFormat):
            raise ConfigError(f"compile() takes a ResponseFormat, got {type(fmt).__name__}")
        with self._lock:
            hit = self._cache.get(fmt)
            if hit is not None:
                self._cache.move_to_end(fmt)
                return hit
            tokenizer = self.tokenizer  # not the format's cost: built before its clock starts
        grammar = _bounded(lambda: self._build(fmt, tokenizer), self.limits.compile_timeout_s, fmt.describe())
        with self._lock:
            self._cache[fmt] = grammar
            while len(self._cache) > _CACHED:
                self._cache.popitem(last=False)
        return grammar

    def _build(self, fmt: ResponseFormat, tokenizer) -> Grammar:
        from llguidance import LLMatcher

        text = fmt.llguidance_grammar()
        matcher = LLMatcher(tokenizer, text, log_level=0, limits=self.limits.parser_limits())
        if matcher.is_error():
            raise GrammarError(f"{fmt.describe()} does not compile: {_first_line(matcher.get_error())}")
        grammar = Grammar(fmt, matcher, self.vocab_size, self.stop_ids)
        grammar.constraint().allowed()  # a grammar that admits no reply at all fails here, not mid-stream
        return grammar


class Grammar:
    """One compiled ResponseFormat. Its matcher is never advanced: each generation follows a copy."""

    def __init__(self, fmt: ResponseFormat, matcher, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
        self.format, self._matcher, self.vocab_size, self.stop_ids = fmt, matcher, vocab_size, stop_ids
        self._lock = threading.Lock()  # copies may be made from the server's threads at once

    def constraint(self) -> Constraint:
        """A fresh state of the grammar, before any token of the reply."""
        with self._lock:
            matcher = self._matcher.deep_copy()
        return Constraint(matcher, self.format, self.vocab_size, self.stop_ids)


# ---------------------------------------------------------------- following


class Constraint:
    """One generation's grammar state (one thread). Positions are named by a path: the tokens
    after the committed ones (drafts under verification, a draft being drawn); the matcher moves
    along paths by rolling back to their common prefix, and each path's mask is kept until the
    path changes, so the drafter and the verify share what they compute.

    A stop id ends a path: it is checked against the mask but never fed to the matcher
    (llguidance's token checks refuse an end token where the grammar can go no further), and
    nothing after it is constrained (the decoder cuts a reply at its stop id)."""

    def __init__(self, matcher, fmt: ResponseFormat, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
        self._m, self.format, self.vocab_size = matcher, fmt, vocab_size
        self.stop_ids = frozenset(stop_ids)
        self._stops = np.asarray(sorted(stop_ids), dtype=np.int64)
        self._path: list[int] = []  # past the committed tokens: consumed by the matcher, then maybe a stop id
        self._masks: list[np.ndarray | None] = [None]  # [d]: allowed after path[:d], once computed
        self._ended = False  # _path ends with a stop id (not fed to the matcher)
        self.finished = False  # the committed tokens end with a stop id
        self.forced = 0  # tokens committed without a target forward so far

    # -- moving along paths ---------------------------------------------------------------
    def _seek(self, path: Sequence[int]) -> int:
        """Put the matcher after the committed tokens and the longest allowed prefix of `path`;
        returns that prefix's length. Never feeds the matcher a token the grammar refuses (that
        would leave it in its error state for good)."""
        common = 0
        for a, b in zip(self._path, path):
            if a != b:
                break
            common += 1
        self._back_to(common)
        rest = [int(t) for t in path[common:]]
        if not rest or self._ended or self.finished:
            return common
        end = next((i for i, t in enumerate(rest) if t in self.stop_ids), len(rest))
        n = self._m.validate_tokens(rest[:end]) if end else 0
        if n and not self._m.consume_tokens(rest[:n]):
            raise GrammarError(f"the grammar engine failed: {_first_line(self._m.get_error())}")
        self._path.extend(rest[:n])
        self._masks.extend([None] * n)
        if n == end < len(rest) and self._here()[rest[n]]:
            self._path.append(rest[n])
            self._masks.append(None)
            self._ended = True
            n += 1
        return common + n

    def _back_to(self, depth: int) -> None:
        """Roll the matcher back to `depth` tokens of the current path."""
        if depth >= len(self._path):
            return
        back = len(self._path) - depth - self._ended  # a stop id was never fed
        if back:
            self._m.rollback(back)
        self._ended = False
        del self._path[depth:]
        del self._masks[depth + 1:]

    def _here(self) -> np.ndarray:
        """The mask after the whole current path (which does not end with a stop id)."""
        mask = self._masks[len(self._path)]
        if mask is None:
            mask = self._masks[len(self._path)] = self._compute_mask()
        return mask

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, after the committed ones, the grammar allows in a row."""
        return self._seek(tokens)

    def allowed(self, path: Sequence[int] = ()) -> np.ndarray | None:
        """Bool (vocab,): the tokens allowed after the committed ones and `path`; None where the
        grammar refuses `path` itself, or `path` ends with a stop id (nothing follows one)."""
        if self._seek(path) < len(path) or self._ended or self.finished:
            return None
        return self._here()

    def _compute_mask(self) -> np.ndarray:
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        if self._m.is_error():  # a step past its fuel (a grammar too complex to follow) lands here
            raise GrammarError(f"{self.format.describe()} cannot be followed: {_first_line(self._m.get_error())}")
        mask = np.unpackbits(bits, bitorder="little").view(bool)
        if len(mask) >= self.vocab_size:
            mask = mask[:self.vocab_size]
        else:  # logits wider than the tokenizer: padding rows are never allowed
            mask = np.concatenate([mask, np.zeros(self.vocab_size - len(mask), dtype=bool)])
        if not mask.any():
            raise GrammarError(f"{self.format.describe()} admits no token here (it cannot be completed)")
        return mask

    def commit(self, tokens: Sequence[int]) -> None:
        """The decoder committed `tokens` (each allowed in turn): they become the base of paths."""
        if self._seek(tokens) < len(tokens):
            raise GrammarError(f"a committed token breaks {self.format.describe()}")
        n = len(tokens)
        self.finished = self.finished or self._ended
        self._ended = False
        self._path = self._path[n:]  # empty: _seek left the matcher exactly after `tokens`
        self._masks = self._masks[n:] if not self.finished else [None]

    @property
    def accepting(self) -> bool:
        """The committed tokens are a complete reply (the grammar may still allow more)."""
        if self.finished:
            return True
        self._seek(())
        return bool(self._m.is_accepting())

    # -- forced tokens ------------------------------------------------------------------
    def force(self, budget: int) -> list[int]:
        """Tokens to commit now without a target forward (at most `budget`), committed here:
        while the mask allows a single token (its constrained probability is one), that token;
        where it allows nothing but stop ids, the first of them (the reply ends either way)."""
        out: list[int] = []
        while len(out) < budget:
            mask = self.allowed()
            n = int(np.count_nonzero(mask))
            if n != 1 and n != int(np.count_nonzero(mask[self._stops])):
                break
            token = int(np.argmax(mask))  # the one allowed token, or the first stop id
            self.commit([token])
            out.append(token)
            if token in self.stop_ids:
                break
        self.forced += len(out)
        return out

    def opening(self) -> int:
        """Tokens the grammar forces at the very start: a lower bound on any reply's length."""
        self._seek(())
        return len(self._m.compute_ff_tokens())

    # -- masking logits -----------------------------------------------------------------
    def masked(self, row: np.ndarray, path: Sequence[int], id_map: np.ndarray | None = None) -> np.ndarray | None:
        """`row` with the tokens the grammar refuses after `path` set to -inf; a draft head's
        row through its `id_map` (draft position -> target id). None: nothing in the row is
        allowed (or `path` itself is refused)."""
        allowed = self.allowed(path)
        if allowed is None:
            return None
        if id_map is not None:
            allowed = allowed[id_map]
        elif len(row) != len(allowed):
            allowed = allowed[:len(row)] if len(row) < len(allowed) else np.pad(allowed, (0, len(row) - len(allowed)))
        if not allowed.any():
            return None
        return np.where(allowed, row, -np.inf)

    def argmax(self, row: np.ndarray, path: Sequence[int]) -> int:
        """The greedy token after `path`: the likeliest allowed one (the first on ties, as np.argmax)."""
        best = int(np.argmax(row))
        allowed = self.allowed(path)
        if allowed is None or allowed[best]:
            return best
        return int(np.argmax(np.where(allowed, row, -np.inf)))

    def accept_greedy(self, draft_tokens: Sequence[int], logits: np.ndarray) -> tuple[int, int]:
        """`acceptance.accept_greedy` under the grammar: the drafts that equal the masked argmax
        of their row, and the target's masked next token. Rows are masked only as far as needed."""
        for i in range(len(draft_tokens) + 1):
            best = self.argmax(logits[i], draft_tokens[:i])
            if i == len(draft_tokens) or int(draft_tokens[i]) != best:
                return i, best
        raise AssertionError("unreachable")

    def masked_tree(self, tree: DraftTree, logits: np.ndarray) -> np.ndarray:
        """A tree verify's rows, each masked after its own path (root row 0, node i row i)."""
        out = np.array(logits, dtype=np.float32)
        paths: list[tuple[int, ...]] = [()]
        for token, parent in zip(tree.tokens, tree.parents):
            paths.append(paths[parent] + (int(token),))
        for i, path in enumerate(paths):
            allowed = self.allowed(path)
            if allowed is not None:  # a refused node is never accepted: its children's rows go unread
                out[i, ~allowed[:out.shape[1]]] = -np.inf
        return out

    def fit(self, draft: Draft) -> Draft:
        """A chain draft cut before its first token the grammar refuses. Exact for proposals
        made deterministically (a lookup, a recycled chain, a tail): whether a token stays then
        depends on the context only. Sampled drafts come from masked rows already."""
        n = self.valid_prefix(draft.tokens)
        return draft if n == len(draft.tokens) else draft.truncated(n)


class MaskedRows(Sequence[np.ndarray]):
    """A chain verify's target rows, each masked after the drafts before it when read (a lazy
    sequence for `sampling.LazyDists`: rows past a rejection are never masked)."""

    def __init__(self, logits: np.ndarray, constraint: Constraint, draft_tokens: Sequence[int]) -> None:
        self.logits, self.constraint, self.draft_tokens = logits, constraint, list(draft_tokens)

    def __len__(self) -> int:
        return len(self.logits)

    def __getitem__(self, i):  # type: ignore[override] - rows only, no slices
        masked = self.constraint.masked(self.logits[i], self.draft_tokens[:i])
        return self.logits[i] if masked is None else masked
