"""Counter-based 64-bit hashing of id tensors, and its mapping to uniform and normal floats.

Every random-looking decision of the sparse tables (index slot, virtual bucket, row initialisation,
admission coin, count-min cells) is a pure function of (key, id) computed here, so it never depends on
arrival order, thread timing or which server owns the id. Each use passes its own key (``derive_key``
of a distinct salt), which keeps the uses statistically independent: the index slot of an id says
nothing about its bucket, so a server that owns only some buckets still spreads its ids evenly over
its index.

The mixer is the splitmix64 finaliser (Steele, Lea, Flood 2014), computed in int64 torch ops. Torch
integer addition and multiplication wrap modulo 2**64, which is what splitmix64 needs, but ``>>`` on
int64 is arithmetic (it copies the sign bit), so every right shift is masked to make it logical.
``mix64_int`` is the same function on Python ints; the tests check the two agree bit for bit.

Nothing here keeps state; nothing here may depend on the process, the platform's RNG or the time.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
"""splitmix64's increment (2**64 / golden ratio); the n-th output of a stream is mix64(key + n*GOLDEN)."""
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def to_int64(x: int) -> int:
    """The int64 (two's complement) value with the same low 64 bits as ``x``."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_MUL1_S = to_int64(_MUL1)
_MUL2_S = to_int64(_MUL2)


def mix64_int(x: int) -> int:
    """splitmix64's finaliser on a Python int (any value; taken modulo 2**64). Returns an int64 value."""
    z = x & _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return to_int64(z ^ (z >> 31))


def derive_key(*parts: int) -> int:
    """A 64-bit key that depends on every part and their order: a chain of mix64 over the parts."""
    key = 0
    for part in parts:
        key = mix64_int(key + GOLDEN + (part & _MASK64))
    return key


def shift_right_logical(z: torch.Tensor, bits: int) -> torch.Tensor:
    """``z >>> bits`` on int64: torch's ``>>`` is arithmetic, so the copied sign bits are masked off."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, elementwise on an int64 tensor (a new tensor; the input is untouched).

    In place on one copy and one scratch tensor: hashing [n, dim] streams is the bulk of creating
    rows, and every extra temporary of that size is allocator churn.
    """
    z = z.clone()
    scratch = torch.empty_like(z)
    for bits, multiplier in ((30, _MUL1_S), (27, _MUL2_S), (31, None)):
        torch.bitwise_right_shift(z, bits, out=scratch)
        scratch &= (1 << (64 - bits)) - 1
        z ^= scratch
        if multiplier is not None:
            z.mul_(multiplier)
    return z


def keyed_hash(ids: torch.Tensor, key: int) -> torch.Tensor:
    """A 64-bit hash of each id under ``key`` (int64 tensor, same shape)."""
    if ids.dtype != torch.int64:
        raise TypeError(f"ids must be an int64 tensor, got {ids.dtype}")
    return mix64(ids ^ to_int64(key))


def reduce_range(h: torch.Tensor, n: int) -> torch.Tensor:
    """Maps 64-bit hashes onto [0, n) by multiply-high of their top 32 bits (Lemire's reduction).

    Unlike ``h % n`` this needs no division and works for any n, not only powers of two; the product
    of two values below 2**32 and 2**31 fits in int64, hence the bound on n.
    """
    if not 0 < n < 1 << 31:
        raise ValueError(f"range size must be in [1, 2**31), got {n}")
    return (shift_right_logical(h, 32) * n) >> 32


def stream_at(row_keys: torch.Tensor, position: int) -> torch.Tensor:
    """Output ``position`` (0-based) of the splitmix64 generator seeded by each row key: int64 [n].

    The definition of a stream; ``stream_offsets`` computes many positions at once with the same bits.
    """
    return mix64(row_keys + to_int64((position + 1) * GOLDEN))


def stream_offsets(width: int) -> torch.Tensor:
    """int64 [width]: what ``stream_at`` adds to a row key for positions 0..width-1, so that
    ``mix64(row_keys.unsqueeze(1) + stream_offsets(width))`` is every position's output at once."""
    return torch.tensor([to_int64((position + 1) * GOLDEN) for position in range(width)], dtype=torch.int64)


def uniform01(h: torch.Tensor) -> torch.Tensor:
    """float32 in [0, 1) from the top 24 bits of each hash: exact, every value a multiple of 2**-24."""
    return shift_right_logical(h, 40).to(torch.float32) * (2.0**-24)


def standard_normal(h: torch.Tensor) -> torch.Tensor:
    """float32 N(0, 1) by inverting the normal CDF at a 53-bit uniform in (0, 1), computed in float64.

    One hash per value (no Box-Muller pairs), so element j of a row depends only on hash j. The
    inverse CDF is a libm-style polynomial: the same torch build on the same CPU gives the same bits;
    other platforms may differ in the last float64 bit, which the rounding to float32 almost always hides.
    """
    u = (shift_right_logical(h, 11).to(torch.float64) + 0.5) * (2.0**-53)
    return torch.special.ndtri(u).to(torch.float32)
