"""The examples' sharded stream: disjoint covering shards, whole epochs, reshuffles, O(1) seek."""

from __future__ import annotations

import itertools

import pytest
import torch

from rpcps.examples.stream import ShardedStream


def _stream(worker_index: int = 0, num_workers: int = 1, *, n: int = 103, batch_size: int = 8, seed: int = 0) -> ShardedStream:
    # fetch returns the indices themselves, so a batch shows exactly which samples it holds.
    return ShardedStream(
        num_samples=n, worker_index=worker_index, num_workers=num_workers, batch_size=batch_size, seed=seed,
        fetch=lambda idx: (idx, idx),
    )


def _first_samples(stream: ShardedStream, count: int) -> list[int]:
    out: list[int] = []
    for inputs, _ in stream:
        out += inputs.tolist()
        if len(out) >= count:
            return out[:count]
    raise AssertionError("unreachable: the stream is endless")


def test_shards_are_disjoint_and_cover_every_sample() -> None:
    shards = [set(_stream(i, 4).shard.tolist()) for i in range(4)]
    for a, b in itertools.combinations(shards, 2):
        assert not a & b
    assert set().union(*shards) == set(range(103))


@pytest.mark.parametrize("worker_index", [0, 3])
def test_each_epoch_reads_the_whole_shard_once(worker_index: int) -> None:
    stream = _stream(worker_index, 4)
    n = len(stream.shard)
    samples = _first_samples(stream, 3 * n)
    for epoch in range(3):
        assert sorted(samples[epoch * n : (epoch + 1) * n]) == sorted(stream.shard.tolist())
    assert samples[:n] != samples[n : 2 * n], "epochs must be reshuffled"


def test_seek_gives_the_batch_that_iterating_reaches() -> None:
    walked = _stream(1, 3)
    batches = list(itertools.islice(walked, 40))  # 40 batches of 8 cross several 34-sample epochs
    for k in (0, 1, 4, 5, 39):
        jumped = _stream(1, 3)
        jumped.seek(k)
        assert torch.equal(next(iter(jumped))[0], batches[k][0])


def test_same_seed_same_stream_other_seed_or_worker_another() -> None:
    first = _stream(0, 2, seed=7).indices(0)
    assert torch.equal(_stream(0, 2, seed=7).indices(0), first)
    assert not torch.equal(_stream(0, 2, seed=8).indices(0), first)
    # Worker 1's shard holds other samples; compare the order it reads its own shard in instead.
    order0 = _stream(0, 2, seed=7).indices(0) // 2
    order1 = (_stream(1, 2, seed=7).indices(0) - 1) // 2
    assert not torch.equal(order0, order1)


def test_a_shard_smaller_than_a_batch_fills_the_batch_from_later_epochs() -> None:
    stream = _stream(1, 2, n=5, batch_size=8)  # shard {1, 3}
    inputs, _ = next(iter(stream))
    assert len(inputs) == 8
    assert sorted(inputs.tolist()) == [1] * 4 + [3] * 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_workers": 104}, r"num_workers must be in \[1, 103\]"),
        ({"num_workers": 0}, r"num_workers must be in \[1, 103\]"),
        ({"worker_index": 2, "num_workers": 2}, r"worker_index must be in \[0, 2\)"),
        ({"batch_size": 0}, "batch_size must be >= 1"),
    ],
)
def test_bad_settings_name_the_field(kwargs: dict[str, int], message: str) -> None:
    args = {"worker_index": 0, "num_workers": 1, "batch_size": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        _stream(args["worker_index"], args["num_workers"], batch_size=args["batch_size"])


def test_seek_refuses_a_negative_batch() -> None:
    with pytest.raises(ValueError, match="batch_index must be >= 0"):
        _stream().seek(-1)
