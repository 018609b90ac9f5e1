"""`edgespec bench`: prompt suites, the interleaved measuring loop on one set of runtimes, the
versioned JSON schema (round trip), reports with real PNG plots, `compare`, and the CLI as a
user runs it (with torch and transformers blocked: the bench path must not need them)."""
from __future__ import annotations

import copy
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from edgespec.bench import (
    PLAIN,
    SPECULATIVE,
    SUITES,
    BenchConfig,
    Prompt,
    RunRecord,
    build_decoders,
    build_document,
    encode_prompt,
    load_prompts,
    load_runs,
    merge_runs,
    run_bench,
    save,
    summarise,
    validate,
)
from edgespec.bench.machine import cpu_model, isa_features
from edgespec.bench.schema import SCHEMA_VERSION
from edgespec.engine.engine import load
from edgespec.errors import ConfigError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# bench drafts only where verifies are bit-exact on this machine (the exactness probe); tiny fp32
# ONNX graphs round a verify ~1e-6 apart from one-token forwards on some CPUs: measure anyway
LENIENT = ("--allow-inexact",)
SMALL = [Prompt("story", "chat", messages=(("user", "the cat and the dog"),)),
         Prompt("repeat", "grounded", messages=(("user", "a b c d a b c d a b c d. Repeat it:"),)),
         Prompt("raw", "code", text="the dog and the")]
# runs torch-free: the CLI as an aarch64 box with only the runtime extras would run it
NO_TORCH = ("import sys\nfor m in ('torch', 'transformers', 'optimum', 'accelerate'): sys.modules[m] = None\n"
            "from edgespec.cli import run\nsys.argv[0] = 'edgespec'\nrc = run()\n"
            "assert not [m for m in ('torch', 'transformers') if sys.modules.get(m)], 'torch was imported'\n"
            "sys.exit(rc)\n")


def run_cli(*args: str, block_torch: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", NO_TORCH, *args] if block_torch else [sys.executable, "-m", "edgespec", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("edgespec: error:"), proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def png_ok(path: Path) -> bool:
    from matplotlib.image import imread

    data = path.read_bytes()
    return data[:8] == PNG_MAGIC and imread(path).shape[0] > 100


@pytest.fixture(scope="module")
def doc(zoo) -> dict:
    """One real bench run on the tiny llama bundle (int8 self-draft), as its JSON document."""
    cfg = BenchConfig(repeat=2, max_tokens=12, warmup=1, k_sweep=(2,))
    with load(zoo.bundle("llama"), drafter="both") as engine:
        runs = run_bench(engine, SMALL, cfg)
        configs = list(build_decoders(engine, cfg.k_sweep))
        return build_document(engine, runs, cfg, prompts_spec="test", configs=configs,
                              backend={"name": engine.backend}, memory={"engine": engine.memory()})


# ---------------------------------------------------------------- suites


def test_builtin_suites_are_varied_data():
    for name in SUITES:
        prompts = load_prompts(name)
        assert 6 <= len(prompts) <= 10, name
        assert {p.cls for p in prompts if p.is_chat} == {name}  # raw texts: the continuation class
        assert {p.cls for p in prompts if not p.is_chat} <= {"continuation"}
        assert len({p.id for p in prompts}) == len(prompts)
    everything = load_prompts("all")
    assert [p.cls for p in everything if p.is_chat] == sorted([p.cls for p in everything if p.is_chat],
                                                               key=SUITES.index)
    assert any(p.is_chat and len(p.messages) > 2 for p in everything)  # multi-turn
    assert any(p.is_chat and p.messages[0][0] == "system" for p in everything)
    assert any(not p.is_chat for p in load_prompts("code"))  # raw completions
    assert min(sum(len(c) for _, c in p.messages) for p in load_prompts("long")) > 2000  # ~500+ tokens
    assert [p.cls for p in load_prompts("code,chat")] == ["continuation"] * 5 + ["code"] * 3 + ["chat"] * 8


def test_prompt_file_and_bad_specs(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"id": "a", "text": "hello"}\n\n'
                 '{"id": "b", "class": "x", "messages": [{"role": "user", "content": "hi"}]}\n')
    ps = load_prompts(str(f))
    # a raw text without a class is a continuation; a chat prompt takes its record's class, else the file's
    assert [(p.cls, p.id, p.is_chat) for p in ps] == [("continuation", "a", False), ("x", "b", True)]
    with pytest.raises(ConfigError, match="unknown prompt suite nope"):
        load_prompts("chat,nope")
    with pytest.raises(ConfigError, match="not found"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    for bad, msg in (('{"id": "a"}', "exactly one"), ("{not json", "not valid JSON"),
                     ('{"id": "a", "messages": [{"role": "assistant", "content": "x"}]}', "last message"),
                     ('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}', "repeat")):
        f.write_text(bad)
        with pytest.raises(ConfigError, match=msg):
            load_prompts(str(f))


def test_chat_prompts_use_the_template_or_plain_text(zoo):
    chat = Prompt("q", "chat", messages=(("system", "be brief"), ("user", "the cat")))
    with load(zoo.bundle("qwen2")) as qwen, load(zoo.bundle("llama")) as llama:
        assert encode_prompt(qwen.tokenizer, chat) == qwen.tokenizer.encode_chat(
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}])
        assert not llama.tokenizer.has_chat_template  # falls back to a plain rendering
        assert llama.tokenizer.decode(encode_prompt(llama.tokenizer, chat)).endswith("Assistant:")


def test_cpu_model_names():
    assert cpu_model("processor\t: 0\nmodel name\t: AMD Ryzen 7 5800U\n") == "AMD Ryzen 7 5800U"
    pi = ("processor\t: 0\nCPU implementer\t: 0x41\nCPU part\t: 0xd08\n\nHardware\t: BCM2835\n"
          "Model\t: Raspberry Pi 4 Model B Rev 1.4\n")
    assert cpu_model(pi) == "Raspberry Pi 4 Model B Rev 1.4"
    assert cpu_model("processor\t: 0\nCPU implementer\t: 0x41\nCPU part\t: 0xd05\nCPU part\t: 0xd0d\n") == \
        "ARM implementer 0x41 part 0xd05/0xd0d"


EPYC_FLAGS = ("fpu vme sse sse2 ht syscall nx mmxext pdpe1gb lm pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 movbe "
              "popcnt aes xsave avx f16c rdrand hypervisor bmi1 avx2 smep bmi2 erms rdseed adx sha_ni vaes")
XEON_FLAGS = ("fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 avx512f avx512dq avx512cd avx512bw avx512vl "
              "avx_vnni avx512_bf16 avx512vbmi avx512_vnni avx512_fp16 amx_bf16 amx_tile amx_int8 arch_lbr")
PI5_FEATURES = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"
GRAVITON3_FEATURES = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc "
                      "dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp "
                      "svei8mm svebf16 i8mm bf16 dgh rng")


def test_isa_features_from_cpuinfo():
    x86 = "processor\t: {n}\nmodel name\t: {name}\nflags\t\t: {flags}\n\n"
    epyc = "".join(x86.format(n=n, name="AMD EPYC 7763 64-Core Processor", flags=EPYC_FLAGS) for n in (0, 1))
    assert isa_features(epyc) == ["FMA", "AVX", "F16C", "AVX2"]  # no AVX-512, no AMX
    xeon = x86.format(n=0, name="Intel(R) Xeon(R) Platinum 8480+", flags=XEON_FLAGS)
    assert isa_features(xeon) == [
        "FMA", "AVX", "F16C", "AVX2", "AVX-512F", "AVX-512DQ", "AVX-512CD", "AVX-512BW", "AVX-512VL", "AVX-VNNI",
        "AVX-512BF16", "AVX-512VBMI", "AVX-512VNNI", "AVX-512FP16", "AMX-BF16", "AMX-TILE", "AMX-INT8"]
    arm = "processor\t: 0\nBogoMIPS\t: 108.00\nFeatures\t: {f}\nCPU implementer\t: 0x41\nCPU part\t: 0xd0b\n\n"
    assert isa_features(arm.format(f=PI5_FEATURES)) == ["NEON", "FP16", "DOTPROD"]  # Cortex-A76: no i8mm
    assert isa_features(arm.format(f=GRAVITON3_FEATURES)) == ["NEON", "FP16", "DOTPROD", "SVE", "I8MM", "BF16"]
    armv7 = ("processor\t: 0\nmodel name\t: ARMv7 Processor rev 4 (v7l)\n"
             "Features\t: half thumb fastmult vfp edsp neon vfpv3\n")
    assert isa_features(armv7) == ["NEON"]
    assert isa_features("") == []  # macOS, Windows: no /proc/cpuinfo


# ---------------------------------------------------------------- measuring and summarising


def test_configs_share_the_loaded_runtimes(zoo):
    with load(zoo.bundle("llama"), drafter="model", k=3) as engine:
        decs = build_decoders(engine, (1, 2))
        assert list(decs) == [PLAIN, SPECULATIVE, "k=1", "k=2"]
        assert decs[SPECULATIVE] is engine.decoder
        assert all(d.target is engine.target for d in decs.values())  # the model is loaded once
        assert decs[PLAIN].drafter is None and decs["k=2"].policy.k == 2
        before = engine.generate("the cat", max_tokens=10)
        runs = run_bench(engine, SMALL[:1], BenchConfig(repeat=2, max_tokens=8, warmup=0))
        assert engine.generate("the cat", max_tokens=10) == before  # the engine is left usable
    assert len(runs) == 2 * 2  # repeats x (plain, speculative)
    firsts = [runs[i].config for i in (0, 2)]
    assert firsts[0] != firsts[1]  # the order rotates between repeats
    for r in runs:
        assert len(r.tokens) == 8 and r.ttft_s > 0 and r.total_s >= r.ttft_s
        assert r.tokens == runs[0].tokens  # greedy: every configuration commits the same tokens
        assert (r.drafted == 0) == (r.config == PLAIN)
    with load(zoo.bundle("llama"), drafter="none") as engine, pytest.raises(ConfigError, match="nothing to compare"):
        build_decoders(engine)


def test_context_limit_skips_prompts_and_limits_reach_every_decoder(zoo, caplog):
    """Under a memory budget (edgespec.memory) the engine fixes a context limit on its decoder."""
    short, long_ = SMALL[2], Prompt("long", "code", text="the cat and the dog " * 40)
    with load(zoo.bundle("llama"), drafter="none") as plain:
        limit = len(encode_prompt(plain.tokenizer, short)) + 6
    with load(zoo.bundle("llama"), drafter="model", k=2, max_context=limit) as engine:
        assert engine.context_limit == limit
        decs = build_decoders(engine, (1,))
        assert all(getattr(d, "context_limit", None) == engine.context_limit for d in decs.values())
        # the widths the exactness probe found exact here bound every decoder bench makes
        assert all(d.limits.verify_width == engine.decoder.limits.verify_width for d in decs.values())
        cfg = BenchConfig(repeat=1, max_tokens=6, warmup=0)
        runs = run_bench(engine, [short, long_], cfg)
        assert {r.prompt for r in runs} == {"raw"} and "skipping code/long" in caplog.text
        doc = build_document(engine, runs, cfg, prompts_spec="t", configs=list(decs)[:2], backend={},
                             memory={}, prompts=[short, long_])
        assert doc["skipped"] == ["code/long"]
        with pytest.raises(ConfigError, match="no prompt fits"):
            run_bench(engine, [long_], cfg)


def _rec(config, cls, prompt, rep, n, ttft, total, tokens=None, drafted=0, accepted=0):
    return RunRecord.timed(5, tokens or list(range(n)), ttft, total, steps=n, drafted=drafted, accepted=accepted,
                           draft_ms=1.0, verify_ms=3.0, config=config, cls=cls, prompt=prompt, repeat=rep,
                           peak_rss=100 + rep)


def test_summary_speed_is_a_ratio_of_totals():
    runs = [
        # plain: decode times 1.0, 1.2, 5.0 (a slow patch counts as it happened); 11 tokens -> 10 decoded each
        _rec(PLAIN, "c", "p", 0, 11, 0.1, 1.1), _rec(PLAIN, "c", "p", 1, 11, 0.1, 1.3),
        _rec(PLAIN, "c", "p", 2, 11, 0.1, 5.1),
        # speculative: decode 0.5, 0.6, 0.4
        _rec(SPECULATIVE, "c", "p", 0, 11, 0.2, 0.7, drafted=8, accepted=6),
        _rec(SPECULATIVE, "c", "p", 1, 11, 0.2, 0.8, drafted=8, accepted=6),
        _rec(SPECULATIVE, "c", "p", 2, 11, 0.2, 0.6, tokens=[0, 1, 2, 9] + list(range(4, 11)), drafted=8, accepted=6),
    ]
    s = summarise(runs, [PLAIN, SPECULATIVE])
    plain, spec = s["classes"]["c"][PLAIN], s["classes"]["c"][SPECULATIVE]
    assert plain["tok_s"] == pytest.approx(30 / 7.2) and spec["tok_s"] == pytest.approx(30 / 1.5)
    assert plain["tok_s_per_repeat"] == pytest.approx([10 / 1.0, 10 / 1.2, 10 / 5.0])
    assert spec["speedup"] == pytest.approx(7.2 / 1.5)
    assert spec["acceptance"] == pytest.approx(0.75) and plain["acceptance"] is None
    assert plain["ttft_ms"] == pytest.approx(100) and plain["prefill_tok_s"] == pytest.approx(50)
    assert spec["draft_share"] == pytest.approx(0.25)
    assert plain["peak_rss_bytes"] == 100  # first repeat only
    assert s["mismatches"] == [{"class": "c", "prompt": "p", "config": SPECULATIVE, "repeat": 2, "first_difference": 3}]
    assert spec["identical"] is False and plain["identical"] is True
    assert s["prompts"][0]["configs"][SPECULATIVE]["identical"] is False


def test_first_step_tokens_are_not_counted_without_their_time():
    """A first step that commits a whole accepted draft is timed with the prompt (ttft): its
    tokens leave the decode speed too, in the record and in the generation's own statistics."""
    from edgespec.decoding import GenerationStats
    from edgespec.decoding.speculative import StepResult

    st = GenerationStats(prompt_tokens=5)
    st.add(StepResult([1, 2, 3, 4], 3, 3, 1.0, 2.0), 0.5)  # prompt + first step: 4 tokens in 0.5 s
    st.add(StepResult([5, 6], 1, 1, 1.0, 2.0), 0.7)
    st.add(StepResult([7], 0, 0, 0.0, 2.0), 1.0)
    assert st.first_step_tokens == 4 and st.decode_tokens == 3
    assert st.tokens_per_s == pytest.approx(3 / 0.5)
    rec = RunRecord.from_stats(st, list(range(1, 8)), 1.0)
    assert rec.first_tokens == 4 and rec.decode_tokens == 3 and rec.tok_s == pytest.approx(3 / 0.5)
    # a first step of one token: the one token is left out, as before
    assert _rec(PLAIN, "c", "p", 0, 11, 0.1, 1.1).tok_s == pytest.approx(10 / 1.0)


def test_sampled_runs_are_not_required_to_match_plain():
    runs = [_rec(PLAIN, "c", "p", 0, 6, 0.1, 1.1), _rec(SPECULATIVE, "c", "p", 0, 6, 0.1, 0.6, tokens=[5] * 6)]
    greedy, sampled = summarise(runs, [PLAIN, SPECULATIVE]), summarise(runs, [PLAIN, SPECULATIVE], greedy=False)
    assert greedy["mismatches"] and greedy["overall"][SPECULATIVE]["identical"] is False
    assert sampled["mismatches"] == [] and sampled["overall"][SPECULATIVE]["identical"] is None


def test_bench_seeds_each_prompt_and_repeat():
    from edgespec.bench.measure import run_params
    from edgespec.decoding import SamplingParams

    greedy = SamplingParams()
    assert run_params(greedy, 3, 1) is greedy
    chat = SamplingParams(temperature=0.7, top_p=0.95, top_k=40, seed=7)
    seeds = {run_params(chat, i, rep).seed for i in range(4) for rep in range(3)}
    assert len(seeds) == 12  # every (prompt, repeat) its own
    assert run_params(chat, 2, 1) == run_params(chat, 2, 1)  # every configuration of one run the same
    assert run_params(chat, 2, 1).temperature == 0.7 and run_params(chat, 2, 1).top_k == 40



def test_a_sampled_bench_without_a_seed_warms_up_and_runs(zoo):
    """Warm-up runs take seeds apart from the measured runs', all valid without a --seed."""
    from edgespec.decoding import SamplingParams

    with load(zoo.bundle("llama"), drafter="model", k=2) as engine:
        cfg = BenchConfig(repeat=1, max_tokens=4, warmup=2, sampling=SamplingParams(temperature=0.7, top_k=40))
        runs = run_bench(engine, SMALL[:2], cfg)
    assert len(runs) == 2 * 2 and all(len(r.tokens) == 4 for r in runs)

# ---------------------------------------------------------------- schema, report, compare


def test_json_schema_round_trip(doc, tmp_path):
    assert doc["schema_version"] == SCHEMA_VERSION and doc["identical"] is True
    assert doc["configs"] == [PLAIN, SPECULATIVE, "k=2"]
    assert set(doc["classes"]) == {"chat", "grounded", "code"}
    for key in ("cpu", "cores_logical", "ram_bytes", "arch", "os", "python"):
        assert doc["machine"][key]
    assert isinstance(doc["machine"]["isa"], list)
    assert doc["exactness"] is None or doc["exactness"]["summary"]  # the engine's probe, once it has one
    assert "onnxruntime" in doc["libraries"] and doc["bundle"]["draft"]["precision"] == "int8"
    spec = doc["overall"][SPECULATIVE]
    assert spec["speedup"] > 0 and 0 <= spec["acceptance"] <= 1 and spec["by_draft_length"]
    assert doc["overall"]["k=2"]["by_draft_length"][-1]["k"] <= 2
    path = save(doc, tmp_path / "out" / "run.json")
    (loaded,) = load_runs(path)
    assert loaded == json.loads(json.dumps(doc))
    broken = copy.deepcopy(loaded)
    del broken["classes"]["chat"][SPECULATIVE]["tok_s"]
    for bad, msg in ((broken, "chat/speculative: missing field 'tok_s'"),
                     ({**loaded, "schema_version": 99}, "schema version 99"),
                     ({**loaded, "kind": "other"}, "not an edgespec bench result"),
                     ({**loaded, "identical": False}, "disagrees")):
        with pytest.raises(ConfigError, match=msg):
            validate(bad)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="cannot read"):
        load_runs(tmp_path / "bad.json")


COMMITTED = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def _with(doc: dict, path: tuple, value) -> dict:
    """`doc` with `value` at `path`, copying only the objects on the way."""
    head, *rest = path
    return {**doc, head: _with(doc[head], tuple(rest), value) if rest else value}


def test_committed_results_are_read_and_a_figure_of_the_wrong_kind_is_named():
    """Every committed version-2 result reads back; a field that is there but not a figure (a
    `true` where a rate or a count is meant, a NaN speed-up) is refused naming its place."""
    files = [p for p in COMMITTED.rglob("*.json") if '"schema_version": 2' in p.read_text()]
    assert len(files) >= 3, files
    runs = [run for p in files for run in load_runs(p)]
    run = max(runs, key=lambda r: len(r["configs"]))
    spec, cls = next(c for c in run["configs"] if c != PLAIN), next(iter(run["classes"]))
    for part, field, value, msg in (
            (("classes", cls), "acceptance", True, f"{cls}/{spec}: field 'acceptance' has the wrong type (bool)"),
            (("overall",), "acceptance", 1.5, f"overall/{spec}: field 'acceptance' must be less than or equal to 1"),
            (("overall",), "speedup", float("nan"), f"overall/{spec}: field 'speedup' is not a finite number"),
            (("overall",), "runs", 3.0, f"overall/{spec}: field 'runs' has the wrong type (float)")):
        bad = _with(run, (*part, spec, field), value)
        with pytest.raises(ConfigError, match=f"^x.json: {re.escape(msg)}$"):
            validate(bad, "x.json")
    for key, value, msg in (("machine", {**run["machine"], "cores_logical": True}, "machine: field 'cores_logical'"),
                            ("config", {k: v for k, v in run["config"].items() if k != "repeat"},
                             "config: missing field 'repeat'"),
                            ("duration_s", "12", "field 'duration_s' has the wrong type (str)")):
        with pytest.raises(ConfigError, match=re.escape(f"x.json: {msg}")):
            validate({**run, key: value}, "x.json")


def test_report_and_compare_merge_two_runs(doc, tmp_path):
    from edgespec.bench.report import PLOTS, write_report

    other = copy.deepcopy(doc)
    other["label"] = "raspberry-pi"
    other["machine"].update(cpu="Raspberry Pi 4 Model B", arch="aarch64")
    for block in [*other["classes"].values(), other["overall"]]:
        block[SPECULATIVE]["tok_s"] *= 0.5
    a, b = save(doc, tmp_path / "a.json"), save(other, tmp_path / "b.json")
    b_same_label = save({**doc}, tmp_path / "c.json")

    md = write_report([doc], tmp_path / "single")
    assert "| chat |" in md.read_text() and "WARNING" not in md.read_text()
    assert all(png_ok(tmp_path / "single" / p) for p in PLOTS)

    runs = merge_runs([a, b, b_same_label])
    assert [r["label"] for r in runs] == [doc["label"], "raspberry-pi", f"{doc['label']} [c]"]
    proc = run_cli("bench", "compare", str(a), str(b), "--report", str(tmp_path / "cmp"),
                   "--json", str(tmp_path / "merged.json"))
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "cmp" / "report.md").read_text()
    assert "## Comparison" in text and doc["label"] in text and "raspberry-pi" in text and "aarch64" in text
    for p in PLOTS:
        assert png_ok(tmp_path / "cmp" / p), p
    assert [r["label"] for r in load_runs(tmp_path / "merged.json")] == [doc["label"], "raspberry-pi"]


def test_report_warns_loudly_on_a_mismatch(doc, tmp_path):
    from edgespec.bench.report import markdown

    bad = copy.deepcopy(doc)
    bad["mismatches"] = [{"class": "chat", "prompt": "story", "config": SPECULATIVE, "repeat": 0,
                          "first_difference": 4}]
    bad["identical"] = False
    bad["classes"]["chat"][SPECULATIVE]["identical"] = False
    text = markdown([validate(bad)], [])
    assert "WARNING: greedy speculative output differed" in text and "chat/story" in text and "**NO**" in text


# ---------------------------------------------------------------- the CLI


def test_cli_bench_on_a_tiny_bundle_without_torch(zoo, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "text": "the cat and"}\n'
                       '{"id": "b", "class": "chat", "messages": [{"role": "user", "content": "the dog"}]}\n')
    out = tmp_path / "r.json"
    proc = run_cli("bench", str(zoo.bundle("qwen2")), "--prompts", str(prompts), "--repeat", "2",
                   "--max-tokens", "10", "--json", str(out), "--report", str(tmp_path / "rep"), "-k", "3",
                   "--label", "tiny", *LENIENT, block_torch=True)
    assert proc.returncode == 0, proc.stderr
    assert "speculative" in proc.stdout and "overall" in proc.stdout and "speed-up" in proc.stdout
    assert "running medians" in proc.stderr  # the live table, printed per pass when piped
    (doc,) = load_runs(out)
    assert doc["label"] == "tiny" and set(doc["classes"]) == {"continuation", "chat"} and doc["identical"]
    assert doc["config"]["k"] == 3 and doc["config"]["policy"] == "fixed" and doc["config"]["repeat"] == 2
    assert "chat template" in doc["bundle"]["chat_format"]  # the format chat picks for this bundle
    # the command's onnxruntime sessions shared the process-wide pool (runtimes/onnxruntime/pool.py)
    assert doc["backend"]["name"] == "onnxruntime" and doc["backend"]["onnxruntime_pool"]["allowed"]
    assert doc["backend"]["onnxruntime_pool"]["made"] is not None
    assert all(len(p["configs"][PLAIN]["tok_s"]) == 2 for p in doc["prompts"])
    assert (tmp_path / "rep" / "report.md").stat().st_size > 500
    assert png_ok(tmp_path / "rep" / "speed.png")


def test_cli_errors_are_one_line(zoo, tmp_path, capsys):
    from edgespec.cli import main

    def check(args, *needles):
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse
            code = e.code
        err = capsys.readouterr().err
        assert_one_line_error(subprocess.CompletedProcess(args, code, "", err), *needles)

    bundle = str(zoo.bundle("llama"))
    check(["bench", bundle, "--prompts", "poems"], "unknown prompt suite poems")
    check(["bench", bundle, "--repeat", "0"], "--repeat must be an integer >= 1")
    check(["bench", bundle, "--bogus"], "unrecognized arguments: --bogus")
    check(["bench", bundle, "--k-sweep", "1,x"], "--k-sweep")
    check(["bench", bundle, "--drafter", "none"], "nothing to compare")
    check(["bench", str(tmp_path / "nope")], "bundle not found")
    check(["bench", "compare", str(tmp_path / "x.json"), "--report", str(tmp_path)], "bench result not found")
    (tmp_path / "other.json").write_text('{"hello": 1}')
    check(["bench", "compare", str(tmp_path / "other.json"), "--report", str(tmp_path)], "not an edgespec bench result")
    check(["bench", "compare", "--report", str(tmp_path)], "required")
    # and as a user runs it
    assert_one_line_error(run_cli("bench", bundle, "--prompts", "poems"), "unknown prompt suite poems")


def test_memory_budget_flag(zoo, tmp_path):
    """Passed to edgespec.load only when given; a load without memory budgets says so in one line."""
    args = ("bench", str(zoo.bundle("llama")), "--prompts", "chat", "--repeat", "1", "--max-tokens", "4",
            "--warmup", "0", "--memory-budget", "1GB", "--json", str(tmp_path / "m.json"), *LENIENT)
    proc = run_cli(*args)
    if "memory_budget" not in inspect.signature(load).parameters:
        assert_one_line_error(proc, "--memory-budget is not supported")
    else:
        assert proc.returncode == 0, proc.stderr
        assert load_runs(tmp_path / "m.json")[0]["config"]["memory_budget"] == 1_000_000_000


def test_bench_imports_without_torch():
    code = ("import sys\nfor m in ('torch', 'transformers', 'optimum'): sys.modules[m] = None\n"
            "import edgespec.bench, edgespec.cli.bench, edgespec.bench.report, edgespec.bench.live\n"
            "edgespec.cli.bench.build_parser(); edgespec.cli.bench.build_compare_parser()\n"
            "print(sorted(m for m in ('onnxruntime', 'matplotlib') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"  # no backend and no matplotlib until they are used
