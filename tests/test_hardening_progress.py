"""Long steps say what they do (issue 51, item 4): progress on stderr as plain lines on a pipe,
a bar on a terminal, announced first-run builds, and the exactness probe, tuning, hashing, the
default model's assembly and distill counting their work. The builds' own cases, and the export
and first-run builds that report, are in test_hardening_builds.py."""
from __future__ import annotations

import io
import shutil
import time
from pathlib import Path

import pytest

from edgespec.progress import Console, reporting, task
from tests.zoo import AGREEING


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> Path:
    """Each test its own edgespec cache, so the bundles it finds there it built."""
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


class Recorder:
    """A Reporter that keeps what it was told."""

    def __init__(self) -> None:
        self.tasks: list[dict] = []

    def begin(self, what, total, unit, announce):
        rec = {"what": what, "total": total, "done": 0, "notes": [], "ok": None, "announce": announce}
        self.tasks.append(rec)

        class Shown:
            def show(self, done, note):
                rec["done"] = done
                if note and (not rec["notes"] or rec["notes"][-1] != note):
                    rec["notes"].append(note)

            def end(self, ok):
                rec["ok"] = ok

        return Shown()

    def find(self, words: str) -> dict:
        return next(t for t in self.tasks if words in t["what"])


def test_plain_lines_after_a_quiet_start_then_at_least_every_so_often():
    out = io.StringIO()
    with reporting(Console(out, delay_s=0.3, every_s=0.6, tty=False)):
        with task("quick"):
            pass
        with task("slow work", total=3, unit="file") as t:
            t.set_postfix_str("reading a")
            time.sleep(0.9)
            t.update()
            t.set_postfix_str("reading b")
            time.sleep(1.5)
            t.update(2)
    lines = out.getvalue().splitlines()
    assert not any("quick" in ln for ln in lines)  # under the delay: nothing
    assert lines[0] == "edgespec: slow work: reading a [0/3 files]"
    assert any(ln.startswith("edgespec: slow work: reading b [1/3 files]") for ln in lines)
    assert sum("reading b" in ln for ln in lines) >= 2  # said again while nothing changed
    assert lines[-1].startswith("edgespec: slow work: done in ")


def test_an_announced_task_speaks_at_once_and_a_failed_one_claims_nothing():
    out = io.StringIO()
    with reporting(Console(out, delay_s=60, tty=False)), pytest.raises(RuntimeError):
        with task("building a bundle (one time)", announce=True):
            time.sleep(0.1)
            raise RuntimeError("boom")
    assert out.getvalue().splitlines() == ["edgespec: building a bundle (one time)"]


def test_a_terminal_gets_a_bar_that_is_gone_when_done():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    with reporting(Console(out, delay_s=0)):
        with task("bar work", total=4) as t:
            for _ in range(4):
                t.update()
                time.sleep(0.2)
    text = out.getvalue()
    assert "bar work" in text and "4/4" in text and "\r" in text


def test_progress_is_off_with_the_environment_switch(monkeypatch):
    from edgespec.progress import current

    monkeypatch.delenv("EDGESPEC_PROGRESS", raising=False)  # as a user runs it (conftest turns it off)
    assert isinstance(current(), Console)
    monkeypatch.setenv("EDGESPEC_PROGRESS", "0")
    assert current() is None
    with task("silent") as t:  # still usable
        t.update()


def test_the_exactness_probe_reports_its_prefixes():
    from edgespec.runtimes.exactness import probe
    from tests.toy import ToyRuntime

    rec = Recorder()
    with reporting(rec):
        probe(ToyRuntime(vocab=50), 4, starts=(1, 9), sampled=(20,))
    t = rec.find("probing verify exactness")
    assert t["total"] == 3 and t["done"] == 3 and t["ok"]


def test_tuning_announces_and_counts_the_configurations_it_measures(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from edgespec.engine import tuning
    from edgespec.engine.config import EngineConfig
    from tests.test_tuning import fake

    plans = {(b, "shared"): SimpleNamespace(backend=b, draft_body="shared") for b in ("onnxruntime", "openvino")}
    monkeypatch.setattr(tuning, "candidate_plans", lambda *a: plans)
    monkeypatch.setattr(tuning, "_cache_path", lambda bundle, plan: tmp_path / f"{plan.backend}.json")
    monkeypatch.setattr(tuning, "measure_engine", lambda engine: fake(engine.backend, one=engine.one))

    class Opened:
        def __init__(self, plan):
            self.backend, self.one = plan.backend, 10.0 if plan.backend == "openvino" else 30.0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    rec = Recorder()
    with reporting(rec):
        chosen = tuning.tune(SimpleNamespace(manifest=None), EngineConfig(tune=True), list(b for b, _ in plans),
                             Opened)
    t = rec.find("tuning: timing this bundle's configurations")
    assert chosen.choice.backend == "openvino" and t["announce"] and t["total"] == 2 == t["done"] and t["ok"]
    assert any("openvino" in n for n in t["notes"])


def test_hashing_a_gguf_and_assembling_the_default_model_report_themselves(tmp_path):
    from edgespec.exporters.gguf.hashes import content_digest
    from edgespec.models.catalog import assembled
    from tests.test_hardening_files import _package

    f = tmp_path / "w.gguf"
    f.write_bytes(b"GGUF" + bytes(4096))
    rec = Recorder()
    with reporting(rec):
        content_digest(f)
        assembled(_package(tmp_path / "pkg"), tmp_path / "m.gguf")
    assert rec.find("hashing w.gguf")["ok"] and rec.find("assembling the default model's weights")["ok"]


def test_distill_counts_its_data_and_its_training(zoo, tmp_path):
    pytest.importorskip("torch")
    from edgespec.training.distill import DistillConfig, distill_bundle

    bundle = Path(shutil.copytree(zoo.bundle("gemma3", AGREEING), tmp_path / "b"))
    rec = Recorder()
    with reporting(rec):
        distill_bundle(DistillConfig(bundle, train_minutes=2 / 60, gen_tokens=2))
    data, train = rec.find("draft-head data"), rec.find("training the draft head")
    assert data["done"] == data["total"] > 0 and train["total"] == 2 and train["ok"]
    assert any("held-out agreement" in n for n in train["notes"])
