"""The repository's promises about itself: the README's two commands (the test one is what CI
runs), the README stays a front page, links in the docs resolve, every committed benchmark
result is one BENCHMARKS.md names, the plain `pytest` skips the slow tier, and the Python API
example runs."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, ROOT / "BENCHMARKS.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def fresh_machine_commands() -> list[str]:
    """The indented command lines of the README's "Fresh machine" section."""
    text = README.read_text()
    section = text.split("## Fresh machine: two commands", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("    ") and line.strip()]


def test_the_readme_gives_two_fresh_machine_commands_chat_then_tests():
    chat, tests = fresh_machine_commands()
    assert chat.startswith("python3 -m venv .venv") and chat.endswith("edgespec chat")
    assert tests.startswith("python3 -m venv .venv") and tests.endswith("python -m pytest --slow")


def test_ci_runs_the_readme_test_command_verbatim():
    _, tests = fresh_machine_commands()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert any(line.startswith(tests) for line in ci), ".ci/run must run the README's test command as written"


def test_the_readme_is_a_front_page():
    assert len(README.read_text().splitlines()) <= 250


def _slug(heading: str) -> str:
    # GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_local_links_resolve(doc: Path):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md":
            headings = {_slug(m) for m in re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)}
            if anchor not in headings:
                broken.append(target)
    assert not broken, f"{doc.name}: links to nothing: {broken}"


def test_docs_hold_no_machine_paths():
    for doc in DOCS:
        assert not re.search(r"(?<![\w.])/(work|tmp)/", doc.read_text()), f"{doc.name} names a machine path"


def test_every_committed_benchmark_result_is_named_in_benchmarks_md():
    named = (ROOT / "BENCHMARKS.md").read_text()
    results = [p for p in (ROOT / "benchmarks" / "results").rglob("*") if p.is_file()]
    assert results
    unnamed = [str(p.relative_to(ROOT)) for p in results if p.name not in named]
    assert not unnamed, f"superseded results are deleted, current ones named in BENCHMARKS.md: {unnamed}"


def _pytest(*args: str, slow_env: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "EDGESPEC_SLOW"}
    if slow_env is not None:
        env["EDGESPEC_SLOW"] = slow_env
    return subprocess.run([sys.executable, "-m", "pytest", "tests/test_slow_default.py", "-p", "no:cacheprovider",
                           "-q", "-rs", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_plain_pytest_skips_the_slow_tier_and_says_how_to_run_it():
    run = _pytest()
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"\b2 skipped\b", run.stdout) and "passed" not in run.stdout
    assert "slow tier: run with --slow" in run.stdout


@pytest.mark.parametrize("how", [("--slow",), ("EDGESPEC_SLOW", "1")], ids=["flag", "env"])
def test_the_slow_tier_runs_when_asked(how):
    # --setup-plan shows what would run without exporting the real model
    args, env = (how, None) if how[0] == "--slow" else ((), how[1])
    run = _pytest("--setup-plan", *args, slow_env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "test_default_greedy_is_exact_and_the_gguf_s_own_model" in run.stdout and "skipped" not in run.stdout


def test_the_python_api_example_runs(zoo, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("python_api", ROOT / "examples" / "python_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(str(zoo.bundle("qwen2")))
    out = capsys.readouterr().out.splitlines()
    assert len(out) >= 3
    assert re.search(r"\[\d+(\.\d+)? tok/s, \d+% of drafts accepted\]", "\n".join(out))
