"""Draft trees: their structure, recycled shapes, and acceptance against chains and the target."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from edgespec.decoding.acceptance import accept_coupled, accept_greedy
from edgespec.decoding.draws import Draws
from edgespec.decoding.recycling import SuccessorTable, recycled_tree
from edgespec.decoding.token_dist import Candidates
from edgespec.decoding.tree import (
    DraftTree,
    accept_tree_coupled,
    accept_tree_greedy,
    best_shape,
    expected_tree_tokens,
    shape_size,
    tree_shapes,
)
from tests.toy import ToyRuntime, naive_greedy

MIN_EXPECTED = 5  # chi-square needs about 5 expected counts per bin: rarer tokens share one bin
P_MIN = 1e-3


def dists(rows) -> list:
    """Dense probability rows as the distributions acceptance takes."""
    return [Candidates.from_row(r) for r in np.atleast_2d(rows)]

# node:    1  2  3  4  5        0 ─┬─ 1 ─┬─ 3 ── 5
# parent:  0  0  1  1  3           │     └─ 4
#                                  └─ 2
TREE = DraftTree((10, 11, 12, 13, 14), (0, 0, 1, 1, 3))


def chi_square_p(counts: np.ndarray, p: np.ndarray) -> float:
    """As tests/test_sampling_engine.py: rare tokens share one bin (impossible ones are checked apart)."""
    n = counts.sum()
    big, rare = n * p >= MIN_EXPECTED, (p > 0) & (n * p < MIN_EXPECTED)
    obs, exp = counts[big], n * p[big]
    if rare.any():
        obs, exp = np.append(obs, counts[rare].sum()), np.append(exp, n * p[rare].sum())
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def best_rows(best: list[int], vocab: int = 20) -> np.ndarray:
    """Logits whose row i has its argmax at best[i]."""
    logits = np.zeros((len(best), vocab), dtype=np.float32)
    logits[np.arange(len(best)), best] = 1.0
    return logits


# ---------------------------------------------------------------- the tree


def test_tree_structure():
    assert TREE.n == 5 and TREE.max_depth == 3
    assert TREE.depths() == (0, 1, 1, 2, 2, 3)
    assert TREE.path_to(5) == (0, 1, 3, 5) and TREE.path_to(2) == (0, 2) and TREE.path_to(0) == (0,)
    assert [TREE.children(i) for i in range(6)] == [(1, 2), (3, 4), (), (5,), (), ()]
    assert TREE.row_parents() == (-1, 0, 0, 1, 1, 3)
    with pytest.raises(ValueError, match="not in a tree of 5"):
        TREE.path_to(6)


def test_chain_and_empty_trees():
    chain = DraftTree.chain([4, 4, 6])
    assert chain.parents == (0, 1, 2) and chain.depths() == (0, 1, 2, 3) and chain.row_parents() == (-1, 0, 1, 2)
    assert chain.children(1) == (2,) and chain.path_to(3) == (0, 1, 2, 3)
    empty = DraftTree.chain([])
    assert empty.n == 0 and empty.max_depth == 0 and empty.row_parents() == (-1,) and empty.children(0) == ()


def test_tree_normalises_integers_and_is_hashable():
    tree = DraftTree(np.array([10, 11]), [0, np.int64(1)])
    assert tree.tokens == (10, 11) and tree.parents == (0, 1) and type(tree.tokens[0]) is int
    assert tree == DraftTree.chain([10, 11]) and hash(tree) == hash(DraftTree.chain([10, 11]))


@pytest.mark.parametrize(
    ("tokens", "parents", "message"),
    [
        ((1, 2), (0,), "2 tokens but 1 parents"),
        ((1, 2), (0, 2), "node 2's parent must be a node in 0..1, got 2"),
        ((1,), (-1,), "node 1's parent must be a node in 0..0, got -1"),
        ((1, -3), (0, 1), "tokens must be >= 0"),
        ((1, 2, 1), (0, 0, 0), "siblings repeat a token"),
        ((1.5,), (0,), "tokens must be integers"),
    ],
)
def test_tree_validation(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        DraftTree(tokens, parents)


def test_the_same_token_under_different_parents_is_allowed():
    assert DraftTree((1, 2, 5, 5), (0, 0, 1, 2)).depths() == (0, 1, 1, 2, 2)


def test_a_tree_pays_only_where_extra_rows_are_cheap():
    # the table's top-1 is right 60% of the time, its top-2 80%, top-3 85%
    reach = [0.6, 0.8, 0.85] + [0.9] * 5
    assert expected_tree_tokens((1, 1), reach) == pytest.approx(1 + 0.6 + 0.36)
    assert expected_tree_tokens((2, 1), reach) == pytest.approx(1 + 0.8 + 0.8 * 0.6)
    flat = [1.0 + 0.01 * i for i in range(17)]  # rows nearly free (a wide GPU-like verify)
    steep = [1.0 + 0.5 * i for i in range(17)]  # every row half a plain step (llama.cpp on a CPU)
    assert best_shape(reach, flat, 16) != tuple([1] * len(best_shape(reach, flat, 16)))  # a tree
    assert set(best_shape(reach, steep, 16)) == {1}  # a chain
    assert shape_size(best_shape(reach, steep, 3)) <= 3 and shape_size(best_shape(reach, flat, 4)) <= 4


# ---------------------------------------------------------------- recycled trees


def filled_table(vocab: int = 20) -> SuccessorTable:
    """1 → 2 3 4, 2 → 5 6 7, 3 → 5 8 9, 5 → 1 2 3; 4 and the rest never scored."""
    table = SuccessorTable(vocab, k=3)
    rows = {1: (2, 3, 4), 2: (5, 6, 7), 3: (5, 8, 9), 5: (1, 2, 3)}
    logits = np.zeros((len(rows), vocab), dtype=np.float32)
    for r, successors in enumerate(rows.values()):
        logits[r, list(successors)] = (5.0, 4.0, 3.0)
    table.update(list(rows), logits)
    return table


def test_recycled_tree_takes_the_table_best_first_and_stops_where_it_is_empty():
    table = filled_table()
    # depth first: the first-children path 2 5 1 is rows 1..3, as in a chain
    assert recycled_tree(table, 1, (2, 1, 1)) == DraftTree((2, 5, 1, 3, 5, 1), (0, 1, 2, 0, 4, 5))
    # 4 was never scored: its branch ends, its siblings' go on
    assert recycled_tree(table, 1, (3, 1)) == DraftTree((2, 5, 3, 5, 4), (0, 1, 0, 3, 0))
    assert recycled_tree(table, 1, (1, 2)) == DraftTree((2, 5, 6), (0, 1, 1))
    assert recycled_tree(table, 4, (3, 3)).n == 0
    for n in range(1, 7):  # widths of 1 are the chain drafter's proposal
        assert list(recycled_tree(table, 1, (1,) * n).tokens) == table.chain(1, n)


def test_recycled_tree_skips_repeated_and_missing_successors():
    table = filled_table()
    table.rows[7] = (8, 8, 9)
    assert recycled_tree(table, 7, (3,)) == DraftTree((8, 9), (0, 0))
    table.rows[7] = (-1, 6, 9)
    assert recycled_tree(table, 7, (2,)) == DraftTree((6,), (0,))


def test_recycled_tree_validation():
    table = filled_table()
    for widths in [(0,), (4,), (2, 1.0), (True,)]:
        with pytest.raises(ValueError, match=r"integers in 1\.\.3"):
            recycled_tree(table, 1, widths)
    for root in (-1, 20):
        with pytest.raises(ValueError, match="outside the table's vocabulary of 20"):
            recycled_tree(table, root, (1,))


def test_tree_shapes_menu():
    shapes = tree_shapes(8)
    assert len(set(shapes)) == len(shapes)
    assert all(shape_size(s) <= 8 for s in shapes)
    assert {(1,) * n for n in range(1, 9)} <= set(shapes)
    assert {(2, 1, 1, 1), (3, 1), (2, 2)} <= set(shapes) and (3, 1, 1) not in shapes
    assert tree_shapes(1) == ((1,),)
    assert shape_size((2, 2, 1)) == 10 and shape_size(()) == 0
    with pytest.raises(ValueError, match="max_nodes must be an integer >= 1"):
        tree_shapes(0)


def test_a_full_table_fills_every_shape():
    vocab = 30
    table = SuccessorTable(vocab, k=4)
    table.update(list(range(vocab)), np.random.default_rng(0).standard_normal((vocab, vocab)).astype(np.float32))
    for shape in tree_shapes(16):
        tree = recycled_tree(table, 3, shape)
        assert tree.n == shape_size(shape) and tree.max_depth == len(shape)
        assert tree.path_to(len(shape)) == tuple(range(len(shape) + 1))  # the top-1 path comes first
        depths = tree.depths()
        for node in range(tree.n + 1):  # each node at depth d has widths[d] children, the row's first
            kids = tree.children(node)
            width = shape[depths[node]] if depths[node] < len(shape) else 0
            token = 3 if node == 0 else tree.tokens[node - 1]
            assert [tree.tokens[c - 1] for c in kids] == table.rows[token, :width].tolist()


# ---------------------------------------------------------------- greedy acceptance


def test_greedy_on_a_chain_is_accept_greedy():
    lengths = []
    for seed in range(300):
        rng = np.random.default_rng(seed)
        k, vocab = int(rng.integers(0, 6)), 6
        logits = rng.standard_normal((k + 1, vocab)).astype(np.float32)
        # a prefix of the target's own argmax, then guesses: every acceptance length occurs
        drafts = np.argmax(logits[:k], axis=-1)
        cut = int(rng.integers(0, k + 1))
        drafts[cut:] = rng.integers(0, vocab, size=k - cut)
        n, nxt = accept_greedy(drafts, logits)
        accepted, token = accept_tree_greedy(DraftTree.chain(drafts.tolist()), logits)
        assert (accepted, token) == (list(range(1, n + 1)), nxt)
        lengths.append(n)
    assert set(lengths) == set(range(6))


def test_greedy_follows_the_branch_of_the_argmax():
    # rows 2, 3 and 5 are off the path root → 10 (node 1) → 13 (node 4): they must not matter
    assert accept_tree_greedy(TREE, best_rows([10, 13, 11, 14, 7, 0])) == ([1, 4], 7)
    assert accept_tree_greedy(TREE, best_rows([10, 12, 0, 14, 0, 2])) == ([1, 3, 5], 2)  # a leaf: the bonus
    assert accept_tree_greedy(TREE, best_rows([11, 12, 0, 14, 0, 2])) == ([2], 0)  # the second child
    assert accept_tree_greedy(TREE, best_rows([9, 12, 0, 14, 0, 2])) == ([], 9)  # no child: the correction
    logits = best_rows([10, 12, 0, 14, 0, 2])
    logits[0, 3] = 1.0  # a tie before token 10: np.argmax takes the first, as plain greedy does
    assert accept_tree_greedy(TREE, logits) == ([], 3)
    with pytest.raises(ValueError, match="need 6 rows of target logits for 5 drafts"):
        accept_tree_greedy(TREE, logits[:5])


def random_tree(rng: np.random.Generator, n: int, vocab: int) -> DraftTree:
    tokens: list[int] = []
    parents: list[int] = []
    for _ in range(n):
        parent = int(rng.integers(0, len(tokens) + 1))
        taken = {t for t, p in zip(tokens, parents) if p == parent}
        free = [t for t in range(vocab) if t not in taken]
        if free:
            tokens.append(int(rng.choice(free)))
            parents.append(parent)
    return DraftTree(tuple(tokens), tuple(parents))


def test_greedy_tree_commits_what_plain_greedy_decoding_does():
    vocab, prompt = 4, [1, 3, 2]
    model = ToyRuntime(vocab, seed=3)
    lengths = []
    for seed in range(150):
        tree = random_tree(np.random.default_rng(seed), 10, vocab)
        rows = []
        for node in range(tree.n + 1):  # row i: the target after prompt + the path to node i
            model.reset()
            path = [tree.tokens[v - 1] for v in tree.path_to(node)[1:]]
            rows.append(model.forward(prompt + path)[-1])
        accepted, token = accept_tree_greedy(tree, np.stack(rows))
        if accepted:
            assert tuple(accepted) == tree.path_to(accepted[-1])[1:]  # one root-to-node path
        committed = [tree.tokens[v - 1] for v in accepted] + [token]
        assert committed == naive_greedy(model, prompt, len(committed))
        lengths.append(len(accepted))
    assert min(lengths) == 0 and max(lengths) >= 3


# ---------------------------------------------------------------- sampled acceptance


def test_a_chain_tree_walks_as_chain_acceptance():
    outcomes = set()
    for seed in range(300):
        rng = np.random.default_rng(seed)
        k, vocab = int(rng.integers(0, 5)), 6
        probs = rng.dirichlet(np.full(vocab, 0.3), size=k + 1)
        drafts = [int(rng.choice(vocab, p=row)) for row in probs[:k]]  # likely drafts: long accepts
        if k and seed % 5 == 0:  # a draft the target is sure of, then one it rules out
            probs[0] = np.eye(vocab)[drafts[0]]
            if k > 1:
                probs[1, drafts[1]] = 0.0
                probs[1] /= probs[1].sum()
        n, nxt = accept_coupled(drafts, dists(probs), Draws(seed), 7)
        accepted, token = accept_tree_coupled(DraftTree.chain(drafts), dists(probs), Draws(seed), 7)
        assert (accepted, token) == (list(range(1, n + 1)), nxt)
        outcomes.add(n == k)
    assert outcomes == {True, False}


def test_point_masses_commit_the_target_distribution():
    vocab, n_runs = 8, 20000
    # root children 3, 0, 5 (5 impossible: p0[5] = 0); 3 → 2 → 7, 0 → 6 | 1
    tree = DraftTree((3, 0, 5, 2, 6, 1, 7), (0, 0, 0, 1, 2, 2, 4))
    rows = np.random.default_rng(7).dirichlet(np.ones(vocab), size=tree.n + 1)
    rows[0] = (0.30, 0.05, 0.15, 0.20, 0.10, 0.0, 0.12, 0.08)
    rows[5, 6] = 0.0  # node 5's row rules out a token
    rows[5] /= rows[5].sum()
    paths = [tuple(tree.tokens[v - 1] for v in tree.path_to(node)[1:]) for node in range(tree.n + 1)]
    after = np.zeros((tree.n + 1, vocab))  # after[v, x]: x was committed right after node v's path
    row_dists = dists(rows)
    for seed in range(n_runs):
        accepted, token = accept_tree_coupled(tree, row_dists, Draws(seed), 0)
        assert not accepted or tuple(accepted) == tree.path_to(accepted[-1])[1:]
        committed = tuple(tree.tokens[v - 1] for v in accepted) + (token,)
        for node, path in enumerate(paths):
            if committed[: len(path)] == path and len(committed) > len(path):
                after[node, committed[len(path)]] += 1
    assert after[0].sum() == n_runs and after[3].sum() == 0  # node 3 (token 5) is never accepted
    assert (after[rows == 0] == 0).all()
    tested = []
    for node in range(tree.n + 1):
        if after[node].sum() >= 500:  # the first token, the second after each branch, a third where frequent
            assert chi_square_p(after[node], rows[node]) > P_MIN, node
            tested.append(node)
    assert {0, 1, 2} < set(tested)
