"""rpcps.sparse.hashing: splitmix64 in int64 torch ops equals the reference on Python ints, bit for bit."""

from __future__ import annotations

import random

import pytest
import torch

from rpcps.sparse.hashing import (
    GOLDEN,
    derive_key,
    keyed_hash,
    mix64,
    mix64_int,
    reduce_range,
    shift_right_logical,
    standard_normal,
    stream_at,
    to_int64,
    uniform01,
)

_EDGES = [0, 1, -1, 2, -2, 2**31, -(2**31), 2**32 + 7, 2**62, 2**63 - 1, -(2**63), -(2**63) + 1, 0x5555_5555_5555_5555]


def _splitmix64_reference(seed: int, count: int) -> list[int]:
    """The published splitmix64 generator (unsigned arithmetic on Python ints)."""
    out, state, mask = [], seed, (1 << 64) - 1
    for _ in range(count):
        state = (state + GOLDEN) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(z ^ (z >> 31))
    return out


def test_known_splitmix64_outputs_for_seed_zero() -> None:
    # Published first outputs of splitmix64 seeded with 0 (e.g. Vigna's splitmix64.c).
    expected = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert _splitmix64_reference(0, 3) == expected
    assert [int(stream_at(torch.tensor([0]), j)) for j in range(3)] == [to_int64(x) for x in expected]


def test_tensor_mixer_matches_python_ints_bit_for_bit() -> None:
    rng = random.Random(7)
    values = _EDGES + [rng.randrange(-(2**63), 2**63) for _ in range(2000)]
    got = mix64(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [mix64_int(v) for v in values]


def test_stream_matches_the_reference_generator_for_negative_and_extreme_keys() -> None:
    keys = torch.tensor(_EDGES, dtype=torch.int64)
    got = torch.stack([stream_at(keys, j) for j in range(5)], dim=1).tolist()
    for key, row in zip(_EDGES, got, strict=True):
        assert row == [to_int64(x) for x in _splitmix64_reference(key & ((1 << 64) - 1), 5)]


def test_logical_shift_copies_no_sign_bits() -> None:
    values = torch.tensor(_EDGES, dtype=torch.int64)
    for bits in (1, 11, 30, 40, 63):
        got = shift_right_logical(values, bits).tolist()
        assert got == [(v & ((1 << 64) - 1)) >> bits for v in _EDGES]


def test_mixer_leaves_its_input_alone() -> None:
    x = torch.tensor(_EDGES, dtype=torch.int64)
    before = x.clone()
    mix64(x)
    assert torch.equal(x, before)


def test_derive_key_depends_on_every_part_and_their_order() -> None:
    keys = {derive_key(1, 2, 3), derive_key(3, 2, 1), derive_key(1, 2), derive_key(1, 2, 4), derive_key(1, 2, 3, 0)}
    assert len(keys) == 5
    assert derive_key(1, 2, 3) == derive_key(1, 2, 3)


def test_keyed_hash_refuses_other_dtypes() -> None:
    with pytest.raises(TypeError, match="int64"):
        keyed_hash(torch.arange(3, dtype=torch.int32), 1)


def test_reduce_range_is_in_range_and_even() -> None:
    h = keyed_hash(torch.arange(200_000), derive_key(9))
    for n in (1, 7, 4096, 1_000_003):
        r = reduce_range(h, n)
        assert int(r.min()) >= 0 and int(r.max()) < n
    counts = torch.bincount(reduce_range(h, 10), minlength=10).double()
    assert float((counts - 20_000).abs().max()) < 600  # ~4 sigma of a binomial(200k, 0.1)
    with pytest.raises(ValueError, match=r"range size must be in \[1, 2\*\*31\)"):
        reduce_range(h, 0)
    with pytest.raises(ValueError, match=r"range size"):
        reduce_range(h, 1 << 31)


def test_uniform_values_are_exact_multiples_of_two_to_the_minus_24_in_unit_interval() -> None:
    u = uniform01(keyed_hash(torch.arange(100_000), derive_key(1)))
    assert u.dtype == torch.float32
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    scaled = u.double() * 2**24
    assert torch.equal(scaled, scaled.round())
    assert abs(float(u.mean()) - 0.5) < 0.01


def test_standard_normal_has_unit_moments() -> None:
    z = standard_normal(keyed_hash(torch.arange(200_000), derive_key(2)))
    assert z.dtype == torch.float32 and bool(torch.isfinite(z).all())
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01
