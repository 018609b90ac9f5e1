"""Hostile inputs to the bundle loader, the exporter's output folder, the CLI and the Python API
(issue 27): each is one typed error or one line on stderr, never a traceback, and nothing the
user had is lost or left behind. The server's share is in test_hardening_server.py."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from edgespec.bundle import MANIFEST, Manifest, inside_bundle, load_bundle
from edgespec.errors import BackendError, BundleError, ConfigError, ContextFullError, MemoryBudgetError
from tests.zoo import AGREEING

hypothesis = pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (pip install 'edgespec[test]')")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def cli(*args: str, stdin: bytes | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgespec", *args], input=stdin, capture_output=True,
                          timeout=300, env={**os.environ, **(env or {})})


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode not in (0, None), err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("edgespec: error:"), err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def bundle_error(path: Path) -> str:
    with pytest.raises(BundleError) as info:
        load_bundle(path)
    msg = str(info.value)
    assert msg and "\n" not in msg, msg
    return msg


@pytest.fixture
def bundle(zoo, tmp_path) -> Path:
    return Path(shutil.copytree(zoo.bundle("llama"), tmp_path / "bundle"))


def edit(path: Path, change) -> None:
    data = json.loads((path / MANIFEST).read_text())
    change(data)
    (path / MANIFEST).write_text(json.dumps(data))


# -- item 6: manifest values are type- and path-checked ------------------------------------

def _set(keys: tuple, value):
    def change(d):
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return change


@pytest.mark.parametrize("keys, value, needle", [
    (("tokenizer", "stop_token_ids"), "1", "tokenizer.stop_token_ids must be a list of integers"),
    (("tokenizer", "stop_token_ids"), ["1"], "tokenizer.stop_token_ids must be a list of integers"),
    (("tokenizer", "stop_token_ids"), [-1], "must not be negative"),
    (("tokenizer", "add_bos"), "yes", "tokenizer.add_bos must be true or false"),
    (("tokenizer", "chat_template"), 7, "tokenizer.chat_template must be a string or null"),
    (("base_model",), "no", "base_model must be true or false"),
    (("target", "n_layers"), True, "target.n_layers must be an integer"),
    (("target", "n_layers"), 0, "target.n_layers must be >= 1"),
    (("target", "vocab_size"), "32", "target.vocab_size must be an integer"),
    (("target", "layers"), [0.5], "target.layers must be a list of integers or null"),
    (("target", "formats"), [], "target.formats must be an object"),
    (("target", "source"), "hf", "target.source must be an object"),
    (("draft",), "self", "draft must be an object"),
    (("schema_version",), True, "schema version True is not supported"),
])
def test_wrong_types_are_one_line(bundle, keys, value, needle):
    edit(bundle, _set(keys, value))
    assert needle in bundle_error(bundle)


@pytest.mark.parametrize("rel", ["../outside.json", "/etc/passwd", "a/../../b", "C:\\x\\tok.json", "..\\x", ""])
def test_paths_outside_the_bundle_are_refused(bundle, rel):
    edit(bundle, _set(("tokenizer", "file"), rel))
    assert "tokenizer.file must be a relative path inside the bundle" in bundle_error(bundle)
    edit(bundle, _set(("tokenizer", "file"), "tokenizer.json"))
    edit(bundle, lambda d: d["target"]["formats"]["onnx"].update(file=rel))
    assert "target.formats.onnx.file" in bundle_error(bundle)


def test_a_symlink_out_of_the_bundle_is_refused(bundle, tmp_path):
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    tok = json.loads((bundle / MANIFEST).read_text())["tokenizer"]["file"]
    (bundle / tok).unlink()
    (bundle / tok).symlink_to(outside)
    assert "points outside the bundle folder" in bundle_error(bundle)


def test_inside_bundle_allows_subfolders(bundle):
    assert inside_bundle(bundle, "draft/x.npy") == bundle / "draft/x.npy"


def test_llamacpp_refuses_an_embedding_file_named_outside_the_bundle(tmp_path):
    pytest.importorskip("llama_cpp")
    from edgespec.runtimes.llamacpp.runtime import EMBD_KEYS, LlamaCppRuntime

    # the GGUF's metadata names the draft's embedding file: a hostile file names ../../secret
    fake = SimpleNamespace(_meta=lambda key: "../../secret.gguf" if key == EMBD_KEYS["file"] else None, _n_embd=8)
    with pytest.raises(BackendError, match="relative path inside the bundle"):
        LlamaCppRuntime._input_embedding(fake, tmp_path / "draft" / "draft.gguf")


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
                     max_leaves=8)


def _paths(d, prefix=()):
    yield prefix
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _paths(v, prefix + (k,))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_manifests_never_raise_anything_but_bundle_errors(zoo, bundle, data):
    d = json.loads((zoo.bundle("llama") / MANIFEST).read_text())  # the original, not the copy being broken
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from([p for p in _paths(d) if p]))
        target = d
        for k in path[:-1]:
            target = target[k]
        if data.draw(st.booleans()) and isinstance(target, dict):
            del target[path[-1]]
        else:
            target[path[-1]] = data.draw(_JSON)
        if not isinstance(d, dict):
            break
    (bundle / MANIFEST).write_text(json.dumps(d, allow_nan=True))
    try:
        b = load_bundle(bundle)
    except BundleError as e:
        assert str(e) and "\n" not in str(e)
    else:  # what loads names only files inside the bundle
        for entry in filter(None, (b.manifest.target, b.manifest.draft)):
            for art in entry.formats.values():
                assert b.file(art.file).resolve().is_relative_to(bundle.resolve())


@pytest.mark.parametrize("where", [("tokenizer",), ("target", "formats")])
@pytest.mark.parametrize("key", ["\n", "a\nb" * 30, "\u2028"])
def test_a_manifest_key_with_a_newline_still_gives_a_one_line_error(zoo, bundle, where, key):
    # found by the fuzz test in CI: an unexpected key was printed raw
    d = json.loads((zoo.bundle("llama") / MANIFEST).read_text())
    (d[where[0]] if len(where) == 1 else d[where[0]][where[1]])[key] = None
    (bundle / MANIFEST).write_text(json.dumps(d))
    with pytest.raises(BundleError) as e:
        load_bundle(bundle)
    assert len(str(e.value).splitlines()) == 1 and len(str(e.value)) < 200


@settings(max_examples=200, deadline=None)
@given(raw=_JSON)
def test_fuzz_any_json_value_as_a_manifest(raw):
    try:
        Manifest.from_dict(raw)
    except BundleError as e:
        assert "\n" not in str(e)


def test_unwritable_compile_cache_turns_caching_off(tmp_path, monkeypatch, caplog):
    from edgespec.runtimes.openvino.compile_cache import compile_cache_dir

    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("EDGESPEC_CACHE", str(blocker / "cache"))
    model = tmp_path / "m.xml"
    model.write_text("<net/>")
    assert compile_cache_dir(model, "CPU") is None
    assert "compile cache off" in caplog.text


def test_compile_cache_eviction_waits_for_the_cross_process_lock(tmp_path, monkeypatch, caplog):
    pytest.importorskip("filelock")
    from edgespec.runtimes.openvino import compile_cache

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("EDGESPEC_COMPILE_CACHE_MB", "1")
    monkeypatch.setattr(compile_cache, "LOCK_TIMEOUT_S", 0.2)
    root = tmp_path / "cache" / "openvino"
    old = root / "old"
    old.mkdir(parents=True)
    (old / "blob").write_bytes(b"\0" * (2 << 20))  # over the 1 MB cap
    os.utime(old, (1, 1))
    model = tmp_path / "m.xml"
    model.write_text("<net/>")
    # another process holds the lock (a child, so the lock is truly another process's)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from filelock import FileLock; "
                               f"l = FileLock({str(root / compile_cache.LOCK_NAME)!r}); l.acquire(); "
                               "print('held', flush=True); time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert compile_cache.compile_cache_dir(model, "CPU") is not None
        assert old.exists() and "holds its lock" in caplog.text  # not pruned behind the holder's back
    finally:
        holder.kill()
        holder.wait()
    compile_cache.compile_cache_dir(model, "CPU")
    assert not old.exists()  # with the lock free, the least recently used folder goes


# -- item 10: the CLI ------------------------------------------------------------------------

def test_empty_prompt_is_refused_before_loading():
    one_line_error(cli("generate", "no-such-bundle", ""), "the prompt is empty")
    one_line_error(cli("generate", "no-such-bundle", "-", stdin=b""), "the prompt is empty")


def test_invalid_utf8_on_stdin_is_one_line():
    one_line_error(cli("generate", "no-such-bundle", "-", stdin=b"caf\xe9 au lait"), "not UTF-8", "0xe9")


def test_generate_into_a_closed_pipe_is_quiet(zoo):
    bundle = zoo.bundle("llama")
    proc = subprocess.Popen([sys.executable, "-m", "edgespec", "generate", str(bundle), "the cat",
                             "--max-tokens", "400"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(1)  # `| head -c 1`: read a byte, then hang up
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert proc.returncode == 141


def test_invalid_utf8_in_argv_is_one_line(zoo):
    # Python turns a bad byte in argv into a lone surrogate; refused before the model loads
    proc = subprocess.run([sys.executable.encode(), b"-m", b"edgespec", b"generate",
                           str(zoo.bundle("llama")).encode(), b"caf\xe9"], capture_output=True, timeout=300)
    one_line_error(proc, "the prompt is not UTF-8 text (byte 0xe9 at offset 3)")


# -- items 4 and 8: the Python API -------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(zoo):
    from edgespec.engine.engine import load

    with load(zoo.bundle("llama"), max_context=64) as e:
        yield e


@pytest.mark.parametrize("ids, needle", [([5, -1, 7], "token id -1 is out of range"),
                                         ([5, 10**9], "token id 1000000000 is out of range"),
                                         ([True, 5], r"item 0 is True \(bool\)"),
                                         ([5.0, 6], r"item 0 is 5.0 \(float\)"),
                                         (["hello"], r"item 0 is 'hello' \(str\)")])
def test_bad_token_ids_are_config_errors(engine, ids, needle):
    with pytest.raises(ConfigError, match=needle):
        engine.generate(ids, max_tokens=2)
    with pytest.raises(ConfigError):
        next(engine.stream_ids(list(ids), engine_params(), 2))
    assert engine.generate([5, 6], max_tokens=2) is not None  # the engine still works


def engine_params():
    from edgespec.decoding import SamplingParams

    return SamplingParams()


@pytest.mark.parametrize("prompt, needle", [("", "the prompt is empty"),
                                            ("ok \ud800 then", "not valid Unicode text")])
def test_bad_prompts_are_config_errors(engine, prompt, needle):
    with pytest.raises(ConfigError, match=needle):
        engine.generate(prompt, max_tokens=2)


def test_prompt_longer_than_the_context(engine):
    with pytest.raises(ContextFullError, match="context holds 64"):
        engine.generate(list(range(3, 80)), max_tokens=2)


@pytest.mark.parametrize("budget", ["nan", "inf", "9" * 400 + "GB", "1.5 parsecs", "-1GB", float("nan"), [1]])
def test_bad_budgets_are_memory_budget_errors(zoo, budget):
    from edgespec.engine.engine import load

    with pytest.raises(MemoryBudgetError) as info:
        load(zoo.bundle("llama"), memory_budget=budget)
    assert "\n" not in str(info.value)


# -- item 9: backends ---------------------------------------------------------------------------

def test_openvino_reasons_survive():
    from edgespec.runtimes.openvino.runtime import ov_reason

    e = RuntimeError("Exception from src/inference/src/cpp/core.cpp:97:\n"
                     "Exception from src/frontends/ir/src/ir_deserializer.cpp:1022:\n"
                     "Cannot create Parameter layer input_ids id:0 from unsupported opset: opset99\n\n")
    assert ov_reason(e) == "Cannot create Parameter layer input_ids id:0 from unsupported opset: opset99"


def test_openvino_has_a_context_limit(zoo):
    pytest.importorskip("openvino")
    from edgespec.runtimes.openvino.runtime import DEFAULT_KV_CAPACITY, OpenVinoRuntime

    b = load_bundle(zoo.bundle("llama", None, formats=("openvino",)))
    path = b.file(b.manifest.target.formats["openvino"].file)
    rt = OpenVinoRuntime(path, threads=1)
    assert rt.kv_capacity == DEFAULT_KV_CAPACITY == 4096
    small = OpenVinoRuntime(path, threads=1, kv_capacity=8)
    small.forward([3, 4, 5, 6, 7, 8])
    with pytest.raises(ContextFullError, match="the context is full"):
        small.forward([3, 4, 5])
    assert small.n_past == 6
    with pytest.raises(BackendError) as info:  # a broken IR: the reason, not a source location
        broken = path.with_name("broken.xml")
        broken.write_text("<net name='x' version='11'><layers><layer id='0' type='Nope'/></layers></net>")
        OpenVinoRuntime(broken, threads=1)
    assert not str(info.value).rstrip().endswith(":") and "Exception from" not in str(info.value)


def test_llamacpp_context_full_is_a_context_full_error(zoo):
    pytest.importorskip("llama_cpp")
    from edgespec.runtimes.llamacpp.runtime import LlamaCppRuntime

    b = load_bundle(zoo.bundle("llama", None, formats=("gguf",)))
    rt = LlamaCppRuntime(b.file(b.manifest.target.formats["gguf"].file), threads=1, kv_capacity=8)
    rt.forward([3, 4, 5, 6, 7, 8])
    with pytest.raises(ContextFullError, match="the context is full"):
        rt.forward([3, 4, 5])
    assert rt.n_past == 6


def test_a_failed_load_closes_what_it_opened(zoo, monkeypatch):
    """Engine construction failing after the runtimes opened (here: building the decoder) leaves
    none of them open (issue 27, item 10)."""
    import edgespec.engine.engine as api
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    closed: list[OnnxRuntime] = []
    close = OnnxRuntime.close
    monkeypatch.setattr(OnnxRuntime, "close", lambda self: (closed.append(self), close(self))[1])

    def broken(*args, **kwargs):
        raise ConfigError("decoder refused")

    monkeypatch.setattr(api, "SpeculativeDecoder", broken)
    with pytest.raises(ConfigError, match="decoder refused"):
        api.load(zoo.bundle("llama", AGREEING), drafter="model", k=2)
    assert len(closed) >= 2 and all(rt._sess is None for rt in closed)  # the target and the draft
