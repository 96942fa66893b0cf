"""ps.sparse.row_image.RowImage: row-numbered copies that patches and releases keep current."""

from __future__ import annotations

import torch

from ps.sparse.checkpoint import RowRecords
from ps.sparse.index import IdIndex
from ps.sparse.row_image import RowImage
from ps.sparse.slab import RowSlab


def _records(ids: list[int], value: float) -> RowRecords:
    n = len(ids)
    return RowRecords(
        ids=torch.tensor(ids, dtype=torch.int64),
        rows=torch.full((n, 2), value),
        last_seen=torch.full((n,), int(value), dtype=torch.int32),
        count=torch.full((n,), value, dtype=torch.float16),
    )


def test_copies_patches_and_releases_compose_by_row_number() -> None:
    slab, index = RowSlab(width=2), IdIndex()
    rows = slab.allocate(4)
    index.insert(torch.tensor([10, 11, 12, 13]), rows)
    slab.data[rows] = torch.arange(8, dtype=torch.float32).view(4, 2)
    slab.last_seen[rows] = 0
    slab.count[rows] = 1.0
    slab.release(torch.tensor([3]))
    image = RowImage(end=4, width=2)
    image.copy(0, 4, slab, index)  # row 3 is dead at copy time
    image.patch(torch.tensor([1, 5]), _records([21, 99], 7.0))  # row 1 now holds id 21; row 5 is past end
    image.release(torch.tensor([2, 6]))
    out = image.records(_records([30], 9.0))
    assert out.ids.tolist() == [10, 21, 30]
    assert out.rows.tolist() == [[0.0, 1.0], [7.0, 7.0], [9.0, 9.0]]
    assert out.last_seen.tolist() == [0, 7, 9] and out.count.tolist() == [1.0, 7.0, 9.0]
