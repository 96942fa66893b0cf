"""SequenceTracker: which sequence numbers of a worker slot were already processed."""

from __future__ import annotations

import random

from ps.core.dedup import SequenceTracker


def test_in_order_sequence_advances_the_floor() -> None:
    t = SequenceTracker()
    for seq in range(5):
        assert not t.seen(seq)
        t.mark(seq)
        assert t.seen(seq)
    assert t.floor == 4 and t.pending_above_floor == 0


def test_out_of_order_sequence_is_remembered_until_the_gap_closes() -> None:
    t = SequenceTracker()
    t.mark(2)
    t.mark(1)
    assert t.floor == -1 and t.pending_above_floor == 2
    assert t.seen(1) and t.seen(2) and not t.seen(0) and not t.seen(3)
    t.mark(0)
    assert t.floor == 2 and t.pending_above_floor == 0


def test_duplicates_are_seen_and_marking_them_again_changes_nothing() -> None:
    t = SequenceTracker()
    for seq in (0, 1, 3):
        t.mark(seq)
    before = t.state()
    for seq in (0, 1, 3, 3, 0):
        assert t.seen(seq)
        t.mark(seq)
    assert t.state() == before == {"floor": 1, "above": [3]}


def test_random_permutations_with_duplicates_end_fully_contiguous() -> None:
    rng = random.Random(7)
    for _ in range(50):
        order = list(range(40)) + rng.sample(range(40), 15)
        rng.shuffle(order)
        t = SequenceTracker()
        marked: set[int] = set()
        for seq in order:
            assert t.seen(seq) == (seq in marked)
            t.mark(seq)
            marked.add(seq)
        assert t.floor == 39 and t.pending_above_floor == 0


def test_state_round_trip_keeps_gaps() -> None:
    t = SequenceTracker()
    for seq in (0, 1, 5, 7):
        t.mark(seq)
    restored = SequenceTracker.from_state(t.state())
    assert [restored.seen(s) for s in range(9)] == [t.seen(s) for s in range(9)]
    restored.mark(2)
    assert restored.floor == 2


def test_a_resumed_floor_counts_everything_below_as_seen() -> None:
    t = SequenceTracker(floor=9)
    assert t.seen(0) and t.seen(9) and not t.seen(10)
