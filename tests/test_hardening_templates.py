"""Chat templates are the bundle's (or the GGUF's) code: rendered everywhere (CLI chat, the Python
API, export) in a child process with a time and a memory limit (models/templates.py). A template
that does not compile or that the sandbox refuses is one line, "the bundle's chat template is
invalid/unsafe: ..."; one that never ends or fills the memory is one line too, and the next render
works. Never a traceback, never a hang, never a killed process (issue 43, item 0)."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from edgespec.errors import ConfigError, EdgespecError
from edgespec.models.templates import ChatTemplateError, TemplateLimitError, TemplateRenderer
from tests.test_hardening import cli, one_line_error

CPU_BOMB = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
MEMORY_BOMB = "{{ 'x' * 100000000000 }}"
OUTPUT_BOMB = "{% set s = 'x' * 1000000 %}{% for i in range(99999) %}{{ s }}{% endfor %}"
SYNTAX = "{% for m in messages %}{{ m.content }"
ESCAPE = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
CONTEXT = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True, "bos_token": "<s>",
           "eos_token": ""}


@pytest.fixture(scope="module")
def renderer():
    with TemplateRenderer(timeout_s=1.0) as r:
        yield r


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert msg and "\n" not in msg and "Traceback" not in msg, msg
    return msg


@pytest.mark.parametrize("source, kind, needle", [
    (SYNTAX, ChatTemplateError, "the bundle's chat template is invalid: unexpected '}' (line 1)"),
    ("{% if %}", ChatTemplateError, "the bundle's chat template is invalid:"),
    (ESCAPE, ChatTemplateError, "the bundle's chat template is unsafe: access to attribute '__class__'"),
    ("{{ messages.append(1) }}", ChatTemplateError, "the bundle's chat template is unsafe:"),
    ("{{ raise_exception('roles must alternate') }}", ConfigError, "chat template: roles must alternate"),
    ("{{ nothing.here }}", ConfigError, "failed on these messages: UndefinedError"),
    (MEMORY_BOMB, TemplateLimitError, "needs more than 2 GiB of memory"),
    (OUTPUT_BOMB, TemplateLimitError, "wrote more than 32 M characters"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", TemplateLimitError, "recurses too deeply"),
])
def test_a_broken_template_is_one_typed_line_and_the_next_render_works(renderer, source, kind, needle):
    with pytest.raises(kind) as info:
        renderer.render(source, CONTEXT)
    assert needle in _one_line(info.value)
    assert renderer.render("{{ bos_token }}{{ messages[0].content }}", CONTEXT) == "<s>hi"


def test_what_transformers_gives_a_template_renders_the_same(renderer):
    """loopcontrols, {% generation %}, tojson with keywords, strftime_now: HF templates use them."""
    source = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
              "{% generation %}{{ m|tojson(indent=None) }}{% endgeneration %}{% endfor %}"
              "{{ strftime_now('%Y') | length }}")
    context = {**CONTEXT, "messages": CONTEXT["messages"] * 2}
    assert renderer.render(source, context) == '{"role": "user", "content": "hi"}4'


def test_a_template_that_never_ends_is_stopped_at_the_time_limit(renderer):
    restarts = renderer.restarts
    start = time.monotonic()
    with pytest.raises(TemplateLimitError) as info:
        renderer.render(CPU_BOMB, CONTEXT)
    assert time.monotonic() - start < 10  # the limit is 1 s; a busy machine starts the next child slowly
    assert "did not render within 1 s" in _one_line(info.value)
    assert renderer.restarts == restarts + 1
    assert renderer.render("{{ messages|length }}", CONTEXT) == "1"  # a fresh child


def test_messages_that_are_not_json_values_are_a_config_error(renderer):
    with pytest.raises(ConfigError, match="JSON values"):
        renderer.render("{{ 1 }}", {"messages": [{"role": "user", "content": object()}]})


def test_close_ends_the_child():
    r = TemplateRenderer(timeout_s=5.0)
    assert r.render("{{ 'a' ~ 'b' }}", {}) == "ab"
    proc = r._worker._proc
    r.close()
    assert proc.poll() is not None


def test_ctrl_c_during_a_render_ends_that_child_so_no_late_answer_reaches_the_next(monkeypatch):
    import edgespec.models.child as child

    r = TemplateRenderer(timeout_s=5.0)
    assert r.render("{{ 1 }}", {}) == "1"
    first = r._worker._proc
    real = child._read_line

    def interrupted(proc, timeout_s, request, limit):
        proc.stdin.write(request)  # the child got the request and is answering it
        proc.stdin.flush()
        raise KeyboardInterrupt

    monkeypatch.setattr(child, "_read_line", interrupted)
    with pytest.raises(KeyboardInterrupt):
        r.render("{{ 'late' }}", {})
    monkeypatch.setattr(child, "_read_line", real)
    assert first.poll() is not None
    assert r.render("{{ 'next' }}", {}) == "next"
    r.close()


def test_a_zero_time_limit_is_refused():
    with pytest.raises(ConfigError, match="must be > 0"):
        TemplateRenderer(timeout_s=0)


# -- the bundle's template through the CLI and the Python API ------------------------------

def _with_template(zoo, tmp_path: Path, template: str) -> Path:
    path = Path(shutil.copytree(zoo.bundle("qwen2"), tmp_path / "bundle"))
    data = json.loads((path / "edgespec.json").read_text())
    data["tokenizer"]["chat_template"] = template
    (path / "edgespec.json").write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("template, needle", [(SYNTAX, "the bundle's chat template is invalid: unexpected '}'"),
                                              (ESCAPE, "the bundle's chat template is unsafe: access to attribute")])
def test_cli_chat_with_an_invalid_or_unsafe_template_is_exit_2_and_one_line(zoo, tmp_path, template, needle):
    proc = cli("chat", str(_with_template(zoo, tmp_path, template)), "--max-tokens", "2", stdin=b"hi\nagain\n")
    one_line_error(proc, needle)
    assert proc.returncode == 2


@pytest.mark.parametrize("template, needle", [(CPU_BOMB, "did not render within 5 s"),
                                              (MEMORY_BOMB, "needs more than 2 GiB of memory")])
def test_cli_chat_with_a_cpu_or_memory_bomb_reports_the_turn_on_one_line(zoo, tmp_path, template, needle):
    """A limit is reported per turn (the conversation stays, as for any refused turn); the chat
    ends normally at the end of its input, within the time limit per turn."""
    start = time.monotonic()
    proc = cli("chat", str(_with_template(zoo, tmp_path, template)), "--max-tokens", "2", stdin=b"hi\n")
    err = proc.stderr.decode()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and len(lines) == 1 and needle in lines[0], err
    assert lines[0].startswith("edgespec: error:") and proc.returncode == 0
    assert time.monotonic() - start < 120


def test_api_chat_with_a_cpu_bomb_raises_a_typed_error_and_the_session_goes_on(zoo, tmp_path):
    import edgespec

    path = _with_template(zoo, tmp_path, CPU_BOMB)
    with edgespec.load(path) as engine:
        session = engine.chat(chat_format="template")
        with pytest.raises(TemplateLimitError) as info:
            list(session.send("hi", max_tokens=2))
        assert "did not render within" in _one_line(info.value)
        assert session.messages == []  # the refused turn left no trace
        engine.tokenizer.close()
        with pytest.raises(EdgespecError):  # a new child, the same verdict: never a hang
            list(session.send("again", max_tokens=2))


def test_api_chat_with_an_unsafe_template_is_a_bundle_error(zoo, tmp_path):
    import edgespec
    from edgespec.errors import BundleError

    with edgespec.load(_with_template(zoo, tmp_path, ESCAPE)) as engine:
        with pytest.raises(BundleError, match="the bundle's chat template is unsafe"):
            list(engine.chat(chat_format="template").send("hi", max_tokens=2))


# -- a GGUF's tokenizer.chat_template at export ---------------------------------------------

@pytest.mark.parametrize("template, needle", [(ESCAPE, "the source model's chat template is unsafe"),
                                              (SYNTAX, "the source model's chat template is invalid"),
                                              (CPU_BOMB, "the source model's chat template did not render within")])
def test_export_of_a_gguf_with_a_hostile_template_is_one_line_and_leaves_nothing(zoo, tmp_path, template, needle):
    from gguf import GGUFValueType

    from tests.test_hardening_gguf import rewrite, tiny_gguf

    src = tmp_path / "t.gguf"
    rewrite(tiny_gguf(zoo), src, {"tokenizer.chat_template": (template, GGUFValueType.STRING, None)})
    out = tmp_path / "out"
    proc = cli("export", "--target", str(src), "-o", str(out), "--draft-vocab", "40")
    one_line_error(proc, needle)
    assert proc.returncode == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.gguf"]


def test_no_renderer_child_outlives_the_test_processes():
    """Each child exits when its parent is gone: none of this module's CLI runs left one."""
    ps = subprocess.run(["ps", "-eo", "ppid,args"], capture_output=True, text=True)
    orphans = [ln for ln in ps.stdout.splitlines()
               if "edgespec.models.templates" in ln and ln.split()[0] == "1"]
    assert orphans == []


def test_where_no_child_can_start_templates_render_here_with_a_warning(monkeypatch, caplog):
    """A frozen app or an interpreter under user-mode emulation cannot start the child: chat
    goes on, rendering in this process without the bounds, and says so once."""
    import sys

    from edgespec.models.templates import TemplateRenderer

    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    r = TemplateRenderer(timeout_s=5)
    with caplog.at_level("WARNING", logger="edgespec.models.templates"):
        out = r.render("{{ messages[0]['content'] }}!", {"messages": [{"role": "user", "content": "hi"}]})
        again = r.render("{{ messages[0]['content'] }}?", {"messages": [{"role": "user", "content": "yo"}]})
    assert (out, again) == ("hi!", "yo?")
    assert caplog.text.count("without a time or memory limit") == 1
    r.close()
