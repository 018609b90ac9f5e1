"""The CLI as a user runs it: real subprocesses, exit codes, one-line errors, piped chat."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny import make_model

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def run(*args: str, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgespec", *args], input=stdin, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def cli_bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    src = make_model("qwen2", root / "src", chat_template=CHATML)
    out = root / "bundle"
    proc = run("export", "--target", str(src), "--draft-precision", "int4", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "edgespec.json").is_file()
    return out


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("edgespec: error:"), proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_help_loads_no_backend():
    code = ("import sys; from edgespec.cli import main; main(['--help']); "
            "print(sorted(m for m in ('onnxruntime', 'torch', 'transformers', 'openvino') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("[]"), proc.stdout


def test_generate_streams_text(cli_bundle):
    proc = run("generate", str(cli_bundle), "the cat and", "--max-tokens", "12", "--stats")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "tok/s" in proc.stderr and "acceptance" in proc.stderr


def test_generate_draft_and_no_draft_agree(cli_bundle):
    a = run("generate", str(cli_bundle), "the dog", "--max-tokens", "20", "-k", "3")
    b = run("generate", str(cli_bundle), "the dog", "--max-tokens", "20", "--no-draft")
    assert a.returncode == b.returncode == 0
    assert a.stdout == b.stdout


def test_chat_through_a_pipe(cli_bundle):
    proc = run("chat", str(cli_bundle), "--max-tokens", "8", stdin="hello world\nthe cat\n/stats\n/reset\n/stats\n")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "session: 2 replies" in out
    assert "[conversation cleared]" in out and "no replies yet" in out


@pytest.mark.parametrize("flags,needle", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top-p"),
    (["--max-tokens", "0"], "max-tokens"),
])
def test_bad_sampling_flags(cli_bundle, flags, needle):
    assert_one_line_error(run("generate", str(cli_bundle), "hi", *flags), needle)
    assert_one_line_error(run("chat", str(cli_bundle), *flags, stdin="hi\n"), needle)


def test_export_missing_model(tmp_path):
    assert_one_line_error(run("export", "--target", str(tmp_path / "nope"), "-o", str(tmp_path / "b")), "not found")
    assert not (tmp_path / "b").exists()


def test_export_tree_needs_the_onnx_format(tmp_path):
    assert_one_line_error(run("export", "--tree", "--format", "gguf", "-o", str(tmp_path / "b")), "--tree")
    assert not (tmp_path / "b").exists()


def test_export_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(256))
    assert_one_line_error(run("export", "--target", str(bad), "-o", str(tmp_path / "b")), "broken.gguf")
    assert not (tmp_path / "b").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["broken.gguf"]  # no temp folder left behind


def test_export_folder_that_is_no_model(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "notes.txt").write_text("hi")
    assert_one_line_error(run("export", "--target", str(tmp_path / "src"), "-o", str(tmp_path / "b")),
                          "no config.json")


def test_export_existing_output_needs_force(cli_bundle):
    assert_one_line_error(run("export", "--target", str(cli_bundle.parent / "src"), "-o", str(cli_bundle)), "--force")


def test_broken_manifest(cli_bundle, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "edgespec.json").write_text("{ not json")
    assert_one_line_error(run("generate", str(broken), "hi"), "manifest")
    data = json.loads((cli_bundle / "edgespec.json").read_text())
    del data["target"]
    (broken / "edgespec.json").write_text(json.dumps(data))
    assert_one_line_error(run("chat", str(broken), stdin="hi\n"), "target")


def test_not_a_bundle(tmp_path):
    assert_one_line_error(run("generate", str(tmp_path), "hi"), "not an edgespec bundle")
    assert_one_line_error(run("generate", str(tmp_path / "missing"), "hi"), "not found")


def test_unknown_command():
    proc = run("frobnicate")
    assert proc.returncode == 2 and "unknown command" in proc.stderr


def test_info_shows_the_tuned_configuration_measured_once_then_cached(zoo, tmp_path):
    pytest.importorskip("openvino")
    bundle = zoo.bundle("qwen2", formats=("onnx", "openvino"))
    env = {"EDGESPEC_TUNE": "1", "EDGESPEC_CACHE": str(tmp_path)}
    first = run("info", str(bundle), env=env)
    assert first.returncode == 0, first.stderr
    chosen = next(ln for ln in first.stdout.splitlines() if "chosen:" in ln)
    assert ", draft body shared" in chosen and "measured now" in chosen
    rows = [ln.strip() for ln in first.stdout.splitlines() if ", draft body" in ln and "chosen:" not in ln]
    # each backend with the draft on the target's body (a body of its own is not a candidate left to choose)
    assert sorted(r.split(",")[0] for r in rows) == ["onnxruntime", "openvino"], rows
    again = run("info", str(bundle), env=env)
    assert next(ln for ln in again.stdout.splitlines() if "chosen:" in ln).endswith("[cached]")
    off = run("info", str(bundle), env={**env, "EDGESPEC_TUNE": "0"})
    assert "nothing measured" in off.stdout


def test_sigterm_inside_exec_d_source_still_exits_as_sigterm(tmp_path):
    """A SIGTERM landing in code built from source text (dataclasses, namedtuple: all through
    transformers' import) must not turn `python -m` into a SIGINT death after the export unwound."""
    (tmp_path / "sigterm_probe.py").write_text(
        "import signal, sys\n"
        "from edgespec.cli.common import sigterm_as_interrupt\n"
        "with sigterm_as_interrupt() as got:\n"
        "    try:\n"
        "        exec('import os, signal, time\\nos.kill(os.getpid(), signal.SIGTERM)\\ntime.sleep(30)')\n"
        "    except KeyboardInterrupt:\n"
        "        pass\n"
        "sys.exit(128 + got[0] if got else 1)\n")
    proc = subprocess.run([sys.executable, "-m", "sigterm_probe"], cwd=tmp_path, capture_output=True, timeout=60)
    assert proc.returncode == 128 + 15, proc.stderr


def test_a_sigterm_that_lands_in_a_callback_whose_errors_python_ignores_still_ends_the_block(tmp_path):
    """A signal landing in a `__del__` (or importlib's weakref callbacks) raises Terminated where
    Python only prints it; the block must still unwind, not run on as if no signal came."""
    (tmp_path / "swallow_probe.py").write_text(
        "import os, signal, sys, time\n"
        "from edgespec.cli.common import Terminated, sigterm_as_interrupt\n"
        "class Dying:\n"
        "    def __del__(self):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(0.2)\n"  # the handler runs here, inside __del__
        "with sigterm_as_interrupt() as got:\n"
        "    try:\n"
        "        Dying()\n"
        "        for _ in range(500):\n"
        "            time.sleep(0.01)\n"
        "        sys.exit(3)\n"  # ran on: the signal was lost
        "    except Terminated:\n"
        "        pass\n"
        "sys.exit(128 + got[0] if got else 1)\n")
    proc = subprocess.run([sys.executable, "swallow_probe.py"], cwd=tmp_path, capture_output=True, timeout=60)
    assert proc.returncode == 128 + 15, proc.stderr
    assert b"Exception ignored" not in proc.stderr  # handled, not reported as a stray error


def test_an_error_a_library_raises_while_sigterm_unwinds_it_ends_by_the_signal_without_a_traceback(tmp_path):
    """numpy, interrupted inside its check of whether a file object is a path, goes on to take it
    for one: the verb then unwinds with a TypeError whose context is the Terminated. The process
    must still end as killed by SIGTERM, with no traceback; an error of its own still shows one."""
    (tmp_path / "mangle_probe.py").write_text(
        "import os, signal, sys, time\n"
        "from edgespec.cli.common import cli_entry\n"
        "@cli_entry\n"
        "def verb(argv):\n"
        "    if argv:\n"
        "        raise TypeError('a bug of its own')\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(30)\n"
        "    except BaseException:\n"
        "        raise TypeError('expected str, bytes or os.PathLike object, not BufferedReader')\n"
        "sys.exit(verb(sys.argv[1:]))\n")
    ended = subprocess.run([sys.executable, "mangle_probe.py"], cwd=tmp_path, capture_output=True, timeout=60)
    assert ended.returncode == 128 + 15 and b"Traceback" not in ended.stderr, ended.stderr
    bug = subprocess.run([sys.executable, "mangle_probe.py", "x"], cwd=tmp_path, capture_output=True, timeout=60)
    assert bug.returncode == 1 and b"a bug of its own" in bug.stderr, bug.stderr


def test_chat_and_info_say_when_drafting_is_off_for_inexactness(cli_bundle, monkeypatch, capsys, tmp_path):
    """In-process (the rounding is patched in): where no verify width is exact here, chat's first
    line and `edgespec info` say the engine decodes plainly, and why."""
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))  # the faked verdict stays in this test
    import io

    import numpy as np

    from edgespec.cli import chat, info
    from edgespec.engine.engine import load
    from edgespec.engine.opened import DRAFTING_REFUSED
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    forward = OnnxRuntime.forward

    def rounded(self, token_ids, n_logits=1):
        out = forward(self, token_ids, n_logits)
        return out + np.float32(1e-3) if len(token_ids) > 1 else out

    monkeypatch.setattr(OnnxRuntime, "forward", rounded)
    args = chat.build_parser().parse_args([str(cli_bundle), "--max-tokens", "2", "--retune"])
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    with load(str(cli_bundle), drafter="ngram", retune=True) as engine:
        assert engine.drafter_name is None
        chat.repl(engine, args, interactive=False)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"edgespec chat: plain decoding, drafting is off: {DRAFTING_REFUSED}"
    lines = info._exactness(str(cli_bundle), retune=False)
    assert any(ln.strip() == f"drafting off: {DRAFTING_REFUSED}" for ln in lines), lines
