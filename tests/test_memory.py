"""Memory budgets: size parsing, the footprint model and planner (pure), the fixed preallocated
KV buffers of the onnxruntime runtime (exact, never reallocated, measured against RSS), and the
budget through the API, the CLI and a chat that outgrows its context."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from edgespec.decoding import SamplingParams
from edgespec.engine.engine import load
from edgespec.errors import ContextFullError, MemoryBudgetError
from edgespec.memory import (
    ModelMemory,
    Shapes,
    candidate_bytes,
    describe_plan,
    format_bytes,
    kv_bytes_per_token,
    lower_bounds,
    parse_bytes,
    plan_memory,
    workspace_bytes,
)
from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime
from tests.tiny import LONG_PROMPT, PROMPTS
from tests.zoo import AGREEING, DISAGREEING

MiB = 2**20


# -- sizes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("1.5GB", 1_500_000_000), ("900MiB", 900 * MiB), ("2g", 2 * 2**30), ("512 MB", 512_000_000),
    ("64k", 64 * 1024), (" 3GiB ", 3 * 2**30), ("1048576", MiB), (".5G", 2**29), (4096, 4096),
])
def test_parse_bytes_reads_the_usual_spellings(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "1.5XB", "-1GB", "0", "1,5GB", "one gig", True, "1e9"])
def test_parse_bytes_rejects_nonsense_in_one_line(text):
    with pytest.raises(MemoryBudgetError) as e:
        parse_bytes(text)
    assert "\n" not in str(e.value) and "memory budget" in str(e.value)


def test_format_bytes():
    assert format_bytes(1536 * MiB) == "1.5 GiB"
    assert format_bytes(900 * MiB) == "900 MiB"
    assert format_bytes(36864) == "36 KiB"
    assert format_bytes(12) == "12 B"


# -- the footprint model -------------------------------------------------------------------

def test_kv_bytes_per_token_is_layers_heads_dim_two_dtype():
    assert kv_bytes_per_token(18, 1, 256, "float32") == 36864  # Gemma 3 270M
    assert kv_bytes_per_token(18, 1, 256, "float16") == 18432
    assert kv_bytes_per_token(32, 8, 128, "q8_0") == 32 * 8 * 128 * 2 * 34 // 32


def test_candidate_bytes_counts_target_and_trimmed_draft_rows():
    V, K = 262144, 16384
    assert candidate_bytes(4, V, K, sampling=False) == 5 * V * 4 + 4 * K * 4
    assert candidate_bytes(0, V, None, sampling=False) == V * 4
    # sampling adds one target row's scratch (12 bytes a token at most) and the draft rows' float32 exps
    assert candidate_bytes(4, V, K) == 5 * V * 4 + 4 * K * 4 + 12 * V + 4 * 4 * K
    assert candidate_bytes(0, V, None) == V * 4 + 12 * V


def test_workspace_grows_with_chunk_times_context():
    s = Shapes(hidden=640, n_heads=4, intermediate=2048, n_layers=18, n_kv_heads=1, head_dim=256, vocab=262144)
    a, b = workspace_bytes(s, 256, 1000), workspace_bytes(s, 256, 2000)
    assert b > a > workspace_bytes(s, 64, 1000) > 0
    assert workspace_bytes(s, 256, 3000) - b == b - a  # linear in the context


def mem(role, fixed, per_tok, vocab, dtypes=("float32",), shapes=None):
    table = {d: int(per_tok * {"float32": 1, "float16": 0.5, "q8_0": 34 / 128}[d]) for d in dtypes}
    return ModelMemory(role, fixed, table, vocab, shapes)


TARGET = mem("target", 1000 * MiB, 36864, 262144)
DRAFT = mem("draft", 300 * MiB, 36864, 16384)
BASE = 80 * MiB


def test_bounds_order_and_error_names_both():
    b = lower_bounds(BASE, TARGET, DRAFT, k=4)
    assert b.plain < b.speculative
    assert b.plain >= BASE + TARGET.fixed + 512 * 36864
    with pytest.raises(MemoryBudgetError) as e:
        plan_memory(b.least_plain - 1, BASE, TARGET, DRAFT, k=4)
    msg = str(e.value)
    assert "\n" not in msg and format_bytes(b.plain) in msg and format_bytes(b.speculative) in msg


def test_between_the_bounds_the_draft_is_dropped_once():
    b = lower_bounds(BASE, TARGET, DRAFT, k=4)
    plan = plan_memory((b.plain + b.speculative) // 2, BASE, TARGET, DRAFT, k=4, max_k=8)
    assert not plan.use_draft and plan.max_draft == 0 and plan.kv_capacity >= 512
    assert len(plan.notes) == 1 and "speculative bound" in plan.notes[0]
    kept = plan_memory(b.speculative, BASE, TARGET, DRAFT, k=4, max_k=8)
    assert kept.use_draft and kept.max_draft >= 4 and kept.kv_capacity >= 512


def test_a_printed_bound_still_holds_in_the_next_process():
    """Measured overheads move a little between runs: a budget set to the bound one run printed keeps
    the draft in a run that needs 0.5% more."""
    printed = lower_bounds(BASE, TARGET, DRAFT, k=4)
    assert printed.speculative > printed.least_speculative and printed.plain > printed.least_plain
    base = BASE + printed.least_speculative // 200
    plan = plan_memory(printed.speculative, base, TARGET, DRAFT, k=4)
    assert plan.use_draft and plan.kv_capacity >= 512 and plan.total <= printed.speculative
    assert not plan_memory(printed.plain, base, TARGET, DRAFT, k=4).use_draft


def test_bounds_count_the_probe_at_their_own_shape_whatever_the_budget():
    """The bounds count the scratch a probe measured at their shape (32 tokens over 512), not the
    larger probe a roomy budget makes; at the bound the plan keeps the draft with the smallest
    chunk, and a byte below it drops the draft."""
    from dataclasses import replace

    s = Shapes(hidden=640, n_heads=4, intermediate=2048, n_layers=18, n_kv_heads=1, head_dim=256, vocab=262144)
    small = (32, 512, 3 * workspace_bytes(s, 32, 512))  # the arena takes more than estimated
    t, d = (replace(m, shapes=s, bound_scratch=small, scratch=small) for m in (TARGET, DRAFT))
    roomy = [replace(m, scratch=(256, 4096, 3 * workspace_bytes(s, 256, 4096))) for m in (t, d)]
    b = lower_bounds(BASE, t, d, k=4)
    assert b == lower_bounds(BASE, *roomy, k=4)
    assert b.least_speculative > lower_bounds(BASE, replace(TARGET, shapes=s), replace(DRAFT, shapes=s),
                                              k=4).least_speculative
    plan = plan_memory(b.least_speculative, BASE, t, d, k=4)
    assert plan.use_draft and plan.prefill_chunk == 32 and plan.kv_capacity >= 512 and not plan.notes
    dropped = plan_memory(b.least_speculative - 1, BASE, t, d, k=4)
    assert not dropped.use_draft and "speculative bound" in dropped.notes[0]


S270 = Shapes(hidden=640, n_heads=4, intermediate=2048, n_layers=18, n_kv_heads=1, head_dim=256, vocab=262144)


def test_two_probes_carry_what_grows_and_keep_what_does_not():
    """Probes at two shapes: the scratch at a third follows the line through them, so what a
    runtime holds whatever the shape is not scaled with the context; one probe alone scales with
    the estimate; a shape below the larger probe keeps that probe's peak."""
    from dataclasses import replace

    from edgespec.memory.footprint import ALLOCATOR_SLACK

    def e(n, c):
        return workspace_bytes(S270, n, c)

    held, slack = 40 * MiB, 1 + ALLOCATOR_SLACK
    one = replace(TARGET, shapes=S270, scratch=(32, 512, held + e(32, 512)))
    two = replace(one, bound_scratch=one.scratch, scratch=(64, 2048, held + e(64, 2048)))
    assert two.workspace(64, 8192) == pytest.approx((held + e(64, 8192)) * slack, abs=2)
    assert one.workspace(64, 8192) == pytest.approx((held + e(32, 512)) * e(64, 8192) / e(32, 512) * slack, abs=2)
    assert two.workspace(32, 256) == pytest.approx((held + e(64, 2048)) * slack, abs=2)


def test_reused_scratch_counts_the_larger_forward_not_both():
    """Where the allocator gives a forward's scratch back (a fixed mmap threshold), the target's
    and the draft's forwards, one after the other, share it: the plan counts the larger one."""
    from dataclasses import replace

    t, d = (replace(m, shapes=S270) for m in (TARGET, DRAFT))
    apart = plan_memory(3 * 2**30, BASE, t, d, k=4)
    shared = plan_memory(3 * 2**30, BASE, t, d, k=4, reused_scratch=True)
    assert shared.use_draft and shared.kv_capacity > apart.kv_capacity and shared.total <= shared.budget
    n, c = shared.prefill_chunk, shared.kv_capacity
    scratch = next(b for label, b in shared.parts if label.startswith("scratch of the larger forward"))
    assert scratch == max(t.workspace(n, c), d.workspace(n, c))
    assert (lower_bounds(BASE, t, d, k=4, reused_scratch=True).least_speculative
            < lower_bounds(BASE, t, d, k=4).least_speculative)


@pytest.mark.parametrize("budget_mib", [1500, 2000, 4000, 8000])
def test_plan_fits_the_budget_and_grows_with_it(budget_mib):
    plan = plan_memory(budget_mib * MiB, BASE, TARGET, DRAFT, k=4, max_k=8)
    assert plan.total <= plan.budget
    assert plan.use_draft and plan.max_draft == 8
    bigger = plan_memory(budget_mib * MiB * 2, BASE, TARGET, DRAFT, k=4, max_k=8)
    assert bigger.kv_capacity >= plan.kv_capacity
    assert "total" in describe_plan(plan) and "lower bounds" in describe_plan(plan)


def test_capacity_is_capped_and_kv_dtype_chosen_where_allowed():
    assert plan_memory(64 * 2**30, BASE, TARGET, DRAFT, k=4, max_context=8192).kv_capacity == 8192
    t = mem("target", 1000 * MiB, 36864, 262144, dtypes=("float16", "q8_0"))
    d = mem("draft", 300 * MiB, 36864, 16384, dtypes=("float16", "q8_0"))
    roomy = plan_memory(4 * 2**30, BASE, t, d, k=4)
    assert roomy.kv_dtype == "float16" and not roomy.notes
    b = lower_bounds(BASE, t, d, k=4)
    tight = plan_memory(b.least_speculative + 300 * 18432, BASE, t, d, k=4)
    assert tight.kv_dtype == "q8_0" and any("q8_0" in n for n in tight.notes)


def test_draft_length_is_capped_before_the_context():
    b = lower_bounds(BASE, TARGET, DRAFT, k=2, sampling=True)
    plan = plan_memory(b.least_speculative + 10 * 36864 * 2, BASE, TARGET, DRAFT, k=2, max_k=16)
    assert plan.use_draft and 2 <= plan.max_draft < 16 and plan.kv_capacity >= 512


def test_window_sized_kv_counts_the_sliding_layers_buffers_once():
    """Gemma 3 270M's shape: 15 of 18 layers slide, their buffers hold 1088 rows whatever the context."""
    per = 18 * 2 * 256 * 4
    t = ModelMemory("target", 344 * MiB, {"float32": per}, 262144, sliding=(15 / 18, 1088))
    assert t.kv("float32", 500) == per * 500  # below the window-sized buffers' rows: every layer per position
    assert t.kv("float32", 32768) == round(per * (3 / 18 * 32768 + 15 / 18 * 1088))
    whole_kv = ModelMemory("target", 0, {"float32": per}, 9).kv("float32", 32768)
    assert 200 * MiB < t.kv("float32", 32768) < 240 * MiB and whole_kv == 1152 * MiB
    for bad in ((0.5, 0), (0.0, 10), (1.5, 10), (0.5, -1)):
        with pytest.raises(ValueError, match="window-sized KV"):
            ModelMemory("target", 0, {"float32": per}, 9, sliding=bad)
    # 32k positions fit a budget whose KV part is a few hundred MiB; counted whole they would not
    budget = BASE + 344 * MiB + 300 * MiB
    windowed = plan_memory(budget, BASE, t, None, k=0, max_context=32768)
    whole = plan_memory(budget, BASE, ModelMemory("target", 344 * MiB, {"float32": per}, 262144), None, k=0,
                        max_context=32768)
    assert windowed.kv_capacity == 32768 and whole.kv_capacity < 32768 // 3
    text = describe_plan(windowed)
    assert "target KV cache (32768 positions x 6 KiB + 1088 x 30 KiB on 83% of layers windowed, float32)" in text


def test_the_default_context_is_the_trained_one_where_memory_allows():
    from edgespec.memory.planner import MAX_CONTEXT, MIN_CONTEXT, default_context

    per = 36 * 1024
    assert default_context(32768, per, 16 * 2**30) == 32768
    assert default_context(32768, per, None) == 32768  # memory unknown: the trained context
    assert default_context(131072, per, 64 * 2**30) == MAX_CONTEXT  # the planner's cap
    assert default_context(None, per, 16 * 2**30) is None  # no record: the backend's own default
    assert default_context(32768, per, 2 * 8000 * per) == 8000  # KV at most half of what is available
    assert default_context(32768, per, 10 * per) == MIN_CONTEXT


def test_an_engine_without_max_context_holds_the_trained_context(zoo):
    from edgespec.bundle import load_bundle
    from edgespec.memory.planner import MAX_CONTEXT

    bundle = zoo.bundle("llama", None)
    trained = load_bundle(bundle).manifest.target.context_length
    assert trained and trained != 4096
    with load(bundle, backend="onnxruntime", use_draft=False, drafter="none") as engine:
        assert engine.context_limit == engine.target.kv_capacity == min(trained, MAX_CONTEXT)
    with load(bundle, backend="onnxruntime", use_draft=False, drafter="none", max_context=64) as engine:
        assert engine.context_limit == engine.target.kv_capacity == 64  # --max-context still caps it


def test_openvino_holds_the_trained_context_but_static_shapes_keep_their_own(zoo):
    """OpenVINO's dynamic buffer commits memory as it fills: the trained context by default, as on
    onnxruntime; static shapes hold their whole capacity from the start and keep their default."""
    pytest.importorskip("openvino")
    from edgespec.bundle import load_bundle
    from edgespec.memory.planner import MAX_CONTEXT
    from edgespec.runtimes.openvino.kv import DEFAULT_STATIC_CAPACITY

    bundle = zoo.bundle("llama", None, formats=("openvino",))
    trained = load_bundle(bundle).manifest.target.context_length
    with load(bundle, backend="openvino", use_draft=False, drafter="none") as engine:
        assert engine.context_limit == engine.target.kv_capacity == min(trained, MAX_CONTEXT)
    with load(bundle, backend="openvino", use_draft=False, drafter="none", static=True) as engine:
        assert engine.target.kv_capacity == DEFAULT_STATIC_CAPACITY != min(trained, MAX_CONTEXT)


def test_measured_memory_takes_the_runtimes_window_sized_kv():
    from types import SimpleNamespace

    from edgespec.memory.loading import measured_memory

    rt = SimpleNamespace(model_sizes=dict, kv_bytes_per_token=96, kv_dtypes=("float32",), vocab_size=10,
                         kv_sliding=(2 / 3, 64))
    assert measured_memory("target", rt, 5).sliding == (2 / 3, 64)
    del rt.kv_sliding  # a backend that holds every layer whole
    assert measured_memory("target", rt, 5).sliding == (0.0, 0)


# -- the fixed KV buffers of the onnxruntime runtime ----------------------------------------

def target_runtime(bundle, **kw) -> OnnxRuntime:
    from edgespec.bundle import load_bundle

    b = load_bundle(bundle)
    return OnnxRuntime(b.file(b.manifest.target.formats["onnx"].file), **kw)


def test_kv_model_equals_the_allocated_buffers(zoo):
    bundle = zoo.bundle("gemma3", AGREEING)
    from edgespec.bundle import load_bundle

    m = load_bundle(bundle).manifest
    with target_runtime(bundle, kv_capacity=300) as rt:
        assert rt.capabilities.fixed_kv and rt.kv_capacity == 300
        per_tok = kv_bytes_per_token(m.target.n_layers, m.target.n_kv_heads, m.target.head_dim)
        assert rt.kv_bytes_per_token == per_tok
        bufs = rt.kv_buffers()
        assert len(bufs) == 2 * m.target.n_layers
        assert sum(b.nbytes for b in bufs) == per_tok * 300 == rt.memory_bytes()["kv"]
        sizes = rt.model_sizes()
        assert sizes["n_layers"] == m.target.n_layers and sizes["vocab"] == m.target.vocab_size


def test_kv_buffers_never_move_and_logits_reuse_one_buffer(zoo):
    with load(zoo.bundle("llama", DISAGREEING), k=3, drafter="model", max_context=200) as e:
        runtimes = [e.target, e.draft]
        before = [[(b.ctypes.data, b.nbytes) for b in rt.kv_buffers()] for rt in runtimes]
        logits_at = [rt._logits.ctypes.data for rt in runtimes]
        tokens = e.tokenizer.encode(PROMPTS[1])
        seen = []
        for step in e.decoder.stream(tokens, SamplingParams(), 120):
            seen.append(step.drafted - step.accepted)
        assert sum(seen) > 0  # some drafts were rejected and rolled back
        assert [[(b.ctypes.data, b.nbytes) for b in rt.kv_buffers()] for rt in runtimes] == before
        assert [rt._logits.ctypes.data for rt in runtimes] == logits_at
        out = e.target.forward([5, 6, 7], n_logits=3)
        assert np.shares_memory(out, e.target._logits)


def test_fixed_path_matches_transformers_and_chunked_prefill(zoo):
    """Greedy identity on the preallocated path: a budgeted engine, prefill in small chunks,
    equals transformers' greedy decoding token for token."""
    from tests.test_export_onnx import decode, hf_greedy

    name = "gemma3"
    ids = zoo.hf_tokenizer(name)(LONG_PROMPT)["input_ids"]
    ref = hf_greedy(zoo.hf_model(name), ids, 30)
    with load(zoo.bundle(name, DISAGREEING), k=3, drafter="model", memory_budget="8GB") as e:
        assert e.memory_plan is not None and e.memory_plan.use_draft
        for rt in (e.target, e.draft):  # prefill 5 tokens at a time: exercises the chunked path
            from dataclasses import replace

            rt.capabilities = replace(rt.capabilities, max_batch_tokens=5)
        got, drafted, accepted = decode(e, ids, 30)
    assert got == ref
    assert drafted > accepted > 0


def test_a_long_prompt_without_a_budget_goes_in_chunks(zoo, monkeypatch):
    """No budget: the prompt is fed prefill_chunk tokens at a time (a long prompt in one forward
    takes scratch memory that grows with its length times the context); speculative decoding
    still gives plain decoding's tokens."""
    bundle = zoo.bundle("llama", AGREEING)
    prompt = np.random.default_rng(3).integers(5, 300, 150).tolist()
    outs = []
    for drafter in ("model", "none"):
        with load(bundle, k=3, drafter=drafter, prefill_chunk=40) as e:
            sizes, forward = [], e.target.forward
            monkeypatch.setattr(e.target, "forward", lambda ids, n_logits=1, sizes=sizes, forward=forward:
                                sizes.append(len(ids)) or forward(ids, n_logits))
            outs.append([t for s in e.decoder.stream(list(prompt), SamplingParams(), 12) for t in s.tokens])
        assert max(sizes) == 40 and sum(sizes) >= 150
    assert outs[0] == outs[1] and len(outs[0]) == 12


def test_forward_past_capacity_is_refused_and_leaves_the_cache(zoo):
    with target_runtime(zoo.bundle("llama", AGREEING), kv_capacity=8) as rt:
        rt.forward([1, 2, 3, 4, 5])
        with pytest.raises(ContextFullError):
            rt.forward([6, 7, 8, 9])
        assert rt.n_past == 5
        rt.trim(2)
        rt.forward([6, 7, 8, 9, 10, 11])
        assert rt.n_past == 8


# -- measured against the process's memory ---------------------------------------------------

MEASURE = textwrap.dedent("""
    import json, sys
    import numpy as np
    from edgespec.memory.measure import PeakRSS, rss_bytes
    import edgespec
    bundle, budget = sys.argv[1], sys.argv[2]
    with edgespec.load(bundle, k=3, drafter="model", memory_budget=budget) as e:
        plan = e.memory_plan
        after_load = rss_bytes()
        rng = np.random.default_rng(0)
        n = plan.kv_capacity - 40
        prompt = rng.integers(5, e.target.vocab_size, n).tolist()
        with PeakRSS(0.001) as peak:
            out = list(e.stream(prompt, max_tokens=64))
        print(json.dumps(dict(budget=plan.budget, total=plan.total, capacity=plan.kv_capacity, n=n,
                              chunk=plan.prefill_chunk, parts=dict(plan.parts), after_load=after_load,
                              peak=peak.peak, finish=out[-1].finish_reason, used=e.target.n_past,
                              base=e.memory_plan.parts[0][1])))
""")


def run_measure(bundle, budget) -> dict:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-c", MEASURE, str(bundle), budget], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_model_matches_measured_memory_within_ten_percent(zoo):
    """A tiny model filled to its planned context: the plan's total is what the process peaks at
    (within 10%), and the peak stays under the budget."""
    m = run_measure(zoo.bundle("llama", AGREEING), "110MB")
    assert m["finish"] == "length" and m["used"] <= m["capacity"]
    assert m["peak"] <= m["budget"], m
    assert abs(m["peak"] - m["total"]) <= 0.10 * m["total"], m


# -- API, CLI, chat ------------------------------------------------------------------------

def test_budget_below_the_bound_is_one_line_with_the_bounds(zoo):
    bundle = zoo.bundle("llama", AGREEING)
    with pytest.raises(MemoryBudgetError) as e:
        load(bundle, memory_budget="10MB")
    assert "\n" not in str(e.value) and "plain decoding" in str(e.value) and "draft model" in str(e.value)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    for verb in (["plan", str(bundle)], ["generate", str(bundle), "hello"]):
        r = subprocess.run([sys.executable, "-m", "edgespec", *verb, "--memory-budget", "10MB"],
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 2
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "plain decoding" in lines[0] and "MiB" in lines[0], r.stderr
    r = subprocess.run([sys.executable, "-m", "edgespec", "plan", str(bundle), "--memory-budget", "lots"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "1.5GB" in r.stderr


def test_plan_verb_prints_the_breakdown(zoo):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-m", "edgespec", "plan", str(zoo.bundle("llama", AGREEING)),
                        "--memory-budget", "2GB"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    for part in ("target weights", "draft KV cache", "candidates", "scratch", "total", "lower bounds", "plan:"):
        assert part in r.stdout


def test_completion_past_the_context_stops_with_length(zoo):
    with load(zoo.bundle("llama", DISAGREEING), k=3, drafter="model", max_context=40) as e:
        prompt = e.tokenizer.encode(PROMPTS[1])
        rs = list(e.stream(prompt, max_tokens=100))
        assert rs[-1].finish_reason == "length"
        assert len(prompt) + sum(len(r.token_ids) for r in rs) == 40
        with pytest.raises(ContextFullError):
            e.generate(list(range(5, 50)), max_tokens=4)
        assert e.generate(PROMPTS[1], max_tokens=4)  # and the engine still works


def test_a_long_chat_past_the_context_keeps_answering(zoo):
    with load(zoo.bundle("qwen2", DISAGREEING), k=3, drafter="model", max_context=160) as e:
        chat = e.chat(system="be brief")
        for i in range(14):
            reply = list(chat.send(f"{PROMPTS[1]} turn {i}", max_tokens=12))
            assert reply and reply[-1].finish_reason in ("stop", "length")
            assert sum(len(r.token_ids) for r in reply) >= 1
            assert e.target.n_past < 160
        assert chat.notices and all("dropped" in n for n in chat.notices)
        assert chat.messages[0] == {"role": "system", "content": "be brief"}
        assert chat.messages[-1]["role"] == "assistant" and "turn 13" in chat.messages[-2]["content"]
        with pytest.raises(ContextFullError):  # one message longer than the context: refused, history kept
            list(chat.send(" ".join([LONG_PROMPT] * 8)))
        assert "turn 13" in chat.messages[-2]["content"]


def test_generate_prints_the_plan_with_v(zoo):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-m", "edgespec", "generate", str(zoo.bundle("llama", AGREEING)), "hello",
                        "--memory-budget", "4GB", "--max-tokens", "4", "-v"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "memory budget" in r.stderr and "plan: speculative" in r.stderr
