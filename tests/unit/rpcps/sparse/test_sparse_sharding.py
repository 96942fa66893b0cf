"""rpcps.sparse.sharding: bucket hashing and the bucket -> server manifest."""

from __future__ import annotations

import pytest
import torch

from rpcps.sparse.row_init import RowInitConfig, initial_rows
from rpcps.sparse.sharding import BucketManifest, BucketRange, bucket_of, in_ranges


def test_buckets_are_deterministic_even_and_depend_on_the_table() -> None:
    ids = torch.arange(-200_000, 200_000)
    buckets = bucket_of(ids, table_id=1)
    assert torch.equal(buckets, bucket_of(ids.clone(), table_id=1))
    assert int(buckets.min()) >= 0 and int(buckets.max()) < 4096
    counts = torch.bincount(buckets, minlength=4096).double()
    assert float(counts.std() / counts.mean()) < 0.11  # 97.7 ids a bucket: Poisson noise alone is 0.101
    assert float((buckets == bucket_of(ids, table_id=2)).double().mean()) < 0.01


def test_bucket_hash_is_independent_of_the_row_initialisation() -> None:
    ids = torch.arange(100_000)
    first = initial_rows(RowInitConfig(kind="uniform", scale=1.0), 0, ids, 1)[:, 0]
    low = bucket_of(ids, table_id=0, num_buckets=2) == 0
    # If the hashes were related, rows of one bucket would lean to one side of the init range.
    assert abs(float(first[low].mean())) < 0.02 and abs(float(first[~low].mean())) < 0.02


def test_even_manifest_tiles_the_buckets_and_routes_ids_to_their_range() -> None:
    m = BucketManifest.even(3, num_buckets=4096)
    assert [(r.lo, r.hi, r.server) for r in m.ranges] == [(0, 1365, 0), (1365, 2730, 1), (2730, 4096, 2)]
    ids = torch.arange(30_000)
    servers = m.server_of(ids, table_id=4)
    buckets = bucket_of(ids, table_id=4)
    for s in range(3):
        assert bool(in_ranges(buckets[servers == s], m.ranges_of(s)).all())
    assert torch.bincount(servers).tolist() == pytest.approx([10_000] * 3, rel=0.05)


def test_manifest_round_trips_through_json() -> None:
    m = BucketManifest(
        num_buckets=16,
        num_servers=2,
        ranges=(BucketRange(lo=0, hi=4, server=1), BucketRange(lo=4, hi=12, server=0), BucketRange(lo=12, hi=16, server=1)),
    )
    assert BucketManifest.from_json(m.to_json()) == m
    assert m.ranges_of(1) == [(0, 4), (12, 16)]


@pytest.mark.parametrize(
    ("ranges", "servers", "message"),
    [
        ([(0, 8, 0), (9, 16, 1)], 2, "does not start at 8"),
        ([(0, 8, 0), (8, 8, 1), (8, 16, 1)], 2, "does not start at 8"),
        ([(0, 8, 0), (8, 12, 1)], 2, "ranges end at bucket 12, not at num_buckets=16"),
        ([(0, 8, 0), (8, 16, 2)], 2, r"names server 2; servers are 0..1"),
        ([(0, 16, 0)], 2, r"servers \[1\] own no bucket"),
    ],
)
def test_manifests_that_do_not_tile_are_refused(ranges: list[tuple[int, int, int]], servers: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BucketManifest(
            num_buckets=16, num_servers=servers, ranges=tuple(BucketRange(lo=a, hi=b, server=s) for a, b, s in ranges)
        )


def test_bad_json_and_bad_server_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="not a bucket manifest"):
        BucketManifest.from_json('{"num_buckets": 4}')
    with pytest.raises(ValueError, match="not a bucket manifest"):
        BucketManifest.from_json("nope")
    with pytest.raises(ValueError, match=r"num_servers must be in \[1, num_buckets=4\], got 5"):
        BucketManifest.even(5, num_buckets=4)
