"""Tree verification through the decoder (issue 23): a recycled draft tree verified in one target
forward commits what plain greedy decoding commits, samples exactly, and leaves the cache holding
the accepted path only; on real tiny bundles exported with `--tree` too."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.stats import chisquare

from edgespec.decoding import FixedK, RecyclingDrafter, SamplingParams, SpeculativeDecoder, make_policy, probabilities
from edgespec.decoding.cache import TrackedCache
from edgespec.decoding.tree import DraftTree
from edgespec.errors import BackendError, ConfigError
from tests.toy import ToyRuntime, TreeToyRuntime, naive_greedy

V = 50
GREEDY = SamplingParams()
PROMPTS = ([3, 14, 15, 9, 26], [1, 2, 3, 4, 5, 6], [7, 7, 7], [40, 2, 33, 8])


def generate(dec: SpeculativeDecoder, prompt, n, params=GREEDY):
    tokens = list(prompt)
    steps = list(dec.stream(tokens, params, n))
    return tokens[len(prompt):], steps


@pytest.mark.parametrize("shape", [(2, 1, 1), (3, 1), (2, 2, 1)])
def test_greedy_tree_drafts_commit_what_plain_decoding_does(shape):
    target = TreeToyRuntime(V, seed=0)
    dec = SpeculativeDecoder(target, drafter=RecyclingDrafter(V, shape=shape), policy=FixedK(3))
    off_path = tree_steps = 0
    for prompt in PROMPTS:
        for _ in range(2):  # the table lives on: the second run drafts from a warm table
            target.reset()
            out, steps = generate(dec, prompt, 40)
            assert out == naive_greedy(ToyRuntime(V, seed=0), prompt, 40)
            trees = [s for s in steps if s.source == "recycle:tree"]
            tree_steps += len(trees)
            off_path += sum(s.accepted > 0 for s in trees)
            assert target.n_past < len(prompt) + 40  # the cache holds a prefix of the sequence, never more
    assert target.trees == tree_steps > 20 and off_path > 5


def test_a_later_row_carrying_the_next_token_is_not_kept_by_its_id():
    # root -> A -> B and root -> C: the target takes A, B and then says C. Every fed id matches the
    # committed ones, yet row 3 was computed as the root's child: only the path's rows may stay
    rt = TreeToyRuntime(V, seed=0)
    cache = TrackedCache(rt)
    prompt = [3, 14, 15]
    tree = DraftTree((5, 6, 7), (0, 1, 0))
    cache.feed_tree(prompt, tree)
    assert cache.ids == [3, 14, 15, -1, -1, -1] and rt.n_past == 6
    cache.keep_path(tree, [1, 2])
    assert cache.ids == [3, 14, 15, 5, 6] and rt.cache == [3, 14, 15, 5, 6]
    committed = prompt + [5, 6, 7]
    cache.align(committed)
    assert cache.ids == [3, 14, 15, 5, 6]
    want = ToyRuntime(V, seed=0).forward(committed, n_logits=1)
    np.testing.assert_array_equal(cache.feed([7], n_logits=1), want)


def test_a_step_that_fails_after_the_tree_forward_keeps_only_the_root():
    rt = TreeToyRuntime(V, seed=0)
    cache = TrackedCache(rt)
    cache.feed_tree([3, 14, 15], DraftTree((15, 6), (0, 0)))
    cache.align([3, 14, 15, 15, 6])  # what a failed step's rollback sees: node ids never match
    assert cache.ids == [3, 14, 15] and rt.n_past == 3


def test_sampled_tree_steps_follow_the_target():
    params = SamplingParams(temperature=1.0)
    target = TreeToyRuntime(V, seed=0, scale=0.6)  # flat rows: the top-3 hold about half the mass
    p = probabilities(target.forward(PROMPTS[0])[-1], params)
    target.reset()
    dec = SpeculativeDecoder(target, drafter=RecyclingDrafter(V, shape=(3,)), policy=FixedK(1))
    n, counts, accepted = 3000, np.zeros(V), 0
    for i in range(n):
        tokens = list(PROMPTS[0])
        # a budget of 4 leaves room for the tree's 3 nodes; the first step decides the first token
        step = next(dec.stream(tokens, SamplingParams(1.0, seed=i), 4))
        accepted += step.accepted
        counts[tokens[len(PROMPTS[0])]] += 1
    assert target.trees == n - 1  # every run after the first drafts the root's top-3
    assert 0.05 * n < accepted < 0.95 * n
    assert counts[p == 0].sum() == 0
    expected = p * n
    big, rare = expected >= 5, (expected > 0) & (expected < 5)
    obs, exp = counts[big], expected[big]
    if rare.any():  # rare tokens share one bin
        obs, exp = np.append(obs, counts[rare].sum()), np.append(exp, expected[rare].sum())
    assert big.sum() >= 20 and chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3


def test_a_tree_drafter_needs_a_target_that_verifies_trees():
    with pytest.raises(ConfigError, match="tree"):
        SpeculativeDecoder(ToyRuntime(V, seed=0), drafter=RecyclingDrafter(V, shape=(2, 1)))
    with pytest.raises(BackendError, match="chains only"):
        ToyRuntime(V, seed=0).forward_tree([1, 2], [-1, 0])


def test_the_cost_policy_drafts_trees_only_where_rows_are_cheap():
    """With measured verify costs the drafter weighs trees against chains (tree.best_shape)."""
    target = TreeToyRuntime(V, seed=0)
    # every phase costs the same: rows cost nothing extra (a counter, not an array of every tick)
    clock = map((1e-3).__mul__, itertools.count()).__next__
    dec = SpeculativeDecoder(target, drafter="recycle", policy=make_policy("cost", 4), clock=clock)
    assert dec.drafter.trees
    sources = set()
    for prompt in PROMPTS:
        target.reset()
        out, steps = generate(dec, prompt, 40)
        assert out == naive_greedy(ToyRuntime(V, seed=0), prompt, 40)
        sources |= {s.source for s in steps}
    assert "recycle:tree" in sources


# ---------------------------------------------------------------- real tiny bundles (onnxruntime)


@pytest.mark.parametrize("name", ["gemma3", "qwen2"])
def test_a_tree_forwards_path_rows_are_the_bits_of_plain_decoding(zoo, name):
    pytest.importorskip("onnxruntime")
    from edgespec.bundle import load_bundle
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    b = load_bundle(zoo.bundle(name, None, tree=True))
    rng = np.random.default_rng(3)
    with OnnxRuntime(b.file(b.manifest.target.formats["onnx"].file), kv_capacity=256) as rt:
        assert rt.capabilities.trees
        for n_prefix in (3, 70, 130):  # a prefix inside the first block, and across block bounds
            ids = [int(t) for t in rng.integers(3, rt.vocab_size, n_prefix + 6)]
            rt.reset()
            rt.forward(ids[:n_prefix], n_logits=1)
            plain = [np.array(rt.forward([t])[0]) for t in ids[n_prefix:n_prefix + 5]]
            rt.trim(n_prefix)
            # root ids[P]; its children 7 and ids[P+1]; the path continues under the second child
            tokens = [ids[n_prefix], 7, ids[n_prefix + 1], 9, ids[n_prefix + 2], ids[n_prefix + 3], ids[n_prefix + 4]]
            parents = [-1, 0, 0, 1, 2, 4, 5]
            rows = np.array(rt.forward_tree(tokens, parents))
            path = [0, 2, 4, 5, 6]
            for i, row in enumerate(path):
                np.testing.assert_array_equal(rows[row], plain[i], err_msg=f"prefix {n_prefix}, path row {row}")
            rt.keep_rows(n_prefix, path[:3])
            assert rt.n_past == n_prefix + 3
            np.testing.assert_array_equal(rt.forward([ids[n_prefix + 3]])[0], plain[3])
        with pytest.raises(ValueError, match="increasing"):
            rt.keep_rows(0, [2, 1])


def test_recycled_trees_on_a_tiny_tree_bundle_equal_plain_decoding(zoo):
    pytest.importorskip("onnxruntime")
    from edgespec.engine.engine import load
    from tests.tiny import PROMPTS as TEXTS

    with load(zoo.bundle("gemma3", None, tree=True), drafter="recycle", k=3) as engine:
        assert engine.target.capabilities.trees and engine.decoder.drafter.trees
        plain = engine.variant(plain=True)
        trees = SpeculativeDecoder(engine.target, drafter=RecyclingDrafter(engine.target.vocab_size, shape=(2, 1, 1)),
                                   policy=FixedK(3))
        tree_steps = accepted = 0
        for text in TEXTS:
            ids = engine.tokenizer.encode(text)
            engine.target.reset()
            want, _ = generate(plain, ids, 32)
            for _ in range(2):
                engine.target.reset()
                out, steps = generate(trees, ids, 32)
                assert out == want
                tree_steps += sum(s.source == "recycle:tree" for s in steps)
                accepted += sum(s.accepted for s in steps)
            engine.target.reset()
            assert generate(engine.decoder, ids, 32)[0] == want  # the engine's own recycling, trees allowed
    assert tree_steps > 10 and accepted > 0


def test_tree_export_needs_the_onnx_format(tmp_path):
    from edgespec.exporters.export import ExportConfig

    with pytest.raises(ConfigError, match="--tree"):
        ExportConfig(output=tmp_path / "b", formats=("gguf",), tree=True)


def test_the_probe_checks_tree_rows_and_the_engine_drafts_trees_only_then(zoo):
    pytest.importorskip("onnxruntime")
    from edgespec.engine.engine import load
    from edgespec.runtimes.exactness import probe

    with load(zoo.bundle("gemma3", None, tree=True), drafter="recycle") as engine:
        verdict = probe(engine.target, 7)
        assert verdict.trees is True and "tree verify exact" in verdict.describe()
        assert engine.opened.limits.trees and engine.variant(drafter="recycle").drafter.trees
        assert not engine.variant(drafter="recycle", trees=False).drafter.trees
    with load(zoo.bundle("gemma3", None), drafter="recycle") as engine:
        assert probe(engine.target, 3).trees is None and not engine.target.capabilities.trees
        assert not engine.variant(drafter="recycle").drafter.trees


def test_a_tree_bundle_with_a_draft_model_decodes_as_plain(zoo):
    """The draft model drafts chains, recycling may draft trees, on the same target: plain's output."""
    pytest.importorskip("onnxruntime")
    from edgespec.engine.engine import load
    from tests.tiny import PROMPTS as TEXTS

    with load(zoo.bundle("gemma3", "int8", tree=True), drafter="both-recycle", k=3) as engine:
        assert engine.target.capabilities.trees and engine.decoder.drafter.trees
        plain = engine.variant(plain=True)
        for text in TEXTS[:2]:
            ids = engine.tokenizer.encode(text)
            engine.target.reset()
            want, _ = generate(plain, ids, 24)
            engine.target.reset()
            engine.draft.reset()
            out, steps = generate(engine.decoder, ids, 24)
            assert out == want and sum(s.accepted for s in steps) > 0
