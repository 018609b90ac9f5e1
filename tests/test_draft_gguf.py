"""`--draft FILE.gguf`: a user's smaller GGUF of the target's tokenizer drafts for it, checked by
llama.cpp's own pairing rule (same vocabulary type, BOS/EOS, sizes within 128, identical token
texts from id 5 on); a pair that breaks it is a one-line error naming the first mismatch."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

pytest.importorskip("gguf")

from edgespec.bundle import load_bundle  # noqa: E402
from edgespec.errors import ExportError  # noqa: E402
from edgespec.exporters.export import ExportConfig, export_bundle  # noqa: E402
from edgespec.exporters.gguf import passthrough  # noqa: E402
from edgespec.exporters.gguf.reader import open_gguf  # noqa: E402
from edgespec.exporters.gguf.vocab_check import (  # noqa: E402
    VocabFacts,
    check_compatible,
    incompatibility,
    vocab_facts,
)
from tests.test_export_onnx import decode  # noqa: E402
from tests.test_gguf_passthrough import make_wide_gguf  # noqa: E402
from tests.tiny import PROMPTS  # noqa: E402

N_NEW = 12
BASE = VocabFacts(kind="gpt2", tokens=tuple(f"t{i}".encode() for i in range(300)), bos=1, eos=2,
                  add_bos=True, add_eos=False)


def test_rule_accepts_the_same_vocabulary_and_a_few_extra_rows():
    assert incompatibility(BASE, BASE) is None
    # llama.cpp allows up to 128 more or fewer tokens, and ignores ids below 5
    longer = replace(BASE, tokens=BASE.tokens + tuple(b"x%d" % i for i in range(128)))
    assert incompatibility(BASE, longer) is None
    renamed_low = replace(BASE, tokens=(b"<other>",) + BASE.tokens[1:])
    assert incompatibility(BASE, renamed_low) is None


@pytest.mark.parametrize("draft, words", [
    (replace(BASE, kind="llama"), "vocabulary types differ"),
    (replace(BASE, bos=3), "BOS token ids differ"),
    (replace(BASE, add_eos=True), "adding EOS differs"),
    (replace(BASE, tokens=BASE.tokens + tuple(b"x%d" % i for i in range(129))), "sizes differ by more than 128"),
    (replace(BASE, tokens=BASE.tokens[:40] + (b"zz",) + BASE.tokens[41:]),
     "token 40 differs (target 't40', draft 'zz')"),
])
def test_rule_names_the_first_mismatch(draft, words):
    assert words in incompatibility(BASE, draft)
    with pytest.raises(ExportError) as e:
        check_compatible(BASE, draft, "small.gguf")
    assert "small.gguf" in str(e.value) and words in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target, draft): fp32 GGUFs of the same tokenizer, the draft shallower and narrower."""
    root = tmp_path_factory.mktemp("pair")
    target = make_wide_gguf(root / "big.gguf", seed=0, layers=2, hidden=64)
    draft = make_wide_gguf(root / "small.gguf", seed=1, layers=1, hidden=32)
    return target, draft


def test_the_pair_passes_the_rule_read_from_the_files(pair):
    t, d = (vocab_facts(open_gguf(p)) for p in pair)
    assert t.tokens == d.tokens and len(t.tokens) > 100 and incompatibility(t, d) is None


def _greedy(bundle, backend: str, use_draft: bool) -> tuple[list[list[int]], int]:
    from edgespec.engine.engine import load

    outs, drafted = [], 0
    kw = dict(k=4, drafter="model") if use_draft else dict(use_draft=False)
    with load(bundle, backend=backend, **kw) as engine:
        for prompt in PROMPTS:
            out, d, _ = decode(engine, engine.tokenizer.encode(prompt), N_NEW)
            outs.append(out)
            drafted += d
    return outs, drafted


@pytest.mark.parametrize("fmt, backend", [("gguf", "llamacpp"), ("onnx", "onnxruntime")])
def test_a_user_draft_gguf_exports_and_decodes_exactly(pair, tmp_path, fmt, backend):
    pytest.importorskip("llama_cpp" if backend == "llamacpp" else "onnxruntime")
    target, draft = pair
    out = export_bundle(ExportConfig(output=tmp_path / "b", target=target, draft=draft, formats=(fmt,)))
    m = load_bundle(out).manifest
    assert not m.self_draft and m.draft.source["name"] == "small.gguf"
    assert m.draft.n_layers == 1 and m.target.n_layers == 2
    if fmt == "gguf":  # the user's draft file as it is, standalone for llama.cpp's server too
        art = m.draft.formats["gguf"]
        assert (out / art.file).read_bytes() == draft.read_bytes()
        assert art.quantization["standalone"] == art.file
    plain, _ = _greedy(out, backend, use_draft=False)
    spec, drafted = _greedy(out, backend, use_draft=True)
    assert drafted > 0 and all(len(set(p)) > 2 for p in plain)
    assert spec == plain


def test_a_draft_of_another_vocabulary_is_one_line_naming_the_token(pair, tmp_path):
    target, draft = pair
    reader = open_gguf(draft)
    meta = passthrough._metadata(reader, "llama", 0, None)
    tokens, kind, sub = meta["tokenizer.ggml.tokens"]
    was = tokens[10]
    meta["tokenizer.ggml.tokens"] = (tokens[:10] + ["zzzz"] + tokens[11:], kind, sub)
    bad = tmp_path / "other.gguf"
    passthrough._write(bad, "llama", meta, passthrough._plan(reader, None, None), draft)
    out = tmp_path / "b"
    proc = subprocess.run([sys.executable, "-m", "edgespec", "export", "--target", str(target), "--draft", str(bad),
                           "--format", "gguf", "-o", str(out)], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "other.gguf" in lines[0] and f"token 10 differs (target {was!r}, draft 'zzzz')" in lines[0], lines[0]
    assert not out.exists()
