"""FlatLayout packing and ModelSignature comparison: pure logic, no processes."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from rpcps.signature import WIRE_DTYPE, FlatLayout, ModelSignature, ParamSpec


def _signature(numels: list[int]) -> ModelSignature:
    return ModelSignature(tuple(ParamSpec(f"p{i}", (n,), "float32") for i, n in enumerate(numels)))


def _check_packing(layout: FlatLayout, limit_elems: int) -> None:
    """Every invariant of a layout: order kept, params contiguous, never split, chunks within the limit."""
    numels = [s.spec.numel for s in layout.slots]
    assert [s.spec for s in layout.slots] == list(layout.signature.params)
    ends = {}
    for slot in layout.slots:
        assert slot.offset == ends.get(slot.chunk, 0), "a gap or overlap inside a chunk"
        ends[slot.chunk] = slot.offset + slot.spec.numel
    assert tuple(ends[c] for c in range(len(layout))) == layout.chunk_numels
    assert sum(layout.chunk_numels) == sum(numels)
    chunks_in_order = [s.chunk for s in layout.slots]
    assert chunks_in_order == sorted(chunks_in_order), "parameters must stay in signature order"
    for c, size in enumerate(layout.chunk_numels):
        members = [s for s in layout.slots if s.chunk == c]
        assert members, f"chunk {c} is empty"
        if size > limit_elems:  # only a single oversized parameter may exceed the limit
            assert len(members) == 1 and members[0].spec.numel > limit_elems


@pytest.mark.parametrize("seed", range(20))
def test_random_layouts_respect_the_chunk_limit(seed: int) -> None:
    rng = random.Random(seed)
    chunk_bytes = rng.choice([16, 64, 400, 4096])
    limit = chunk_bytes // WIRE_DTYPE.itemsize
    numels = [rng.choice([1, 2, 3, limit - 1, limit, limit + 1, 3 * limit, rng.randint(1, 2 * limit)]) for _ in range(rng.randint(1, 30))]
    layout = FlatLayout(_signature(numels), chunk_bytes)
    _check_packing(layout, limit)


def test_small_parameters_share_chunks_greedily() -> None:
    layout = FlatLayout(_signature([3, 3, 3, 3]), chunk_bytes=4 * 7)  # 7 floats per chunk
    assert layout.chunk_numels == (6, 6)
    assert [(s.chunk, s.offset) for s in layout.slots] == [(0, 0), (0, 3), (1, 0), (1, 3)]


def test_oversized_parameter_gets_a_chunk_of_its_own() -> None:
    layout = FlatLayout(_signature([2, 100, 2, 2]), chunk_bytes=4 * 10)
    assert layout.chunk_numels == (2, 100, 4)
    assert [s.chunk for s in layout.slots] == [0, 1, 2, 2]


def test_oversized_first_parameter_is_not_preceded_by_an_empty_chunk() -> None:
    layout = FlatLayout(_signature([100, 1]), chunk_bytes=4 * 10)
    assert layout.chunk_numels == (100, 1)


def test_parameter_exactly_at_the_limit_fills_a_chunk() -> None:
    layout = FlatLayout(_signature([10, 10, 1]), chunk_bytes=40)
    assert layout.chunk_numels == (10, 10, 1)


def test_chunk_limit_below_one_float_is_refused() -> None:
    with pytest.raises(ValueError, match="chunk_bytes must be >= 4"):
        FlatLayout(_signature([1]), chunk_bytes=3)


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3), nn.Conv1d(3, 2, 2))


@pytest.mark.parametrize("chunk_bytes", [4, 64, 1024, 1 << 20])
def test_views_round_trip_parameters_exactly(chunk_bytes: int) -> None:
    model = _model()
    layout = FlatLayout(ModelSignature.of_module(model), chunk_bytes)
    chunks = [torch.full((n,), float("nan")) for n in layout.chunk_numels]
    params = [p for p in model.parameters()]
    for view, p in zip(layout.views(chunks), params):
        view.copy_(p.detach())
    assert all(not torch.isnan(c).any() for c in chunks), "the views must cover every chunk element"
    for view, p in zip(layout.views(chunks), params):
        assert view.shape == p.shape
        assert torch.equal(view, p.detach())
    # Views alias the chunks: writing through one changes the wire buffer.
    layout.views(chunks)[-1].fill_(7.0)
    last = layout.slots[-1]
    assert torch.all(chunks[last.chunk][last.offset : last.offset + last.spec.numel] == 7.0)


def test_param_at_names_the_owner_of_an_element() -> None:
    layout = FlatLayout(ModelSignature.of_module(_model()), chunk_bytes=1 << 20)
    assert layout.param_at(0, 0) == "0.weight"
    assert layout.param_at(0, 35) == "0.bias"  # 0.weight has 35 elements
    assert "element 10000" in layout.param_at(0, 10_000)


def test_signature_skips_frozen_and_refuses_integer_parameters() -> None:
    model = _model()
    model[0].bias.requires_grad_(False)
    names = [p.name for p in ModelSignature.of_module(model).params]
    assert "0.bias" not in names and "0.weight" in names

    class IntParam(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.count = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
            self.w = nn.Parameter(torch.zeros(2))

    # An integer parameter cannot require grad, so it is skipped rather than refused.
    assert [p.name for p in ModelSignature.of_module(IntParam()).params] == ["w"]
    with pytest.raises(ValueError, match="no trainable parameters"):
        ModelSignature.of_module(nn.ReLU())


def test_signature_wire_round_trip_and_digest() -> None:
    sig = ModelSignature.of_module(_model())
    assert ModelSignature.from_wire(sig.to_wire()) == sig
    assert sig.digest() == ModelSignature.from_wire(sig.to_wire()).digest()
    other = ModelSignature.of_module(nn.Linear(7, 5))
    assert sig.digest() != other.digest()


def _sig(*specs: tuple[str, tuple[int, ...], str]) -> ModelSignature:
    return ModelSignature(tuple(ParamSpec(n, s, t) for n, s, t in specs))


SERVER = _sig(("a", (2, 3), "float32"), ("b", (3,), "float32"), ("c", (1,), "float32"))


@pytest.mark.parametrize(
    ("worker", "expected"),
    [
        (SERVER, None),
        (_sig(("a", (2, 4), "float32"), ("b", (3,), "float32"), ("c", (1,), "float32")),
         "parameter 'a' has shape [2, 4] on the worker but [2, 3] on the server"),
        (_sig(("a", (2, 3), "float32"), ("b", (3,), "float16"), ("c", (1,), "float32")),
         "parameter 'b' has dtype float16 on the worker but float32 on the server"),
        (_sig(("a", (2, 3), "float32"), ("x", (3,), "float32"), ("c", (1,), "float32")),
         "parameter #1 is 'x', which the server's model does not have (server has 'b' there)"),
        (_sig(("a", (2, 3), "float32"), ("c", (1,), "float32")),
         "parameter #1 'b' is missing from the worker's model"),
        (_sig(("a", (2, 3), "float32"), ("c", (1,), "float32"), ("b", (3,), "float32")),
         "parameter #1 is 'c' on the worker but 'b' on the server (different order)"),
        (_sig(("a", (2, 3), "float32"), ("b", (3,), "float32")),
         "parameter 'c' is missing from the worker's model"),
        (_sig(("a", (2, 3), "float32"), ("b", (3,), "float32"), ("c", (1,), "float32"), ("d", (4,), "float32")),
         "parameter 'd' is not in the server's model"),
    ],
    ids=["equal", "shape", "dtype", "renamed", "missing-middle", "order", "missing-last", "extra-last"],
)
def test_first_difference_names_the_first_differing_parameter(worker: ModelSignature, expected: str | None) -> None:
    assert SERVER.first_difference(worker) == expected


def test_first_difference_reports_only_the_first_of_several() -> None:
    worker = _sig(("a", (2, 3), "float64"), ("b", (9,), "float32"), ("c", (1,), "float32"))
    assert SERVER.first_difference(worker) == "parameter 'a' has dtype float64 on the worker but float32 on the server"


def test_first_difference_names_both_sides_as_asked() -> None:
    worker = _sig(("a", (2, 3), "float32"), ("b", (4,), "float32"), ("c", (1,), "float32"))
    assert SERVER.first_difference(worker, ours="server", theirs="snapshot") == (
        "parameter 'b' has shape [4] on the snapshot but [3] on the server"
    )
