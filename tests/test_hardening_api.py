"""Plain caller mistakes through the Python API are edgespec errors naming the argument, not
exceptions from deep inside the tokenizer, the sampler or the decoder; the engine stays usable."""
from __future__ import annotations

import pytest

from edgespec.engine.engine import load
from edgespec.errors import ConfigError, EdgespecError
from tests.zoo import DISAGREEING

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def engine(zoo):
    with load(zoo.bundle("qwen2", DISAGREEING), k=3, drafter="model") as e:
        yield e


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"prompt": None}, "the prompt must be text or a list of token ids, got NoneType"),
    ({"prompt": 123}, "the prompt must be text or a list of token ids, got int"),
    ({"prompt": "bad \ud800 surrogate"}, "the prompt is not valid Unicode text (a lone surrogate at offset 4)"),
    ({"temperature": "0.5"}, "temperature must be a number, got '0.5'"),
    ({"top_p": None}, "top-p must be a number, got None"),
    ({"min_p": "0"}, "min-p must be a number, got '0'"),
    ({"max_tokens": "2"}, "max-tokens must be an integer >= 1, got '2' (str)"),
    ({"max_tokens": 0}, "max-tokens must be >= 1, got 0"),
    ({"stop": [None]}, "stop[0] must be text (str), got NoneType"),
    ({"stop": [""]}, "stop[0] is empty"),
    ({"stop": 5}, "stop must be a string or a list of strings, got int"),
    ({"prompt": [1, "2"]}, "token ids must be integers; the prompt's item 1 is '2' (str)"),
])
def test_generate_refuses_caller_mistakes_by_name(engine, kwargs, message):
    kwargs = {"prompt": PROMPT, "max_tokens": 4, **kwargs}
    prompt = kwargs.pop("prompt")
    with pytest.raises(ConfigError) as err:
        engine.generate(prompt, **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert engine.generate(PROMPT, max_tokens=4)  # still usable


def test_a_stop_string_alone_is_one_stop(engine):
    full = engine.generate(PROMPT, max_tokens=12)
    cut = next((c for c in full[1:] if c.strip()), None)
    if cut is None:
        pytest.skip("the tiny model's text has no character to stop at")
    assert engine.generate(PROMPT, max_tokens=12, stop=cut) == engine.generate(PROMPT, max_tokens=12, stop=[cut])


@pytest.mark.parametrize(("message", "expected"), [
    (123, "the message must be text (str), got int"),
    (None, "the message must be text (str), got NoneType"),
    ("hi \udcff", "the message is not valid Unicode text (a lone surrogate at offset 3)"),
])
def test_chat_send_refuses_caller_mistakes_and_keeps_the_history(engine, message, expected):
    chat = engine.chat()
    "".join(r.text for r in chat.send("Hello", max_tokens=3))
    before = list(chat.messages)
    with pytest.raises(EdgespecError) as err:
        chat.send(message, max_tokens=3)
    assert expected in str(err.value)
    assert chat.messages == before


def test_threads_past_the_usable_cpus_are_capped_with_a_warning(caplog):
    from edgespec.cpus import usable_cpu_count
    from edgespec.engine.config import EngineConfig

    usable = usable_cpu_count()
    with caplog.at_level("WARNING", logger="edgespec.engine.config"):
        cfg = EngineConfig(threads=usable + 62)
    assert cfg.threads == usable
    assert f"threads {usable + 62} is more than the {usable} CPUs" in caplog.text
    assert EngineConfig(threads=usable).threads == usable and EngineConfig().threads is None
