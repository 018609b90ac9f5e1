"""Structured output on the toy runtime: response formats, compiling, the grammar's masks and
forced tokens, and the speculative loop under a grammar (greedy == plain, sampling exact)."""
from __future__ import annotations

import dataclasses
import json
import threading
import time

import numpy as np
import pytest

from edgespec.decoding import FixedK, RecyclingDrafter, SamplingParams, SpeculativeDecoder
from edgespec.decoding.grammar import MAX_SPEC_BYTES, GrammarError, ResponseFormat, _bounded, response_format
from edgespec.decoding.limits import DecoderLimits
from edgespec.errors import ConfigError
from tests import oracle
from tests.char_tokenizer import EOS, VOCAB, char_compiler, char_tokenizer, char_vocab
from tests.toy import ToyRuntime, TreeToyRuntime

IDS = char_vocab()
PROMPT = [IDS["a"], IDS["b"], IDS["c"]]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "pet": {"enum": ["cat", "dog", "none"]}}}
COMPILER = char_compiler()
TEXT = char_tokenizer()


def person(text: str) -> dict:
    """The reply parsed, and checked against PERSON."""
    obj = json.loads(text)
    assert set(obj) == {"name", "age", "pet"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 8
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 150
    assert obj["pet"] in ("cat", "dog", "none")
    return obj


def run(dec: SpeculativeDecoder, grammar, n: int = 60, params: SamplingParams = SamplingParams(), prompt=PROMPT):
    tokens = list(prompt)
    constraint = grammar.constraint()
    steps = list(dec.stream(tokens, params, n, {EOS}, constraint=constraint))
    return tokens[len(prompt):], steps, constraint


def naive_constrained_greedy(model: ToyRuntime, prompt, grammar, n: int) -> list[int]:
    """Reference: re-feed the whole sequence for every token, mask its row, take the argmax."""
    constraint, seq = grammar.constraint(), list(prompt)
    for _ in range(n):
        model.reset()
        row = model.forward(seq, n_logits=1)[-1]
        token = int(np.argmax(np.where(constraint.allowed(), row, -np.inf)))
        constraint.commit([token])
        seq.append(token)
        if token == EOS:
            break
    model.reset()
    return seq[len(prompt):]


# ---------------------------------------------------------------- response formats


def test_response_formats_are_validated_when_built():
    fmt = ResponseFormat.json_schema(PERSON, name="person")
    assert fmt.kind == "json_schema" and json.loads(fmt.spec) == PERSON
    assert fmt.describe() == "the JSON schema 'person'"
    assert ResponseFormat.json_schema(json.dumps(PERSON)) == ResponseFormat.json_schema(PERSON)
    with pytest.raises(ConfigError, match="not valid JSON"):
        ResponseFormat.json_schema("{'type': 'object'}")
    with pytest.raises(ConfigError, match="is an object"):
        ResponseFormat.json_schema([1, 2])
    with pytest.raises(ConfigError, match="kind must be one of"):
        ResponseFormat("xml", "<a/>")
    with pytest.raises(ConfigError, match="empty"):
        ResponseFormat.regex("  ")
    with pytest.raises(GrammarError, match="larger than"):
        ResponseFormat.grammar('root ::= "' + "a" * MAX_SPEC_BYTES + '"')


def test_openai_response_format_objects():
    assert ResponseFormat.from_openai({"type": "text"}) is None
    assert ResponseFormat.from_openai({"type": "json_object"}) == ResponseFormat.json_object()
    fmt = ResponseFormat.from_openai({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert fmt == ResponseFormat.json_schema(PERSON, name="p")
    assert response_format(fmt) is fmt and response_format(None) is None
    assert response_format({"type": "json_object"}) == ResponseFormat.json_object()
    for bad, match in (({"type": "json_schema"}, "json_schema.schema"), ({"type": "yaml"}, "type must be"),
                       ("json", "must be an object")):
        with pytest.raises(ConfigError, match=match):
            ResponseFormat.from_openai(bad)
    with pytest.raises(ConfigError, match="must be a ResponseFormat"):
        response_format(42)


@pytest.mark.parametrize("fmt, match", [
    (ResponseFormat.regex("[0-9"), "unclosed character class"),
    (ResponseFormat.json_schema({"type": "integer", "minimum": 5, "maximum": 3}), "Unsatisfiable schema"),
    (ResponseFormat.json_schema({"type": "decimal"}), "Invalid type"),
    (ResponseFormat.grammar('root ::= "a" | ( "b"'), "not valid GBNF or Lark"),
    (ResponseFormat.grammar("start: foo"), "does not compile"),
])
def test_bad_formats_are_one_line_errors(fmt, match):
    with pytest.raises(GrammarError, match=match) as e:
        COMPILER.compile(fmt)
    assert "\n" not in str(e.value) and fmt.describe() in str(e.value)


def test_compile_limits():
    # llguidance's fuel bounds the work: a lexer that needs more than the limit is refused by name
    tight = char_compiler(initial_lexer_fuel=100)
    with pytest.raises(GrammarError, match="does not compile"):
        tight.compile(ResponseFormat.regex("(a|b|c|d)*e{1,40}(f|g)+" * 8))
    # the wall clock bounds the wait, whatever the work does
    t0 = time.perf_counter()
    with pytest.raises(GrammarError, match="did not compile within 0.2 s"):
        _bounded(lambda: time.sleep(2), 0.2, "the grammar")
    assert time.perf_counter() - t0 < 1.5
    with pytest.raises(ZeroDivisionError):  # an error inside comes out as itself
        _bounded(lambda: 1 / 0, 1.0, "x")


def test_compiled_formats_are_cached_and_shared_across_threads():
    fmt = ResponseFormat.json_schema(PERSON)
    grammar = COMPILER.compile(fmt)
    assert COMPILER.compile(ResponseFormat.json_schema(json.dumps(PERSON))) is grammar
    masks = []
    threads = [threading.Thread(target=lambda: masks.append(grammar.constraint().allowed())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(masks) == 8 and all((m == masks[0]).all() for m in masks)


# ---------------------------------------------------------------- masks and forced tokens


def test_forced_text_is_the_only_allowed_token():
    """Why committing forced tokens without a forward is exact: wherever llguidance forces text
    (its fast-forward tokens), its mask allows that canonical token alone, so the constrained
    probability of the token is one."""
    constraint = COMPILER.compile(ResponseFormat.json_schema(PERSON)).constraint()
    matcher = constraint._m
    reply, done, forced_seen = '{"name": "bo", "age": 42, "pet": "dog"}', "", 0
    vocab = {token_id: TEXT.decode([token_id]) for token_id in range(1, VOCAB)}
    while done != reply:
        for token in matcher.compute_ff_tokens():
            assert np.flatnonzero(constraint.allowed()).tolist() == [token]
            constraint.commit([token])
            done += vocab[token]
            forced_seen += 1
        if done != reply:  # a free choice: the longest allowed token the reply goes on with
            rest = reply[len(done):]
            token = max((t for t in np.flatnonzero(constraint.allowed()) if t in vocab and rest.startswith(vocab[t])),
                        key=lambda t: len(vocab[t]))
            constraint.commit([int(token)])
            done += vocab[token]
    assert forced_seen >= 8 and constraint.accepting


def test_force_commits_single_tokens_and_the_end():
    constraint = COMPILER.compile(ResponseFormat.regex("name: (cat|dog)")).constraint()
    forced = constraint.force(100)
    assert TEXT.decode(forced) == "name: "  # up to the choice
    assert constraint.forced == len(forced)
    constraint.commit([IDS["d"]])
    assert TEXT.decode(constraint.force(100)) == "og" and constraint.finished  # then EOS, the only way on
    assert constraint.accepting


def test_paths_masks_and_end_tokens():
    constraint = COMPILER.compile(ResponseFormat.regex("a[bc]+")).constraint()
    a, b, c, d = IDS["a"], IDS["b"], IDS["c"], IDS["d"]
    assert np.flatnonzero(constraint.allowed()).tolist() == [a]
    assert set(np.flatnonzero(constraint.allowed([a]))) == {b, c}
    assert set(np.flatnonzero(constraint.allowed([a, b]))) == {b, c, EOS}
    assert constraint.allowed([a, d]) is None and constraint.allowed([a, b, EOS]) is None
    assert constraint.valid_prefix([a, b, c, d]) == 3
    assert constraint.valid_prefix([a, b, EOS, b]) == 3  # a stop id ends a path
    assert constraint.valid_prefix([a, EOS]) == 1  # the reply may not end yet
    assert not constraint.accepting
    constraint.commit([a, c])
    assert constraint.accepting
    with pytest.raises(GrammarError, match="breaks"):
        constraint.commit([d])
    row = np.arange(VOCAB, dtype=np.float32)
    masked = constraint.masked(row, [b])
    assert set(np.flatnonzero(np.isfinite(masked))) == {b, c, EOS}
    trimmed = np.array([d, b, a])  # a draft head's three tokens, as target ids
    assert np.isfinite(constraint.masked(np.zeros(3, np.float32), [], trimmed)).tolist() == [False, True, False]
    assert constraint.masked(np.zeros(2, np.float32), [], np.array([a, d])) is None  # nothing allowed


# ---------------------------------------------------------------- the speculative loop


def trimmed_draft(seed: int = 0) -> tuple[ToyRuntime, np.ndarray]:
    """A draft of the seed's target with noise and a head trimmed of three tokens (an id map)."""
    keep = np.array(sorted(set(IDS.values()) - {IDS["q"], IDS["x"], IDS["7"]}))
    return ToyRuntime(VOCAB, seed=seed, noise=0.4, keep=keep), keep


@pytest.mark.parametrize("drafter", ["plain", "ngram", "model", "trimmed", "both", "recycle-tree"])
def test_constrained_greedy_speculative_equals_plain(drafter):
    grammar = COMPILER.compile(ResponseFormat.json_schema(PERSON))
    for seed in (0, 1, 2):
        target_cls = TreeToyRuntime if drafter == "recycle-tree" else ToyRuntime
        target = target_cls(VOCAB, seed=seed)
        if drafter == "plain":
            dec = SpeculativeDecoder(target)
        elif drafter == "ngram":
            dec = SpeculativeDecoder(target, drafter="ngram")
        elif drafter == "recycle-tree":
            dec = SpeculativeDecoder(target, drafter=RecyclingDrafter(VOCAB, shape=(2, 2, 1)), policy=FixedK(3))
        else:
            draft, id_map = (trimmed_draft(seed) if drafter == "trimmed"
                             else (ToyRuntime(VOCAB, seed=seed, noise=0.3), None))
            dec = SpeculativeDecoder(target, draft, id_map=id_map, drafter="both" if drafter == "both" else "model",
                                     policy=FixedK(4))
        for _ in range(2):  # a second stream on warm caches
            out, steps, constraint = run(dec, grammar)
            assert out == naive_constrained_greedy(ToyRuntime(VOCAB, seed=seed), PROMPT, grammar, 60)
            assert out[-1] == EOS and constraint.finished
            person(TEXT.decode(out))
            assert sum(s.forced for s in steps) == constraint.forced > 0
        if drafter == "recycle-tree":
            assert target.trees > 0  # the tree verifies ran, their rows masked per path
        elif drafter not in ("plain", "ngram"):
            assert sum(s.accepted for s in steps) > 0


def test_forced_tokens_cost_no_forward():
    grammar = COMPILER.compile(ResponseFormat.json_schema(PERSON))
    target = ToyRuntime(VOCAB, seed=0)
    # prefill chunks of 64: no forward here splits at a chunk boundary
    out, steps, constraint = run(SpeculativeDecoder(target, limits=DecoderLimits(max_batch=64)), grammar)
    forwards = target.calls - 1  # the prompt's prefill
    assert constraint.forced >= 12 and forwards == len(out) - constraint.forced
    assert [s for s in steps if s.forced and not s.drafted and len(s.tokens) > s.forced]  # forced, then decoded
    # the forced ids are fed with the next step's token, in one forward, within the exact width:
    # wider than that, all but the last go first, in forwards of that width
    target = ToyRuntime(VOCAB, seed=0)
    draft = ToyRuntime(VOCAB, seed=0, noise=0.3)
    dec = SpeculativeDecoder(target, draft, limits=DecoderLimits(verify_width=3, max_batch=64), policy=FixedK(4))
    widths = []
    forward = target.forward
    target.forward = lambda ids, n_logits=1: widths.append(len(ids)) or forward(ids, n_logits)
    assert run(dec, grammar)[0] == out
    assert max(widths[1:]) <= 3 and len(widths) > len(out) - constraint.forced


def test_drafts_are_masked():
    """No draft slot goes to a token the grammar refuses: each draft is allowed after the drafts before it."""
    grammar = COMPILER.compile(ResponseFormat.json_schema(PERSON))
    draft, id_map = trimmed_draft(1)
    dec = SpeculativeDecoder(ToyRuntime(VOCAB, seed=1), draft, id_map=id_map, policy=FixedK(6))
    seen = []
    propose = dec.drafter.propose

    def spy(tokens, limit, policy, params, rng, constraint=None):
        d = propose(tokens, limit, policy, params, rng, constraint=constraint)
        seen.append((constraint.valid_prefix(d.tokens), len(d.tokens)))
        return d

    dec.drafter.propose = spy
    for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=3)):
        run(dec, grammar, params=params)
    assert sum(n for _, n in seen) > 20
    assert all(valid == n for valid, n in seen)


def test_stopped_stream_leaves_caches_and_grammar_in_step():
    grammar = COMPILER.compile(ResponseFormat.json_schema(PERSON))
    target, draft = ToyRuntime(VOCAB, seed=0), ToyRuntime(VOCAB, seed=0, noise=0.3)
    dec = SpeculativeDecoder(target, draft, policy=FixedK(4))
    tokens, constraint = list(PROMPT), grammar.constraint()
    stream = dec.stream(tokens, SamplingParams(), 60, {EOS}, constraint=constraint)
    next(stream), next(stream)
    stream.close()
    assert target.n_past <= len(tokens) - 1 and draft.n_past <= len(tokens) - 1
    fresh = grammar.constraint()  # the grammar stands after what was committed, drafts dropped
    fresh.commit(tokens[len(PROMPT):])
    assert (fresh.allowed() == constraint.allowed()).all()


# ---------------------------------------------------------------- sampling stays exact


THREE = ResponseFormat.regex("[a-e][a-e][a-e]")  # 125 replies of three single-letter tokens, then EOS


class MaskedPlainRows:
    """The oracle's plain-decoding rows (tests/oracle.PlainRows) masked to the five letters THREE
    allows at each of its three positions: the constrained law the engine must follow."""

    def __init__(self, target: ToyRuntime) -> None:
        self.rows = oracle.PlainRows(target, PROMPT)
        self.allowed = np.zeros(VOCAB, dtype=bool)
        self.allowed[[IDS[c] for c in "abcde"]] = True

    def __call__(self, prefix) -> np.ndarray:
        return np.where(self.allowed, self.rows(prefix), -np.inf).astype(np.float32)


def test_constrained_sampling_is_exact():
    """The exact oracle (tests/oracle.py) on the constrained law: check A puts plain decoding's
    reference, raced on the masked rows, against the enumerated law of the three letters; check B
    asks a speculative decoder (a sampled, trimmed model draft, k=2) under the grammar for
    the reference's letters on every seed (temperature 2, top-k 8). Power as the oracle states (printed)."""
    params = SamplingParams(temperature=2.0, top_k=8)  # every reply likely enough for check A's counts
    rows = MaskedPlainRows(ToyRuntime(VOCAB, seed=5))
    verdict = oracle.check_reference("grammar [a-e]{3}", rows, len(PROMPT), params, length=3)
    grammar = COMPILER.compile(THREE)
    draft, id_map = trimmed_draft(5)
    dec = SpeculativeDecoder(ToyRuntime(VOCAB, seed=5), draft, id_map=id_map, policy=FixedK(2))
    accepted = []

    def speculative(seed: int) -> list[int]:
        out, steps, _ = run(dec, grammar, 5, dataclasses.replace(params, seed=seed))
        assert out[-1] == EOS and len(out) == 4
        accepted.extend(s.accepted for s in steps)
        return out[:3]

    oracle.check_path("grammar [a-e]{3}, speculative", speculative, rows, len(PROMPT), params, length=3)
    assert 0 < sum(accepted) < 2 * len(accepted)  # drafts were accepted and rejected
    print("\n" + verdict.statement())
