"""edgespec/deploy without a llama.cpp build: llama-server's --help read in llama.cpp's layout (a
removed flag is not a flag), the command with every speculative flag spelled out and a renamed one
refused, the bundle's models and chat template, the build cache's key, lock and atomic publish
(the compiler played by a stub), and llama-server's answers turned into bench records. The same
code against the real build: tests/test_deploy_server.py."""
from __future__ import annotations

import json
import re
import stat
import tempfile
import threading
from pathlib import Path

import pytest

from edgespec.bench.measure import PEER, PLAIN, SPECULATIVE, RunRecord, is_peer
from edgespec.bench.server_peer import completion_body, parse_peer, record_from_response, server_peer_name
from edgespec.bench.summary import mismatches, peer_key, summarise
from edgespec.decoding import SamplingParams
from edgespec.deploy import build as build_mod
from edgespec.deploy.command import NGRAM_SETTINGS, ServerCommand, ServerOptions, SpecSettings, server_argv
from edgespec.deploy.flags import FLAG_NAMES, parse_help
from edgespec.errors import DeployError

ROOT = Path(__file__).resolve().parents[1]

# llama.cpp's layout (common/arg.cpp common_arg::to_string): names from column 0, help at column 40
# or on the next line; a removed flag keeps its line
HELP = """----- common params -----

-h,    --help, --usage                  print usage and exit
-t,    --threads N                      number of CPU threads to use during generation (default: -1)
                                        (env: LLAMA_ARG_THREADS)
-tb,   --threads-batch N                number of threads to use during batch and prompt processing
-c,    --ctx-size N                     size of the prompt context (default: 0, 0 = loaded from model)
-np,   --parallel N                     number of server slots (default: -1, -1 = auto)
-s,    --seed SEED                      RNG seed (default: -1, use random seed for -1)
-m,    --model FNAME                    model path to load
--host HOST                             ip address to listen
--port PORT                             port to listen (default: 8080)
--metrics                               enable prometheus compatible metrics endpoint (default: disabled)
--jinja, --no-jinja                     whether to use jinja template engine for chat (default: enabled)
--chat-template-file JINJA_TEMPLATE_FILE
                                        set custom jinja chat template file
-ngl,  --gpu-layers, --n-gpu-layers N   max. number of layers to store in VRAM
--rpc SERVERS                           comma separated list of RPC servers (host:port)
--spec-draft-threads, -td, --threads-draft N
                                        number of threads to use during generation (default: same as
                                        --threads)
--spec-draft-threads-batch, -tbd, --threads-batch-draft N
                                        number of threads to use during batch and prompt processing
--spec-draft-device, -devd, --device-draft <dev1,dev2,..>
                                        comma-separated list of devices to use for offloading the draft
--spec-draft-ngl, -ngld, --gpu-layers-draft, --n-gpu-layers-draft N
                                        max. number of draft model layers to store in VRAM
--spec-draft-n-max N                    number of tokens to draft for speculative decoding (default: 3)
--spec-draft-n-min N                    minimum number of draft tokens to use for speculative decoding
--spec-draft-p-min, --draft-p-min P     minimum speculative decoding probability (greedy) (default: 0.00)
--spec-draft-model, -md, --model-draft FNAME
                                        draft model for speculative decoding (default: unused)
--spec-type none,draft-simple,draft-eagle3,ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache
                                        comma-separated list of types of speculative decoding to use
                                        (default: none)
--spec-ngram-mod-n-min N                minimum number of ngram tokens (default: 48)
--spec-ngram-mod-n-max N                maximum number of ngram tokens (default: 64)
--spec-ngram-mod-n-match N              ngram-mod lookup length (default: 24)
--spec-ngram-simple-size-n N            ngram size N for ngram-simple speculative decoding
--spec-ngram-simple-size-m N            ngram size M for ngram-simple speculative decoding
--spec-ngram-simple-min-hits N          minimum hits for ngram-simple speculative decoding (default: 1)
--spec-ngram-map-k-size-n N             ngram size N for ngram-map-k
--spec-ngram-map-k-size-m N             ngram size M for ngram-map-k
--spec-ngram-map-k-min-hits N           minimum hits for ngram-map-k
--spec-ngram-map-k4v-size-n N           ngram size N for ngram-map-k4v
--spec-ngram-map-k4v-size-m N           ngram size M for ngram-map-k4v
--spec-ngram-map-k4v-min-hits N         minimum hits for ngram-map-k4v
--draft, --draft-n, --draft-max N       the argument has been removed. use --spec-draft-n-max or
                                        --spec-ngram-mod-n-max
"""


def _help(text: str = HELP):
    return parse_help(text, "/opt/llama/llama-server")


def test_the_help_gives_names_hints_and_spec_types_and_leaves_removed_flags_out():
    h = _help()
    assert {"-t", "--threads", "--spec-draft-model", "-md", "--model-draft", "--jinja", "--no-jinja"} <= h.names
    assert {"--draft", "--draft-n", "--draft-max"} <= h.removed and not {"--draft-max"} & h.names
    assert "-----" not in h.names and not any(n.startswith("--threads)") for n in h.names)
    assert h.hints["--spec-draft-model"] == "FNAME" and h.hints["-t"] == "N"
    assert h.spec_types == ("none", "draft-simple", "draft-eagle3", "ngram-simple", "ngram-map-k", "ngram-map-k4v",
                            "ngram-mod", "ngram-cache")
    assert h.flag("draft_model") == "--spec-draft-model" and h.flag("threads") == "--threads"


def test_a_renamed_or_removed_speculative_flag_is_an_error_that_names_it():
    gone = "\n".join(ln for ln in HELP.splitlines() if not ln.startswith("--spec-draft-n-max"))
    h = _help(gone)
    with pytest.raises(DeployError, match=r"does not recognise --spec-draft-n-max \(--draft-max, --draft-n, "
                                          r"--draft: removed in this build\)"):
        server_argv(h, ServerOptions(model=Path("t.gguf"), spec=SpecSettings(type="draft-simple"),
                                     draft=Path("d.gguf")))
    # the plain command does not need it
    assert "--spec-draft-n-max" not in server_argv(h, ServerOptions(model=Path("t.gguf")))
    with pytest.raises(DeployError, match="has no speculative type 'ngram-mod'"):
        server_argv(_help(HELP.replace("ngram-mod,", "")), ServerOptions(model=Path("t.gguf"),
                                                                        spec=SpecSettings(type="ngram-mod")))


def _pairs(argv: list[str]) -> dict[str, str]:
    return {a: argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""
            for i, a in enumerate(argv) if a.startswith("-")}


def test_every_speculative_flag_is_spelled_out():
    h = _help()
    o = ServerOptions(model=Path("/b/target/model.gguf"), spec=SpecSettings(type="draft-simple", draft_n_max=6,
                      draft_n_min=1, draft_p_min=0.5), draft=Path("/b/draft/model.gguf"), context=2048,
                      threads=3, port=9000, parallel=1)
    got = _pairs(server_argv(h, o))
    assert got["--spec-type"] == "draft-simple" and got["--spec-draft-model"] == "/b/draft/model.gguf"
    assert (got["--spec-draft-n-max"], got["--spec-draft-n-min"], got["--spec-draft-p-min"]) == ("6", "1", "0.5")
    assert got["--spec-draft-threads"] == got["--spec-draft-threads-batch"] == got["--threads"] == "3"
    assert (got["--ctx-size"], got["--port"], got["--parallel"], got["--model"]) == ("2048", "9000", "1",
                                                                                    "/b/target/model.gguf")
    assert "--rpc" not in got and "--spec-draft-device" not in got
    # the plain command says so: a build whose default type changed would otherwise draft
    assert _pairs(server_argv(h, ServerOptions(model=Path("t.gguf"))))["--spec-type"] == "none"
    for kind, settings in NGRAM_SETTINGS.items():
        got = _pairs(server_argv(h, ServerOptions(model=Path("t.gguf"), spec=SpecSettings(type=kind))))
        assert got["--spec-type"] == kind
        assert {FLAG_NAMES[key][0]: str(v) for key, v in settings} == {k: got[k] for k in got if "ngram" in k}


def test_rpc_workers_take_the_targets_layers_and_the_draft_stays_here():
    o = ServerOptions(model=Path("t.gguf"), spec=SpecSettings(type="draft-simple"), draft=Path("d.gguf"),
                      rpc=("10.0.0.2:50052", "10.0.0.3:50052"))
    got = _pairs(server_argv(_help(), o))
    assert got["--rpc"] == "10.0.0.2:50052,10.0.0.3:50052" and got["--gpu-layers"] == "all"
    assert got["--spec-draft-device"] == "none" and got["--spec-draft-ngl"] == "0"
    for bad in ("10.0.0.2", "host:port", ":50052", "h:70000"):
        with pytest.raises(DeployError, match="HOST:PORT"):
            ServerOptions(model=Path("t.gguf"), rpc=(bad,))


def test_a_draft_goes_with_draft_simple_only_and_bad_settings_are_refused():
    with pytest.raises(DeployError, match="loads a draft without using it"):
        ServerOptions(model=Path("t.gguf"), draft=Path("d.gguf"))
    with pytest.raises(DeployError, match="draft-simple and only with it"):
        ServerOptions(model=Path("t.gguf"), spec=SpecSettings(type="draft-simple"))
    for kw in ({"type": "eagle"}, {"draft_n_max": 0}, {"draft_n_min": 9}, {"draft_p_min": 1.5}):
        with pytest.raises(DeployError):
            SpecSettings(**kw)
    with pytest.raises(DeployError, match="does not recognise --no-such-flag"):
        server_argv(_help(), ServerOptions(model=Path("t.gguf"), extra=("--no-such-flag", "1")))
    assert server_argv(_help(), ServerOptions(model=Path("t.gguf"), extra=("--seed", "-1")))[-2:] == ["--seed", "-1"]


def test_the_shell_form_has_one_flag_per_line_and_quotes_paths():
    argv = server_argv(_help(), ServerOptions(model=Path("/my models/t.gguf"), threads=2, port=8081))
    text = ServerCommand(argv=tuple(argv), options=ServerOptions(model=Path("t.gguf"))).shell()
    lines = text.split(" \\\n    ")
    assert lines[0] == "/opt/llama/llama-server" and "--model '/my models/t.gguf'" in lines
    assert all(re.match(r"^--?[a-z]", ln) for ln in lines[1:]), lines


# ---------------------------------------------------------------- the build cache

def test_the_pinned_version_is_pyprojects():
    pins = re.findall(r'"llama-cpp-python==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pins == [build_mod.LLAMA_CPP_PYTHON_PIN]


def test_the_build_key_follows_what_changes_the_binaries():
    o = build_mod.BuildOptions(version="0.3.36")
    key = build_mod.build_key(o, "gcc 12", "x86_64 | EPYC | avx2 avx512f")
    assert key.startswith("0.3.36-") and key == build_mod.build_key(build_mod.BuildOptions(version="0.3.36", jobs=8),
                                                                     "gcc 12", "x86_64 | EPYC | avx2 avx512f")
    assert key != build_mod.build_key(o, "gcc 13", "x86_64 | EPYC | avx2 avx512f")
    assert key != build_mod.build_key(o, "gcc 12", "x86_64 | Xeon | avx2")  # native: this CPU's instructions
    generic = build_mod.BuildOptions(version="0.3.36", cmake=(("GGML_NATIVE", "OFF"),))
    assert build_mod.build_key(generic, "gcc 12", "a") == build_mod.build_key(generic, "gcc 12", "b")
    with pytest.raises(DeployError):
        build_mod.BuildOptions(version="latest; rm -rf /")


def _fake_toolchain(monkeypatch, calls: list[str], delay: float = 0.0):
    """The sdist download and the compiler, played: 'binaries' that are shell scripts."""

    def fetch(version, work):
        calls.append("fetch")
        return work

    def compile_(source, build, options, log, progress):
        import time

        time.sleep(delay)
        (build / "bin").mkdir(parents=True)
        log.write_text("[1/1] linking\n")
        for name in build_mod.TARGETS:
            exe = build / "bin" / name
            exe.write_text("#!/bin/sh\necho built\n")
            exe.chmod(exe.stat().st_mode | stat.S_IEXEC)

    monkeypatch.setattr(build_mod, "_fetch_source", fetch)
    monkeypatch.setattr(build_mod, "_compile", compile_)
    monkeypatch.setattr(build_mod, "_check_tools", lambda: None)
    monkeypatch.delenv(build_mod.BIN_ENV, raising=False)


def test_one_build_for_concurrent_callers_published_whole_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    calls: list[str] = []
    _fake_toolchain(monkeypatch, calls, delay=0.3)
    results = []
    threads = [threading.Thread(target=lambda: results.append(build_mod.find_or_build(progress=False)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["fetch"] and len({r.folder for r in results}) == 1
    b = results[0]
    assert b.server.is_file() and b.rpc_server is not None and (b.folder / "rpc-server").resolve() == \
        (b.folder / "ggml-rpc-server").resolve()
    meta = json.loads((b.folder / build_mod.MANIFEST).read_text())
    assert meta["cmake"]["GGML_NATIVE"] == "ON" and meta["source"].startswith("llama-cpp-python")
    assert b.record()["cmake"] == meta["cmake"] and b.key == b.folder.name
    assert [p.name for p in b.folder.parent.iterdir() if not p.name.endswith(".lock")] == [b.folder.name]
    assert build_mod.find_or_build(progress=False) == b and calls == ["fetch"]  # cached: no second build


def test_a_killed_build_leaves_nothing_under_the_final_name(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    calls: list[str] = []
    _fake_toolchain(monkeypatch, calls)

    def broken(source, build, options, log, progress):
        log.write_text("foo.cpp:1: error: it broke\n")
        raise DeployError("llama.cpp compile failed (exit 1)")

    monkeypatch.setattr(build_mod, "_compile", broken)
    with pytest.raises(DeployError, match="error: it broke.*whole log"):
        build_mod.find_or_build(progress=False)
    root = build_mod.cache_root()
    assert build_mod.find_build() is None and not [p for p in root.iterdir() if p.is_dir()]
    (root / f".{next(root.glob('*.failed.log')).name.split('.failed')[0]}.stale").mkdir()  # a dead staging folder
    _fake_toolchain(monkeypatch, calls)
    assert build_mod.find_or_build(progress=False).server.is_file()
    assert not list(root.glob(".*.stale"))


def test_the_env_folder_wins_and_a_folder_without_llama_server_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv(build_mod.BIN_ENV, str(tmp_path))
    with pytest.raises(DeployError, match="holds no executable llama-server"):
        build_mod.find_build()
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    found = build_mod.locate()
    assert found.server == exe and found.rpc_server is None and build_mod.BIN_ENV in found.source
    assert build_mod.locate(exe).server == exe
    with pytest.raises(DeployError, match="not an executable llama-server"):
        build_mod.locate(tmp_path / "nope")


# ---------------------------------------------------------------- llama-server as a bench peer

def test_a_completion_request_is_the_benchs_sampling_and_nothing_else():
    greedy = completion_body([1, 5, 9], 16, SamplingParams(), stop_at_eos=False)
    assert greedy["prompt"] == [1, 5, 9] and greedy["n_predict"] == 16 and greedy["cache_prompt"] is False
    assert (greedy["temperature"], greedy["top_k"], greedy["min_p"], greedy["repeat_penalty"]) == (0.0, 1, 0.0, 1.0)
    assert greedy["ignore_eos"] is True and greedy["samplers"] == ["top_k", "top_p", "min_p", "temperature"]
    sampled = completion_body([1], 4, SamplingParams(temperature=0.7, top_p=0.95, top_k=40, seed=3), stop_at_eos=True)
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"], sampled["min_p"]) == (0.7, 0.95, 40, 0.0)
    assert sampled["seed"] == 3 and sampled["ignore_eos"] is False


def test_a_servers_answer_is_timed_by_its_own_clock():
    doc = {"tokens": [4, 5, 6, 2, 7], "timings": {"prompt_ms": 20.0, "predicted_ms": 30.0, "predicted_n": 5,
                                                  "draft_n": 6, "draft_n_accepted": 2}}
    rec = record_from_response(doc, prompt_len=3)
    assert rec.tokens == [4, 5, 6, 2, 7] and rec.ttft_s == pytest.approx(0.02) and rec.decode_s == pytest.approx(0.03)
    assert rec.tok_s == pytest.approx(4 / 0.03)  # llama-server's predicted_per_second: tokens after the first
    assert (rec.drafted, rec.accepted, rec.steps) == (6, 2, 3)
    assert record_from_response(doc, 3, stop_ids=[2]).tokens == [4, 5, 6, 2]
    with pytest.raises(DeployError, match="no timings"):
        record_from_response({"tokens": [1]}, 1)


def test_peer_names():
    assert server_peer_name("none") == "llama-server" and server_peer_name("ngram-mod") == "llama-server+ngram-mod"
    assert parse_peer("llama-server") == "none" and parse_peer("llama-server+draft-simple") == "draft-simple"
    assert all(map(is_peer, (PEER, "llama-server", "llama-server+ngram-simple")))
    assert not any(map(is_peer, (PLAIN, SPECULATIVE, "k=4", "llama-serverx")))
    assert peer_key(PEER) == "x_llamacpp" and peer_key("llama-server+ngram-simple") == "x_llama_server_ngram_simple"


def _rec(config, prompt, repeat, decode_s, tokens, drafted=0, accepted=0):
    return RunRecord.timed(4, list(tokens), 0.1, 0.1 + decode_s, steps=len(tokens), drafted=drafted,
                           accepted=accepted, config=config, cls="chat", prompt=prompt, repeat=repeat)


def test_every_peer_gets_its_own_ratio_and_agreement_and_none_is_a_mismatch():
    same, other = [1, 2, 3, 4, 5, 6], [1, 2, 9, 9, 9, 9]
    runs = [_rec(PLAIN, "a", 0, 1.0, same), _rec(SPECULATIVE, "a", 0, 0.5, same, 4, 3),
            _rec(PEER, "a", 0, 2.0, same), _rec("llama-server", "a", 0, 1.25, other),
            _rec("llama-server+ngram-simple", "a", 0, 0.8, other, 5, 2)]
    configs = [PLAIN, SPECULATIVE, PEER, "llama-server", "llama-server+ngram-simple"]
    s = summarise(runs, configs)
    o = s["overall"]
    assert o[SPECULATIVE]["x_llamacpp"] == pytest.approx(2.0 / 0.5)
    assert o[SPECULATIVE]["x_llama_server"] == pytest.approx(1.25 / 0.5)
    assert o[PLAIN]["x_llama_server_ngram_simple"] == pytest.approx(0.8 / 1.0)
    assert o["llama-server"]["agree_tokens"] == 2 and o[PEER]["agree_tokens"] == 6
    assert o["llama-server+ngram-simple"]["acceptance"] == pytest.approx(0.4)
    assert "speedup" not in o["llama-server"] and not mismatches({(r.cls, r.prompt, r.config): [r] for r in runs})
    row = s["prompts"][0]["configs"]
    assert row["llama-server"]["agree_tokens"] == 2 and row[SPECULATIVE]["x_llama_server_paired"] == pytest.approx(2.5)


def test_auto_drafts_with_the_bundles_draft_only_where_it_can_pay(tmp_path):
    from edgespec.deploy.command import DeployConfig, _resolve_spec

    target, cheap, dear = tmp_path / "t.gguf", tmp_path / "cheap.gguf", tmp_path / "dear.gguf"
    target.write_bytes(b"x" * 1000)
    cheap.write_bytes(b"x" * 200)
    dear.write_bytes(b"x" * 790)  # a layer-cut draft that keeps a large vocabulary's head
    cfg = DeployConfig(bundle="b")
    spec, draft, notes = _resolve_spec(cfg, target, cheap, False)
    assert (spec.type, draft, notes) == ("draft-simple", cheap, [])
    spec, draft, notes = _resolve_spec(cfg, target, dear, False)
    assert (spec.type, draft) == ("ngram-simple", None) and "79% of the target's weight bytes" in notes[0]
    assert _resolve_spec(cfg, target, target, True)[0].type == "ngram-simple"
    assert _resolve_spec(cfg, target, None, False)[0].type == "ngram-simple"
    # asked for, it is what runs (with a note when the draft is the target itself)
    spec, draft, notes = _resolve_spec(DeployConfig(bundle="b", spec="draft-simple"), target, dear, False)
    assert (spec.type, draft) == ("draft-simple", dear)
    with pytest.raises(DeployError, match="needs a standalone draft"):
        _resolve_spec(DeployConfig(bundle="b", spec="draft-simple"), target, None, False)


def test_an_ngram_setting_can_be_changed_and_only_its_own_types():
    spec = SpecSettings(type="ngram-mod", ngram=(("ngram_mod_n_match", 8),))
    got = _pairs(server_argv(_help(), ServerOptions(model=Path("t.gguf"), spec=spec)))
    assert (got["--spec-ngram-mod-n-match"], got["--spec-ngram-mod-n-min"]) == ("8", "48")
    with pytest.raises(DeployError, match="ngram_simple_size_n: not a setting of ngram-mod"):
        SpecSettings(type="ngram-mod", ngram=(("ngram_simple_size_n", 4),))


def test_a_server_that_dies_at_start_is_one_error_quoting_its_log(tmp_path, monkeypatch):
    import sys

    from edgespec.deploy.process import ServerProcess, child_env, free_port

    argv = [sys.executable, "-c", "import sys; print('error: model file is damaged'); sys.exit(3)"]
    with pytest.raises(DeployError, match=r"exited with 3 before it was ready: error: model file is damaged \(log: "):
        ServerProcess(argv, host="127.0.0.1", port=free_port(), timeout=30)
    kept = [p for p in Path(tempfile.gettempdir()).glob("edgespec-python*.log") if "damaged" in p.read_text()]
    assert kept  # the log a failure quotes stays
    for p in kept:
        p.unlink()
    monkeypatch.setenv("LLAMA_ARG_SPEC_TYPE", "ngram-mod")
    assert "LLAMA_ARG_SPEC_TYPE" not in child_env() and "PATH" in child_env()
