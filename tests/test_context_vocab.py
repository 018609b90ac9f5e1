"""The draft's vocabulary widened by the sequence's tokens (decoding/context_vocab.py), alone."""
from __future__ import annotations

import numpy as np

from edgespec.decoding.context_vocab import ContextVocab
from edgespec.decoding.head_drafter import draft_index

VOCAB, H = 20, 3
ID_MAP = np.array([4, 0, 7])  # the trimmed head's three tokens
TABLE = np.arange(VOCAB * H, dtype=np.float32).reshape(VOCAB, H)  # a stand-in head: row t of token t


def vocab(limit: int = 100) -> ContextVocab:
    return ContextVocab(ID_MAP, VOCAB, lambda ids: TABLE[ids], lambda: draft_index(ID_MAP, VOCAB), limit)


def test_the_extension_holds_the_sequences_tokens_outside_the_head_in_order_of_arrival():
    cv = vocab()
    assert cv.update([4, 0, 7, 4]) is None  # all in the head: nothing to add
    ext = cv.update([4, 0, 7, 4, 9, 2, 9, 0, 2, 11])
    assert ext.ids.tolist() == [9, 2, 11] and ext.id_map.tolist() == [4, 0, 7, 9, 2, 11]
    np.testing.assert_array_equal(ext.rows, TABLE[[9, 2, 11]])
    # its logits: the head's K columns, then hidden . row for each extra token
    hidden = np.array([[1.0, 0.0, 2.0]], dtype=np.float32)
    wide = ext.logits(np.array([[5.0, 6.0, 7.0]]), hidden)
    np.testing.assert_allclose(wide, [[5, 6, 7, *(TABLE[[9, 2, 11]] @ hidden[0])]])
    # the inverse: every target id to its position in the widened row, the others outside (K + M)
    index = ext.index
    assert [int(index[t]) for t in (4, 0, 7, 9, 2, 11)] == list(range(6))
    assert all(int(index[t]) == 6 for t in range(VOCAB) if t not in (4, 0, 7, 9, 2, 11))
    # an earlier extension is unchanged when the sequence grows (it views the same buffers)
    before = ext.id_map.copy()
    grown = cv.update([4, 0, 7, 4, 9, 2, 9, 0, 2, 11, 13])
    assert grown.ids.tolist() == [9, 2, 11, 13] and ext.id_map.tolist() == before.tolist()


def test_a_new_sequence_starts_over_and_the_limit_holds():
    cv = vocab(limit=2)
    assert cv.update([9, 2, 11, 13]).ids.tolist() == [9, 2]  # at most two extra tokens
    ext = cv.update([5, 6])  # not a continuation: another conversation
    assert ext.ids.tolist() == [5, 6]
    assert cv.update([5, 6, 9]).ids.tolist() == [5, 6]
    # growth past the first buffers (64 rows) keeps every row, and earlier extensions' views
    table = np.arange(300 * H, dtype=np.float32).reshape(300, H)
    big = ContextVocab(ID_MAP, 300, lambda ids: table[ids], lambda: draft_index(ID_MAP, 300), limit=1000)
    first = big.update(list(range(50)))
    ext = big.update(list(range(50)) + list(range(50, 300)))
    assert ext.ids.tolist() == [t for t in range(300) if t not in ID_MAP]
    np.testing.assert_array_equal(ext.rows, table[ext.ids])
    assert len(first.ids) == 47
    np.testing.assert_array_equal(first.rows, table[first.ids])
