"""Structured output through the Python API and the CLI, on real tiny bundles: JSON schemas,
regular expressions and GBNF grammars, greedy speculative == plain, sampled replies valid, chat,
and bad formats as one-line errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from edgespec import GrammarError, ResponseFormat
from edgespec.engine.engine import load
from edgespec.errors import ConfigError
from tests.tiny import PROMPTS as TINY_PROMPTS
from tests.zoo import DISAGREEING

PROMPTS = (*TINY_PROMPTS, "the cat and the dog", "one two three red blue")

ITEM = {"type": "object", "additionalProperties": False, "required": ["word", "count", "kind"],
        "properties": {"word": {"type": "string", "maxLength": 10},
                       "count": {"type": "integer", "minimum": 0, "maximum": 999},
                       "kind": {"enum": ["animal", "thing", "place"]}}}


def item(text: str) -> dict:
    """The reply parsed and checked against ITEM."""
    obj = json.loads(text)
    assert set(obj) == {"word", "count", "kind"}
    assert isinstance(obj["word"], str) and len(obj["word"]) <= 10
    assert isinstance(obj["count"], int) and 0 <= obj["count"] <= 999
    assert obj["kind"] in ("animal", "thing", "place")
    return obj


@pytest.fixture(scope="module")
def engines(zoo):
    """The llama bundle with its int4 draft (it rolls back often): speculative, and plain."""
    bundle = zoo.bundle("llama", DISAGREEING)
    with load(bundle, k=4, drafter="both") as spec, load(bundle, drafter="none") as plain:
        yield spec, plain


def test_json_schema_greedy_speculative_equals_plain(engines):
    spec, plain = engines
    fmt = ResponseFormat.json_schema(ITEM, name="item")
    drafted = forced = 0
    for prompt in PROMPTS[:4]:
        rs = list(spec.stream(prompt, max_tokens=80, response_format=fmt))
        text = "".join(r.text for r in rs)
        assert text == plain.generate(prompt, max_tokens=80, response_format=fmt)
        item(text)
        assert rs[-1].finish_reason == "stop"
        st = rs[-1].stats
        drafted, forced = drafted + st.accepted, forced + st.forced
    assert drafted > 0 and forced > 0


def test_sampled_replies_follow_the_schema(engines):
    spec, _ = engines
    openai_shape = {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM}}
    for seed in range(6):
        item(spec.generate(PROMPTS[seed % 4], max_tokens=80, temperature=1.0, seed=seed, response_format=openai_shape))
    assert spec.generate(PROMPTS[0], max_tokens=80, temperature=0.8, top_k=20, seed=1,
                         response_format=openai_shape) == \
        spec.generate(PROMPTS[0], max_tokens=80, temperature=0.8, top_k=20, seed=1, response_format=openai_shape)


def test_json_object_regex_and_gbnf(engines):
    spec, plain = engines
    obj = json.loads(spec.generate(PROMPTS[0], max_tokens=60, response_format={"type": "json_object"}))
    assert isinstance(obj, dict)
    for fmt, check in ((ResponseFormat.regex("(yes|no)"), lambda t: t in ("yes", "no")),
                       (ResponseFormat.regex("[0-9]{3}-[a-z]{2}"), lambda t: len(t) == 6 and t[3] == "-"),
                       (ResponseFormat.grammar('root ::= "the " animal " is " ("big" | "small")\n'
                                               'animal ::= "cat" | "dog" | "bird"'),
                        lambda t: t.split()[1] in ("cat", "dog", "bird") and t.split()[-1] in ("big", "small")),
                       (ResponseFormat.grammar('start: "n=" /[0-9]{1,4}/ ";"'),
                        lambda t: t.startswith("n=") and t[-1] == ";")):
        text = spec.generate(PROMPTS[1], max_tokens=30, response_format=fmt)
        assert check(text), (fmt, text)
        assert text == plain.generate(PROMPTS[1], max_tokens=30, response_format=fmt)


def test_chat_replies_follow_the_format(zoo):
    for bundle in (zoo.bundle("qwen2", None), zoo.bundle("llama", None)):  # a chat template; a base model's transcript
        with load(bundle) as engine:
            chat = engine.chat()
            fmt = ResponseFormat.json_schema(ITEM)
            item("".join(r.text for r in chat.send("the cat", max_tokens=80, response_format=fmt)))
            text = "".join(r.text for r in chat.send("and the dog", max_tokens=8,
                                                     response_format=ResponseFormat.regex("(yes|no)")))
            assert text in ("yes", "no")
            assert len(chat.messages) == 4 and chat.messages[-1]["content"] == text


def test_bad_formats_and_short_replies_are_one_line_errors(engines):
    spec, _ = engines
    for bad, match in ((ResponseFormat.regex("(a|"), "regular expression does not compile"),
                       (ResponseFormat.json_schema({"type": "string", "minLength": 5, "maxLength": 2}), "JSON schema"),
                       ({"type": "xml"}, "type must be")):
        with pytest.raises(ConfigError, match=match) as e:
            spec.generate(PROMPTS[0], response_format=bad)
        assert "\n" not in str(e.value)
    with pytest.raises(GrammarError, match=r"forces \d+ tokens before any choice, more than max_tokens \(3\)"):
        spec.generate(PROMPTS[0], max_tokens=3, response_format=ResponseFormat.json_schema(ITEM))
    with pytest.raises(GrammarError, match=r"reached max_tokens \(12\) before it completed the JSON schema"):
        spec.generate(PROMPTS[0], max_tokens=12, response_format=ResponseFormat.json_schema(ITEM))
    assert not spec.busy  # the failed generations let go of the engine
    item(spec.generate(PROMPTS[0], max_tokens=80, response_format=ResponseFormat.json_schema(ITEM)))


# -- the CLI ---------------------------------------------------------------------------------

def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgespec", *args], input=stdin, capture_output=True, text=True,
                          timeout=300, env=os.environ.copy())


def one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(lines) == 1 and lines[0].startswith("edgespec: error:") and needle in lines[0], proc.stderr


def test_cli_structured_output(zoo, tmp_path):
    bundle = str(zoo.bundle("llama", DISAGREEING))
    schema = tmp_path / "item.json"
    schema.write_text(json.dumps(ITEM))
    proc = cli("generate", bundle, PROMPTS[0], "--json-schema", str(schema), "--max-tokens", "80", "--stats")
    assert proc.returncode == 0, proc.stderr
    item(proc.stdout)
    assert "forced by the grammar" in proc.stderr
    proc = cli("generate", bundle, PROMPTS[0], "--regex", "(yes|no)", "--max-tokens", "8")
    assert proc.returncode == 0 and proc.stdout.strip() in ("yes", "no"), proc.stderr
    gbnf = tmp_path / "g.gbnf"
    gbnf.write_text('root ::= "the " ("cat" | "dog")\n')
    proc = cli("generate", bundle, "-", "--grammar", str(gbnf), "--max-tokens", "8", stdin=PROMPTS[1])
    assert proc.returncode == 0 and proc.stdout.strip() in ("the cat", "the dog"), proc.stderr


def test_cli_bad_formats(zoo, tmp_path):
    bundle = str(zoo.bundle("llama", DISAGREEING))
    (tmp_path / "bad.json").write_text("{'type': 'object'}")
    (tmp_path / "bad.gbnf").write_text('root ::= "a" | (')
    (tmp_path / "latin1.json").write_bytes(b'{"title": "caf\xe9"}')
    one_line_error(cli("generate", bundle, "hi", "--json-schema", str(tmp_path / "nope.json")), "cannot read")
    one_line_error(cli("generate", bundle, "hi", "--json-schema", str(tmp_path / "bad.json")), "not valid JSON")
    one_line_error(cli("generate", bundle, "hi", "--json-schema", str(tmp_path / "latin1.json")), "not UTF-8")
    one_line_error(cli("generate", bundle, "hi", "--grammar", str(tmp_path / "bad.gbnf")), "not valid GBNF or Lark")
    one_line_error(cli("generate", bundle, "hi", "--regex", "[a-"), "regular expression does not compile")
    one_line_error(cli("generate", bundle, "-", "--json-schema", "-", stdin="{}"), "not both")
    proc = cli("generate", bundle, "hi", "--regex", "a", "--json-schema", str(tmp_path / "bad.json"))
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr
