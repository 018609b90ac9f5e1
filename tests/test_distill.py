"""`edgespec distill` and `export --draft-head trained` refuse what they cannot train on with one
line and exit 2, writing nothing: a budget of 0 minutes, an empty calibration file, a bundle
without a draft on the target's body, a head that does not fit the target."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from edgespec.cli.distill import main as distill_main  # noqa: E402
from edgespec.errors import BackendError, ConfigError  # noqa: E402
from edgespec.exporters.export import ExportConfig  # noqa: E402
from edgespec.runtimes.onnxruntime.split import open_shared_pair  # noqa: E402
from edgespec.training.distill import DistillConfig, distill_bundle  # noqa: E402
from edgespec.training.draft_head import HeadWeights, build_onnx  # noqa: E402
from tests.test_draft_head import onnx_files  # noqa: E402
from tests.zoo import AGREEING  # noqa: E402


def listing(path) -> dict:
    return {p.relative_to(path): p.stat().st_mtime_ns for p in sorted(path.rglob("*"))}


@pytest.fixture
def bundle(zoo, tmp_path):
    path = tmp_path / "b"
    shutil.copytree(zoo.bundle("gemma3", AGREEING), path)
    return path


@pytest.mark.parametrize("minutes", ["0", "-1", "nan"])
def test_a_budget_of_no_minutes_is_one_line(bundle, capsys, minutes):
    before = listing(bundle)
    assert distill_main([str(bundle), "--train-minutes", minutes]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--train-minutes" in err
    assert listing(bundle) == before
    with pytest.raises(ConfigError, match="--train-minutes"):
        ExportConfig(output=bundle / "x", draft_head="trained", train_minutes=0)


def test_a_negative_generation_length_is_one_line(bundle, capsys):
    before = listing(bundle)
    assert distill_main([str(bundle), "--gen-tokens", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--gen-tokens" in err
    assert listing(bundle) == before


def test_an_empty_calibration_file_is_one_line(bundle, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    before = listing(bundle)
    assert distill_main([str(bundle), "--calibration", str(empty)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no prompts" in err
    assert listing(bundle) == before


def test_without_torch_distill_says_what_to_install(bundle, capsys, monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "edgespec.training.draft_head_train", raising=False)
    monkeypatch.setitem(sys.modules, "torch", None)  # a runtime install: import torch fails
    before = listing(bundle)
    assert distill_main([str(bundle), "--train-minutes", "0.05"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "edgespec[export]" in err
    assert listing(bundle) == before


def test_a_bundle_without_a_draft_on_its_body_is_refused(zoo, tmp_path, capsys):
    path = zoo.bundle("gemma3", None)
    before = listing(path)
    assert distill_main([str(path), "--train-minutes", "1"]) == 2
    assert "--draft self" in capsys.readouterr().err
    assert listing(path) == before
    with pytest.raises(ConfigError, match="--format onnx"):
        ExportConfig(output=tmp_path / "x", formats=("gguf",), draft_head="trained")
    with pytest.raises(ConfigError, match="--draft-head trained"):
        ExportConfig(output=tmp_path / "x", train_minutes=3)
    with pytest.raises(ConfigError, match="calibration"):
        DistillConfig(path, builtin=False)


def test_a_head_for_another_hidden_size_is_refused(bundle, tmp_path):
    h, k, inner = 8, 5, 4
    z = np.zeros
    w = HeadWeights(z((k + 1, h)), z(h), z(h), z((2 * h, h)), z(h), z(h), z((h, inner)), z((h, inner)),
                    z((inner, h)), z(h))
    import onnx

    onnx.save(build_onnx(w), tmp_path / "head.onnx")
    target, draft = onnx_files(bundle)
    with pytest.raises(BackendError, match="distill it again"):
        open_shared_pair(target, draft, draft_head=tmp_path / "head.onnx")


def test_a_distilled_bundle_loads_and_another_distill_replaces_its_head(bundle):
    first = distill_bundle(DistillConfig(bundle, train_minutes=1 / 60, gen_tokens=2, progress=False))
    second = distill_bundle(DistillConfig(bundle, train_minutes=1 / 60, gen_tokens=2, progress=False, seed=1))
    from edgespec.bundle import load_bundle

    assert load_bundle(bundle).manifest.draft_head == second and first.file == second.file
    assert not [p for p in bundle.iterdir() if p.name.startswith(".")]  # no staging or old folder left


def test_export_with_a_trained_head_writes_it_into_the_new_bundle(zoo, tmp_path):
    from edgespec.bundle import load_bundle
    from edgespec.training.distill import export_with_head

    out = export_with_head(ExportConfig(output=tmp_path / "b", target=zoo.source("gemma3"), draft_precision="int8",
                                        draft_head="trained", train_minutes=2 / 60))
    m = load_bundle(out).manifest
    assert m.draft_head is not None and (out / m.draft_head.file).is_file()
    assert m.draft_head.train_minutes == 2 / 60 and m.draft_head.k == m.draft.vocab_size
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_the_exporters_alone_refuse_a_head_they_cannot_train(zoo, tmp_path):
    """The exporters do not import the torch-side training: a head is trained by the step its caller
    passes, and without one the export stops before any work instead of dropping the option."""
    from edgespec.exporters.export import export_bundle

    with pytest.raises(ConfigError, match="export_with_head"):
        export_bundle(ExportConfig(output=tmp_path / "b", target=zoo.source("gemma3"), draft_head="trained"))
    assert not (tmp_path / "b").exists()
