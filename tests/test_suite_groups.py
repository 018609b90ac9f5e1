"""The suite's grouping takes effect: tests that tests/conftest.py puts in one xdist group run on
one worker. Nothing else would notice otherwise: a pytest and pytest-xdist pair that drops the
groups still passes every test, only slower, with the slow tier's bundles, probes and reference
model made once per worker instead of once per session."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("xdist", reason="the suite's groups are pytest-xdist's (pip install 'edgespec[test]')")

# a conftest that groups as tests/conftest.py does: a marker added at collection, not written on the test
CONFTEST = '''
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group("one" if "one" in item.name else "two"))
'''
TESTS = '''
import os
import time

import pytest

@pytest.mark.parametrize("i", range(6))
def test_one(i):
    time.sleep(0.05)  # long enough that a free worker would take some of the group's tests
    with open(os.environ["GROUPS_OUT"], "a") as f:
        f.write(f"one {os.environ['PYTEST_XDIST_WORKER']}\\n")

@pytest.mark.parametrize("i", range(6))
def test_two(i):
    time.sleep(0.05)
    with open(os.environ["GROUPS_OUT"], "a") as f:
        f.write(f"two {os.environ['PYTEST_XDIST_WORKER']}\\n")
'''


def test_a_group_runs_on_one_worker(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not this project's addopts
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_grouped.py").write_text(TESTS)
    out = tmp_path / "ran.txt"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "-n", "2", "--dist", "loadgroup", "-c", str(tmp_path / "pytest.ini"), str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GROUPS_OUT": str(out)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran: dict[str, set[str]] = {}
    for line in out.read_text().splitlines():
        group, worker = line.split()
        ran.setdefault(group, set()).add(worker)
    assert sorted(ran) == ["one", "two"] and len(out.read_text().splitlines()) == 12
    assert all(len(workers) == 1 for workers in ran.values()), f"a group ran on several workers: {ran}"
