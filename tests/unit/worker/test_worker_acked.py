"""Which acknowledged pushes a failover lost (``worker.acked``): those whose versions are above the
new primary's, in step order, per shard, and each reported once."""

from __future__ import annotations

import pytest

from worker.acked import AckedPushes


def test_pushes_above_the_new_primarys_version_are_lost_in_step_order() -> None:
    acked: AckedPushes[str] = AckedPushes([8, 8])
    for seq, version in ((10, 101), (12, 105), (11, 103), (13, 106)):
        acked.note(0, seq, version, f"batch{seq}")
    acked.note(1, 13, 200, "other shard")
    lost = acked.lost(0, 103)
    assert [(a.seq, a.version, a.batch) for a in lost] == [(12, 105, "batch12"), (13, 106, "batch13")]
    assert acked.lost(0, 103) == []  # recomputed once: their new pushes are new acknowledgements
    assert [a.seq for a in acked.lost(0, 100)] == [10, 11]
    assert [a.seq for a in acked.lost(1, 199)] == [13]


def test_only_the_newest_are_kept_and_nothing_for_a_synchronous_shard() -> None:
    acked: AckedPushes[None] = AckedPushes([2, 0])
    for seq in range(5):
        acked.note(0, seq, seq + 1, None)
        acked.note(1, seq, seq + 1, None)
    assert [a.seq for a in acked.lost(0, 0)] == [3, 4]
    assert acked.lost(1, 0) == []  # a synchronous shard loses nothing acknowledged: no batch is held for it
    with pytest.raises(ValueError, match="keep must be >= 0"):
        AckedPushes([-1])
