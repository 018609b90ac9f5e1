"""settle_exact_mode holds one copy of the model at a time (fake runtimes, a scripted probe)."""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import pytest

import edgespec.engine.exact_mode as exact_mode
from edgespec.memory.measure import rss_bytes
from edgespec.runtimes import BACKENDS


@dataclass(frozen=True)
class Verdict:
    exact_width: int
    fully_exact: bool

    def describe(self) -> str:
        return f"exact up to {self.exact_width}"


class Models:
    """Opens fake runtimes and records how many are open at once."""

    def __init__(self, widths: dict[bool, int], shared: bool) -> None:
        self.widths, self.shared = widths, shared  # pad_rows -> exact width the probe reports
        self.open, self.most, self.opened = set(), 0, []

    def runtime(self, pad_rows: bool, role: str):
        models = self

        class Fake:
            def __init__(self) -> None:
                self.pad_rows, self.role, self.closed = pad_rows, role, False
                models.open.add(self)
                models.most = max(models.most, len({r for r in models.open if r.role == "target"}))

            def close(self) -> None:
                self.closed = True
                models.open.discard(self)

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                self.close()

        return Fake()

    def reopen(self, pad_rows: bool = False):
        self.opened.append(pad_rows)
        target = self.runtime(pad_rows, "target")
        return (target, self.runtime(pad_rows, "draft")) if self.shared else target

    def probe(self, backend, rt, files, widest, **kw):
        assert not rt.closed
        w = min(self.widths[rt.pad_rows], widest)
        return Verdict(w, w >= widest)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("padded_width, kept", [(17, True), (1, False)])
def test_one_copy_open_while_settling(monkeypatch, shared, padded_width, kept):
    assert BACKENDS["onnxruntime"].exact_modes == ({"pad_rows": True},)
    models = Models({False: 1, True: padded_width}, shared)
    monkeypatch.setattr(exact_mode, "probe_exactness", models.probe)
    remembered = []
    with ExitStack() as stack:
        first = models.reopen()
        target, draft = first if shared else (first, None)
        stack.enter_context(target)
        settled = exact_mode.settle_exact_mode("onnxruntime", target, draft, [], 17, threads=2, retune=False,
                                               reopen=models.reopen, mode={}, stack=stack,
                                               remember=remembered.append)
        assert models.most == 1  # never the opened mode and the candidate at once
        assert settled.mode == ({"pad_rows": True} if kept else {}) and remembered == [settled.mode]
        assert settled.target.pad_rows is kept and not settled.target.closed
        assert (settled.shared_draft is not None) is shared
        if shared:
            assert settled.shared_draft.pad_rows is kept and not settled.shared_draft.closed
        # the candidate not kept: the mode kept opened again (no model is left without a runtime)
        assert models.opened == ([False, True] if kept else [False, True, False])
        assert len(models.open) == (2 if shared else 1)
    assert not models.open  # the stack closes what was kept


def test_exact_mode_opened_is_not_reopened(monkeypatch):
    models = Models({False: 17, True: 17}, shared=True)
    monkeypatch.setattr(exact_mode, "probe_exactness", models.probe)
    with ExitStack() as stack:
        target, draft = models.reopen()
        settled = exact_mode.settle_exact_mode("onnxruntime", target, draft, [], 17, threads=2, retune=False,
                                               reopen=models.reopen, mode={}, stack=stack, remember=None)
        assert settled.target is target and models.opened == [False]


@pytest.mark.parametrize("default_exact", [True, False], ids=["default-mode-exact", "padded-mode-exact"])
def test_a_budgeted_engine_opens_the_mode_an_unbudgeted_one_settles(zoo, tmp_path, monkeypatch, default_exact):
    """A budget plans the runtimes it opens: it must open the mode the machine settles, not the
    padded one by rule, or a budget would change the greedy text where the default mode is exact."""
    from edgespec import load
    from edgespec.runtimes import exactness
    from tests.zoo import AGREEING

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))

    def scripted(rt, max_width, *args, **kw):  # this machine's verdict, by mode
        pad = rt.capabilities.extra.get("pad_rows", False)
        exact = tuple(range(2, max_width + 1)) if pad is not default_exact else ()
        return exactness.Exactness(max_width, exact, 0.0 if exact else 1e-3, 1.0)

    monkeypatch.setattr(exactness, "probe", scripted)
    bundle = zoo.bundle("llama", AGREEING)
    # a budget counts the whole process, and a test process holds what earlier tests loaded
    with load(bundle, k=3, drafter="model", memory_budget=rss_bytes() + 2**30) as budgeted:
        padded = budgeted.target.capabilities.extra["pad_rows"]
        assert budgeted.memory_plan is not None and budgeted.exactness.fully_exact
        assert budgeted.drafter_name == "model"
        text = budgeted.generate("the cat", max_tokens=8)
    assert padded is (not default_exact)
    with load(bundle, k=3, drafter="model") as free:
        assert free.target.capabilities.extra["pad_rows"] is padded
        assert free.generate("the cat", max_tokens=8) == text
