"""ps.sparse.slab.RowSlab: row allocation with a free list, growth, the dirty log, decayed counts."""

from __future__ import annotations

import pytest
import torch

from ps.sparse.slab import LIVE, RowSlab, decayed_count


def test_released_rows_are_reused_before_the_high_water_mark_moves() -> None:
    slab = RowSlab(width=3, initial_rows=4)
    first = slab.allocate(5)
    assert first.tolist() == [0, 1, 2, 3, 4] and slab.high_water == 5 and len(slab) == 5
    slab.release(torch.tensor([1, 3]))
    assert len(slab) == 3 and slab.free_rows == 2
    assert slab.live_rows(0, 10).tolist() == [0, 2, 4]
    again = slab.allocate(3)
    assert sorted(again.tolist()) == [1, 3, 5] and slab.high_water == 6 and slab.free_rows == 0
    assert bool(((slab.flags[:6] & LIVE) != 0).all())


def test_growth_keeps_rows_and_metadata() -> None:
    slab = RowSlab(width=2, initial_rows=2, growth=1.5)
    rows = slab.allocate(2)
    slab.data[rows] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    slab.last_seen[rows] = torch.tensor([7, 8], dtype=torch.int32)
    slab.count[rows] = torch.tensor([1.5, 2.5], dtype=torch.float16)
    slab.allocate(100)
    assert slab.capacity >= 102
    assert slab.data[:2].tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert slab.last_seen[:2].tolist() == [7, 8] and slab.count[:2].tolist() == [1.5, 2.5]


def test_dirty_log_yields_each_live_dirty_row_once() -> None:
    slab = RowSlab(width=1)
    rows = slab.allocate(6)
    slab.mark_dirty(rows[:4])
    slab.mark_dirty(torch.tensor([2, 3, 5]))  # 2 and 3 again: logged once
    slab.release(torch.tensor([1]))  # released: not in the delta
    slab.release(torch.tensor([3]))
    reused = slab.allocate(1)  # row 3 comes back for another id and is dirtied again
    assert reused.tolist() == [3]
    slab.mark_dirty(reused)
    assert sorted(slab.dirty_rows().tolist()) == [0, 2, 3, 5]
    assert sorted(slab.take_dirty().tolist()) == [0, 2, 3, 5]
    assert slab.take_dirty().tolist() == [] and slab.dirty_bound == 0
    slab.mark_dirty(torch.tensor([0]))
    assert slab.take_dirty().tolist() == [0]


def test_touch_decays_the_count_lazily_and_saturates() -> None:
    slab = RowSlab(width=1)
    rows = slab.allocate(2)
    slab.last_seen[rows] = 0
    slab.count[rows] = torch.tensor([4.0, 65504.0], dtype=torch.float16)
    slab.touch(rows, now=2, decay=0.5)
    # 65504 / 4 + 1 = 16377 rounds to float16's nearest, 16376 (spacing 8 there): +1 is lost up high.
    assert slab.count[rows].tolist() == [2.0, 16376.0] and slab.last_seen[rows].tolist() == [2, 2]
    slab.count[rows] = 65504.0
    slab.touch(rows, now=2, decay=1.0)
    assert slab.count[rows].tolist() == [65504.0, 65504.0]


def test_decayed_count_never_grows_for_rows_seen_in_the_future() -> None:
    count = torch.tensor([8.0], dtype=torch.float16)
    assert decayed_count(count, torch.tensor([10], dtype=torch.int32), 5, 0.5).tolist() == [8.0]
    assert decayed_count(count, torch.tensor([2], dtype=torch.int32), 5, 0.5).tolist() == [1.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"width": 0}, "width must be >= 1"),
        ({"width": 1, "initial_rows": 0}, "initial_rows must be >= 1"),
        ({"width": 1, "growth": 1.0}, r"growth must be in \[1.1, 4\]"),
    ],
)
def test_bad_shapes_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RowSlab(**kwargs)  # type: ignore[arg-type]


def test_a_log_past_an_eighth_of_the_rows_gives_way_to_a_scan_with_the_same_answer() -> None:
    slab = RowSlab(width=1)
    rows = slab.allocate(800_000)
    slab.mark_dirty(rows[:99_000])
    assert slab.dirty_bound == 99_000 and slab.nbytes() == 800_000 * 11 + 99_000 * 4
    slab.mark_dirty(rows[99_000:100_001])  # 100_001 > 800_000 / 8: the log is dropped
    assert slab.dirty_bound == len(slab) and slab.nbytes() == 800_000 * 11
    slab.release(rows[:10])
    slab.mark_dirty(rows[-5:])
    assert torch.equal(slab.dirty_rows(), torch.cat([rows[10:100_001], rows[-5:]]))
    assert torch.equal(slab.take_dirty(), torch.cat([rows[10:100_001], rows[-5:]]))
    assert slab.take_dirty().numel() == 0
    slab.mark_dirty(rows[50:51])  # logging again after the scan
    assert slab.dirty_bound == 1 and slab.take_dirty().tolist() == [50]
