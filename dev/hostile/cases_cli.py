"""Hostile inputs through the CLI: broken bundles and templates, export and distill inputs, hostile
GGUF metadata, generate's prompts and options, serve's flags, signals during an export."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fixtures import Fixtures, claim_array, leftovers, rewrite_gguf, tree_digest
from outcome import DATA_LOST, HANG, LEFT_BEHIND, ONE_LINE, SUCCESS, Outcome, case, from_process

__all__ = ["cli_cases"]

GEN = ("--max-tokens", "2")


def _generate(fx: Fixtures, bundle: Path, *extra: str) -> Outcome:
    return fx.cli("generate", str(bundle), "the cat", *GEN, *extra)


def _manifest_case(name: str, edit) -> object:
    def run(fx: Fixtures) -> Outcome:
        b = fx.copy(f"manifest-{name}")
        data = fx.manifest(b)
        edit(data)
        fx.write_manifest(b, data)
        return _generate(fx, b)
    return case("bundle manifest", name, ONE_LINE, run)


def _set(path: str, value):
    def edit(d: dict) -> None:
        *parents, last = path.split(".")
        for p in parents:
            d = d[p]
        d[last] = value
    return edit


MANIFEST_EDITS = {
    'stop_token_ids "1"': _set("tokenizer.stop_token_ids", "1"),
    'base_model "no"': _set("base_model", "no"),
    "n_layers true": _set("target.n_layers", True),
    "formats []": _set("target.formats", []),
    "n_layers 0": _set("target.n_layers", 0),
    "negative stop id": _set("tokenizer.stop_token_ids", [-1]),
    "schema_version true": _set("schema_version", True),
    "tokenizer file /etc/passwd": _set("tokenizer.file", "/etc/passwd"),
    "tokenizer file ../x": _set("tokenizer.file", "../x"),
    "tokenizer file C:\\x": _set("tokenizer.file", "C:\\x"),
    "target file ../../outside.onnx": _set("target.formats.onnx.file", "../../outside.onnx"),
    "unknown field": _set("target.surprise", 1),
    "context_length 0": _set("target.context_length", 0),
    "context_length true": _set("target.context_length", True),
    "draft_head missing its fields": _set("draft_head", {"file": "h.onnx"}),
}


def _raw_manifest(name: str, text: str | None):
    def run(fx: Fixtures) -> Outcome:
        b = fx.copy(f"raw-{name}")
        if text is None:
            (b / "edgespec.json").unlink()
        else:
            (b / "edgespec.json").write_text(text)
        return _generate(fx, b)
    return case("bundle manifest", name, ONE_LINE, run)


TEMPLATES = {
    "jinja syntax error": ("{{ m.content }", ONE_LINE),
    "sandbox escape": ("{{ messages.__class__.__mro__[1].__subclasses__() }}", ONE_LINE),
    "list.append": ("{% set x = [] %}{{ x.append(1) }}", ONE_LINE),
    # a turn that cannot render is refused on one line and the conversation goes on (exit 0)
    "cpu bomb": ("{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}x",
                 (ONE_LINE, SUCCESS)),
    "memory bomb": ("{{ 'x' * 100000000000 }}", (ONE_LINE, SUCCESS)),
    "macro recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", (ONE_LINE, SUCCESS)),
    "undefined name": ("{{ nothing.here() }}", (ONE_LINE, SUCCESS)),
}


def _template_case(name: str, template: str, expect):
    def run(fx: Fixtures) -> Outcome:
        b = fx.copy(f"template-{name.replace(' ', '-')}")
        data = fx.manifest(b)
        data["tokenizer"]["chat_template"] = template
        fx.write_manifest(b, data)
        out = fx.cli("chat", str(b), *GEN, stdin=b"hello\n")
        return out
    return case("chat template", name, expect, run, "chat template")


def _first(b: Path, pattern: str) -> Path:
    return next(iter(sorted(b.glob(pattern))))


def _file_cases() -> list:
    def empty_vocab(fx):
        b = fx.copy("empty-vocab")
        tok = json.loads((b / "tokenizer.json").read_text())
        tok["model"]["vocab"], tok["model"]["merges"] = {}, []
        (b / "tokenizer.json").write_text(json.dumps(tok))
        return _generate(fx, b)

    def truncated_weights(fx):
        b = fx.copy("truncated-weights")
        data = list(b.glob("target/*.onnx.data")) or list(b.glob("target/*.onnx"))
        f = data[0]
        f.write_bytes(f.read_bytes()[: max(f.stat().st_size // 2, 1000)])
        return _generate(fx, b)

    def external_outside(fx):
        import onnx
        from onnx import TensorProto

        b = fx.copy("external-outside")
        f = _first(b, "target/*.onnx")
        m = onnx.load(str(f), load_external_data=False)
        t = next(t for t in m.graph.initializer if t.data_location == TensorProto.EXTERNAL)
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = "../../secret.dat"
        (fx.work / "secret.dat").write_bytes(b"\0" * (1 << 20))
        onnx.save(m, str(f))
        return _generate(fx, b)

    def symlink_loop(fx):
        b = fx.copy("symlink-loop")
        (b / "tokenizer.json").unlink()
        os.symlink("loop-b", b / "tokenizer.json")
        os.symlink("tokenizer.json", b / "loop-b")
        return _generate(fx, b)

    def symlink_outside(fx):
        b = fx.copy("symlink-outside")
        (b / "tokenizer.json").unlink()
        os.symlink("/etc/hostname", b / "tokenizer.json")
        return _generate(fx, b)

    return [case("bundle files", "tokenizer.json with an empty BPE vocab", ONE_LINE, empty_vocab, "vocabulary"),
            case("bundle files", "weights truncated", ONE_LINE, truncated_weights, "truncated"),
            case("bundle files", "external data outside the bundle", ONE_LINE, external_outside, "outside"),
            case("bundle files", "symlink loop", ONE_LINE, symlink_loop, "Symlink loop"),
            case("bundle files", "symlink outside the bundle", ONE_LINE, symlink_outside, "outside")]


# -- export ------------------------------------------------------------------------------------

def _export(fx: Fixtures, target: Path, out: Path, *extra: str, draft: str = "none", **kw) -> Outcome:
    return fx.cli("export", "--target", str(target), "-o", str(out), "--draft", draft, *extra, **kw)


def _kept(fx: Fixtures, folder: Path, digest: str, outcome: Outcome) -> Outcome:
    """`outcome`, unless the user's data at `folder` changed or the run left staging files beside it."""
    if not folder.exists() or tree_digest(folder) != digest:
        return Outcome(DATA_LOST, f"{folder.name} changed ({outcome.detail})")
    left = leftovers(folder.parent, folder.name)
    return Outcome(LEFT_BEHIND, ", ".join(left)) if left else outcome


def _export_cases() -> list:
    def force_over_user_files(fx):
        out = fx.work / "cases" / "user-folder"
        out.mkdir(parents=True, exist_ok=True)
        (out / "thesis.txt").write_text("years of work")
        return _kept(fx, out, tree_digest(out), _export(fx, fx.gguf, out, "--force"))

    def force_over_a_file(fx):
        out = fx.work / "cases" / "a-file.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("keep me")
        return _kept(fx, out, tree_digest(out), _export(fx, fx.gguf, out, "--force"))

    def calibration_noise(fx):
        noise = fx.work / "noise.bin"
        noise.write_bytes(bytes(range(256)) * 4)
        out = fx.work / "cases" / "calib-out"
        return _export(fx, fx.gguf, out, "--calibration", str(noise), "--draft-vocab", "64", draft="self")

    def signal_during_export(sig: int):
        def run(fx):
            out = fx.work / "cases" / f"sig{sig}-out"
            if not out.exists():
                out.parent.mkdir(parents=True, exist_ok=True)
                import shutil

                shutil.copytree(fx.bundle, out)
            digest = tree_digest(out)
            cmd = [sys.executable, "-m", "edgespec", "export", "--target", str(fx.gguf), "-o", str(out), "--force",
                   "--draft", "none", "--format", "onnx"]
            proc = subprocess.Popen(cmd, env=fx.env(), cwd=fx.work, stderr=subprocess.PIPE)
            while proc.poll() is None and not any(".stage-" in p.name for p in out.parent.iterdir()):
                time.sleep(0.01)  # signal it mid-export: once its staging folder exists
            time.sleep(0.2)
            proc.send_signal(sig)
            try:
                _, err = proc.communicate(timeout=fx.timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                return Outcome(HANG, "the export did not stop after the signal")
            text = err.decode("utf-8", "replace")
            if sig == signal.SIGKILL:  # the next export sweeps what the killed one left
                first = f"killed (exit {proc.returncode})"
                outcome = _export(fx, fx.gguf, out, "--format", "onnx", "--force")  # to the same place
                if not out.exists():
                    return Outcome(DATA_LOST, "no bundle in place after SIGKILL and a new export")
                left = leftovers(out.parent, out.name)
                if left:
                    return Outcome(LEFT_BEHIND, ", ".join(left))
                return Outcome(outcome.cls, f"{first}; the next export: {outcome.detail}")
            outcome = from_process(proc.returncode, text, ok_codes=(0, 143))
            if outcome.cls != SUCCESS:
                return outcome
            if proc.returncode == 0:  # it finished before the signal: the new bundle is in place
                return _kept(fx, out, tree_digest(out), Outcome(SUCCESS, "finished before the signal"))
            return _kept(fx, out, digest, outcome)
        return run

    gguf_cases = []
    from gguf import GGUFValueType as T

    U32, F32, STR = T.UINT32, T.FLOAT32, T.STRING
    # name -> metadata changes; the error must name the first key changed
    edits = {
        "head_count 0": {"llama.attention.head_count": (0, U32, None)},
        "head_count_kv 3 of 4": {"llama.attention.head_count_kv": (3, U32, None)},
        "head_count a string": {"llama.attention.head_count": ("four", STR, None)},
        "block_count 0": {"llama.block_count": (0, U32, None)},
        "block_count 5": {"llama.block_count": (5, U32, None)},
        "rms_epsilon NaN": {"llama.attention.layer_norm_rms_epsilon": (float("nan"), F32, None)},
        "context_length a string": {"llama.context_length": ("long", STR, None)},
        "no embedding_length": {"llama.embedding_length": (None, U32, None)},
        "template syntax error": {"tokenizer.chat_template": ("{{ m.content }", STR, None)},
        "template sandbox escape": {"tokenizer.chat_template": ("{{ messages.__class__.__mro__ }}", STR, None)},
        "template cpu bomb": {"tokenizer.chat_template": (TEMPLATES["cpu bomb"][0], STR, None)},
        "special token id a string": {"tokenizer.ggml.eos_token_id": ("2", STR, None)},
    }
    for name, changes in edits.items():
        def run(fx, name=name, changes=changes):
            src = fx.work / "cases" / f"gguf-{name.replace(' ', '-')}.gguf"
            src.parent.mkdir(parents=True, exist_ok=True)
            rewrite_gguf(fx.gguf, src, changes)
            out = fx.work / "cases" / f"gguf-{name.replace(' ', '-')}.out"
            outcome = _export(fx, src, out, "--draft-vocab", "64", "--format", "onnx", draft="self")
            left = leftovers(out.parent, out.name)
            return Outcome(LEFT_BEHIND, ", ".join(left)) if left else outcome
        needle = ("chat template" if "template" in name else "q_proj weight for layer" if name == "block_count 5"
                  else next(iter(changes)).removeprefix("tokenizer.ggml."))
        gguf_cases.append(case("GGUF metadata", name, ONE_LINE, run, needle))

    def claims(key: str):
        def run(fx):
            from gguf import GGUFReader

            src = fx.work / "cases" / f"claim-{key}.gguf"
            n = len(GGUFReader(str(fx.gguf)).fields["tokenizer.ggml.tokens"].data)
            rewrite_gguf(fx.gguf, src, {"tokenizer.ggml.scores": ([0.0] * n, T.ARRAY, F32)})  # as SentencePiece has
            claim_array(src, key, 1 << 40)
            return _export(fx, src, fx.work / "cases" / f"claim-{key}.out")
        return run

    def truncated_gguf(fx):
        src = fx.copy("truncated.gguf", fx.gguf)
        src.write_bytes(src.read_bytes()[: src.stat().st_size * 2 // 3])
        return _export(fx, src, fx.work / "cases" / "truncated.out")

    return [case("export", "--force over a folder of user files", ONE_LINE, force_over_user_files, "not one"),
            case("export", "--force over a file", ONE_LINE, force_over_a_file, "not a folder"),
            case("export", "--calibration of random bytes", ONE_LINE, calibration_noise, "not UTF-8"),
            case("export", "SIGTERM during export", SUCCESS, signal_during_export(signal.SIGTERM)),
            case("export", "SIGKILL during export, then export again", SUCCESS, signal_during_export(signal.SIGKILL)),
            *gguf_cases,
            case("GGUF metadata", "token scores claim 2^40 entries", ONE_LINE, claims("tokenizer.ggml.scores"),
                 "claims 1099511627776 entries"),
            case("GGUF metadata", "tokens claim 2^40 entries", ONE_LINE, claims("tokenizer.ggml.tokens"),
                 "claims 1099511627776 entries"),
            case("GGUF metadata", "file truncated (a tensor past the end)", ONE_LINE, truncated_gguf, "past the end")]


# -- generate, chat, distill, serve flags ----------------------------------------------------

def _verb_cases() -> list:
    def gen(*args, stdin=None, expect=ONE_LINE, name=None):
        return case("generate", name or " ".join(args), expect,
                    lambda fx: fx.cli("generate", str(fx.bundle), *args, *GEN, stdin=stdin))

    def sigpipe(fx):
        cmd = (f"set -o pipefail; {sys.executable} -m edgespec generate {fx.bundle} 'the cat' --max-tokens 64 "
               f"2>{fx.work}/sigpipe.err | head -c 1 >/dev/null")
        try:
            p = subprocess.run(["bash", "-c", cmd], env=fx.env(), cwd=fx.work, timeout=fx.timeout_s)
        except subprocess.TimeoutExpired:
            return Outcome(HANG, "killed at the time limit")
        return from_process(p.returncode, (fx.work / "sigpipe.err").read_text(), ok_codes=(0, 141))

    def argv_latin1(fx):
        try:
            p = subprocess.run([sys.executable.encode(), b"-m", b"edgespec", b"generate", str(fx.bundle).encode(),
                                b"caf\xe9", b"--max-tokens", b"2"], capture_output=True, env=fx.env(),
                               timeout=fx.timeout_s, cwd=fx.work)
        except subprocess.TimeoutExpired:
            return Outcome(HANG, "killed at the time limit")
        return from_process(p.returncode, p.stderr.decode("utf-8", "replace"))

    def distill(*args, name):
        def run(fx):
            b = fx.copy(f"distill-{name.replace(' ', '-')}")
            digest = tree_digest(b)
            return _kept(fx, b, digest, fx.cli("distill", str(b), *args))
        return case("distill", name, ONE_LINE, run)

    def distill_noise(fx):
        noise = fx.work / "noise.bin"
        noise.write_bytes(bytes(range(256)) * 4)
        b = fx.copy("distill-noise")
        digest = tree_digest(b)
        return _kept(fx, b, digest, fx.cli("distill", str(b), "--calibration", str(noise)))

    def serve(*args, name):
        return case("serve flags", name, ONE_LINE, lambda fx: fx.cli("serve", str(fx.bundle), "--port", "0", *args))

    return [gen("", name='empty prompt ""'),
            gen("-", stdin=b"", name="empty stdin"),
            gen("-", stdin=b"caf\xe9", name="stdin not UTF-8"),
            case("generate", "argv not UTF-8", ONE_LINE, argv_latin1),
            case("generate", "| head -c 1", SUCCESS, sigpipe),
            gen("the cat", "--threads", "-1"), gen("the cat", "--threads", "0"),
            gen("the cat", "--threads", "64", expect=SUCCESS),
            gen("the cat", "--max-context", "100000"),
            gen("the cat", "--memory-budget", "nan"), gen("the cat", "--memory-budget", "inf"),
            gen("the cat", "--memory-budget", "1.5 parsecs"), gen("the cat", "--memory-budget", "9" * 400,
                                                                   name="--memory-budget of 400 digits"),
            gen("the cat", "--temperature", "hot"),
            case("chat", "piped Latin-1 byte", SUCCESS,
                 lambda fx: fx.cli("chat", str(fx.bundle), *GEN, stdin=b"caf\xe9\nhello\n")),
            distill("--threads", "-1", name="--threads -1"),
            distill("--threads", "0", name="--threads 0"),
            case("distill", "--calibration of random bytes", ONE_LINE, distill_noise),
            serve("--max-request-size", "lots", name="--max-request-size lots"),
            serve("--max-tokens", "10", "--max-tokens-cap", "5", name="--max-tokens over --max-tokens-cap"),
            serve("--template-timeout", "0", name="--template-timeout 0"),
            serve("--api-key", "a b", name="an API key with an inner space"),
            serve("--client-timeout", "nan", name="--client-timeout nan")]


def cli_cases() -> list:
    return [*[_manifest_case(n, e) for n, e in MANIFEST_EDITS.items()],
            _raw_manifest("manifest not JSON", "{not json"), _raw_manifest("manifest missing", None),
            _raw_manifest("manifest a list", "[1, 2]"),
            *[_template_case(n, t, e) for n, (t, e) in TEMPLATES.items()],
            *_file_cases(), *_export_cases(), *_verb_cases()]
