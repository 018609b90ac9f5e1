"""`edgespec serve` as a user runs it: the command end to end with the official `openai` client,
its flags generated from ServerConfig, one-line flag errors, and the shipped OpenAI client example."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai"):
    pytest.importorskip(_mod, reason=f"the server tests need {_mod} (pip install 'edgespec[serve,test]')")

import openai  # noqa: E402

from edgespec.engine.engine import load  # noqa: E402
from edgespec.server import ServerConfig  # noqa: E402
from tests.test_server import KEY, MESSAGES, MODEL, reference_chat  # noqa: E402
from tests.zoo import DISAGREEING  # noqa: E402


def test_edgespec_serve_end_to_end(zoo):
    bundle = zoo.bundle("qwen2", DISAGREEING)
    proc = subprocess.Popen([sys.executable, "-m", "edgespec", "serve", str(bundle), "--port", "0",
                             "--api-key", KEY, "--model-name", MODEL], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        line = proc.stdout.readline()
        assert line.startswith("edgespec serve: http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        base = line.split()[2]
        client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=60)
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
        with load(bundle, k=3, drafter="model") as e:
            assert reply.choices[0].message.content == reference_chat(e, max_tokens=6)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_flags_come_from_the_server_config(monkeypatch):
    from edgespec.cli.serve import build_parser, server_config_from_args
    from edgespec.server.config import API_KEY_ENV, OPTIONS

    parser = build_parser()
    by_dest = {a.dest: a for a in parser._actions}
    for name, opt in OPTIONS.items():
        assert by_dest[name].option_strings == list(opt.flags) and by_dest[name].help == opt.full_help()
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    argv = ["--model-name", "m", "--host", "0.0.0.0", "--port", "0", "--api-key", "k", "--max-queue", "3",
            "--max-tokens", "5", "--max-tokens-cap", "9", "--max-request-size", "4KiB", "--client-timeout", "2.5",
            "--template-timeout", "1"]
    by_flag = {f: a.dest for a in parser._actions for f in a.option_strings}
    assert {by_flag[f] for f in argv[::2]} == set(OPTIONS)  # every server flag, given once
    assert server_config_from_args(parser.parse_args(argv)) == ServerConfig(
        model_id="m", host="0.0.0.0", port=0, api_key="k", max_queue=3, max_tokens=5, max_tokens_cap=9,
        max_request_bytes=4096, client_timeout_s=2.5, template_timeout_s=1.0)
    # flags not given: the config's own defaults; the key from the environment unless the flag gives one
    assert server_config_from_args(parser.parse_args([])) == ServerConfig()
    assert server_config_from_args(parser.parse_args(["--max-tokens-cap", "100"])).max_tokens == 100
    monkeypatch.setenv(API_KEY_ENV, "from-env\n")
    assert server_config_from_args(parser.parse_args([])).api_key == "from-env"
    assert server_config_from_args(parser.parse_args(["--api-key", "flag"])).api_key == "flag"


@pytest.mark.parametrize("args, needle", [
    (["--port", "70000"], "--port"),
    (["--api-key", ""], "API key"),
])
def test_serve_flag_errors_are_one_line(zoo, args, needle):
    proc = subprocess.run([sys.executable, "-m", "edgespec", "serve", str(zoo.bundle("qwen2", DISAGREEING)), *args],
                          capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("edgespec: error:"), proc.stderr
    assert needle in lines[0]


def test_the_openai_client_example(zoo):
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "openai_client.py")
    proc = subprocess.run([sys.executable, example, "--serve", str(zoo.bundle("qwen2", DISAGREEING)),
                           "--api-key", KEY, "--max-tokens", "12"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "model: qwen2-int4" in proc.stdout and "[finish: " in proc.stdout
    # the streamed chat reply's usage: within --max-tokens (a random model may draw its end early)
    usage = re.search(r"\[(\d+) prompt \+ (\d+) completion tokens\]", proc.stdout)
    assert usage and int(usage[1]) > 0 and 1 <= int(usage[2]) <= 12, proc.stdout
