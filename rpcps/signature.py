"""Model signatures and the flat-buffer layout both roles agree on.

A signature is the ordered list of (name, shape, dtype) of a model's trainable parameters, and of its
persistent buffers (BatchNorm running statistics, anything registered with ``register_buffer`` that
``state_dict`` keeps): the server holds both, trains only the parameters (docs/FAULT_TOLERANCE.md,
"Buffers"). The layout
packs those parameters, in order, into a few contiguous fp32 chunks of at most ``chunk_bytes`` each, so
that a push or pull moves a handful of tensors instead of one message per parameter. A parameter is
never split across chunks; one larger than the limit gets a chunk of its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Single tensors of >= 32 MB are slowed by allocation on receive (see shared research notes); 16 MB
# pieces keep the wire busy without that cost.
DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024
WIRE_DTYPE = torch.float32


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


_BUFFER = "buffer"
"""Marks a buffer's entry on the wire: (name, shape, dtype, "buffer"); a parameter's has three fields,
so a signature without buffers is sent exactly as before buffers existed."""

WireSpec = tuple[str, list[int], str] | tuple[str, list[int], str, str]


def _spec(name: str, tensor: torch.Tensor) -> ParamSpec:
    return ParamSpec(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))


@dataclass(frozen=True)
class ModelSignature:
    params: tuple[ParamSpec, ...]
    buffers: tuple[ParamSpec, ...] = ()
    """Persistent buffers in ``named_buffers`` order, any dtype (``num_batches_tracked`` is int64)."""

    @classmethod
    def of_module(cls, module: torch.nn.Module) -> ModelSignature:
        specs = []
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            if not p.dtype.is_floating_point:
                raise ValueError(f"parameter {name!r} has dtype {p.dtype}; only floating-point parameters can be trained")
            specs.append(_spec(name, p))
        if not specs:
            raise ValueError("the model has no trainable parameters")
        return cls(tuple(specs), tuple(_spec(name, b) for name, b in persistent_buffers(module)))

    def to_wire(self) -> list[WireSpec]:
        return [(p.name, list(p.shape), p.dtype) for p in self.params] + [
            (b.name, list(b.shape), b.dtype, _BUFFER) for b in self.buffers
        ]

    @classmethod
    def from_wire(cls, items: list[WireSpec]) -> ModelSignature:
        specs: dict[bool, list[ParamSpec]] = {False: [], True: []}  # is it a buffer?
        for item in items:
            name, shape, dtype = item[0], item[1], item[2]
            specs[len(item) > 3 and item[3] == _BUFFER].append(ParamSpec(name, tuple(int(d) for d in shape), str(dtype)))
        return cls(tuple(specs[False]), tuple(specs[True]))

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def digest(self) -> str:
        h = hashlib.sha256()
        for p in self.params:
            h.update(f"{p.name}|{p.shape}|{p.dtype};".encode())
        for b in self.buffers:  # none: the same digest as before buffers were part of a signature
            h.update(f"{_BUFFER}:{b.name}|{b.shape}|{b.dtype};".encode())
        return h.hexdigest()[:16]

    def first_difference(self, other: ModelSignature, ours: str = "server", theirs: str = "worker") -> str | None:
        """Describes the first parameter, then the first buffer, where ``other`` (the ``theirs`` side)
        differs, or None."""
        return _first_difference("parameter", self.params, other.params, ours, theirs) or _first_difference(
            "buffer", self.buffers, other.buffers, ours, theirs
        )


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers ``module.state_dict()`` holds, in ``named_buffers`` order (non-persistent ones, often
    constants a model rebuilds itself, are left out as ``state_dict`` leaves them out)."""
    kept = set(module.state_dict(keep_vars=True))
    return [(name, b) for name, b in module.named_buffers() if name in kept]


def _first_difference(kind: str, mine: tuple[ParamSpec, ...], other: tuple[ParamSpec, ...], ours: str, theirs: str) -> str | None:
    my_names = {p.name for p in mine}
    their_names = {p.name for p in other}
    for i, (a, b) in enumerate(zip(mine, other)):
        if a == b:
            continue
        if a.name != b.name:
            if b.name not in my_names:
                return f"{kind} #{i} is {b.name!r}, which the {ours}'s model does not have ({ours} has {a.name!r} there)"
            if a.name not in their_names:
                return f"{kind} #{i} {a.name!r} is missing from the {theirs}'s model"
            return f"{kind} #{i} is {b.name!r} on the {theirs} but {a.name!r} on the {ours} (different order)"
        if a.shape != b.shape:
            return f"{kind} {a.name!r} has shape {list(b.shape)} on the {theirs} but {list(a.shape)} on the {ours}"
        return f"{kind} {a.name!r} has dtype {b.dtype} on the {theirs} but {a.dtype} on the {ours}"
    if len(mine) > len(other):
        return f"{kind} {mine[len(other)].name!r} is missing from the {theirs}'s model"
    if len(other) > len(mine):
        return f"{kind} {other[len(mine)].name!r} is not in the {ours}'s model"
    return None


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in the flat layout."""

    chunk: int
    offset: int
    spec: ParamSpec


class FlatLayout:
    """Packs a signature's parameters into contiguous fp32 chunks."""

    def __init__(self, signature: ModelSignature, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if chunk_bytes < 4:
            raise ValueError(f"chunk_bytes must be >= 4, got {chunk_bytes}")
        self.signature = signature
        limit = chunk_bytes // WIRE_DTYPE.itemsize
        slots: list[Slot] = []
        sizes: list[int] = []
        for spec in signature.params:
            if not sizes or (sizes[-1] > 0 and sizes[-1] + spec.numel > limit):
                sizes.append(0)
            slots.append(Slot(len(sizes) - 1, sizes[-1], spec))
            sizes[-1] += spec.numel
        self.slots: tuple[Slot, ...] = tuple(slots)
        self.chunk_numels: tuple[int, ...] = tuple(sizes)
        self._by_name = {s.spec.name: s for s in slots}

    def __len__(self) -> int:
        return len(self.chunk_numels)

    @property
    def nbytes(self) -> int:
        return sum(self.chunk_numels) * WIRE_DTYPE.itemsize

    def slot(self, name: str) -> Slot | None:
        return self._by_name.get(name)

    def empty_chunks(self, pin_memory: bool = False, dtype: torch.dtype = WIRE_DTYPE) -> list[torch.Tensor]:
        return [torch.zeros(n, dtype=dtype, pin_memory=pin_memory) for n in self.chunk_numels]

    def views(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per-parameter views into ``chunks``, in signature order."""
        return [chunks[s.chunk][s.offset : s.offset + s.spec.numel].view(s.spec.shape) for s in self.slots]

    def param_at(self, chunk: int, index: int) -> str:
        """Name of the parameter holding element ``index`` of ``chunk`` (for error messages)."""
        for s in self.slots:
            if s.chunk == chunk and s.offset <= index < s.offset + s.spec.numel:
                return s.spec.name
        return f"<chunk {chunk} element {index}>"


def named_state(layout: FlatLayout, masters: list[torch.Tensor], buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameters (from flat master chunks, in the signature's dtypes) and then buffers, by name."""
    state = {
        slot.spec.name: view.to(getattr(torch, slot.spec.dtype)).clone()
        for slot, view in zip(layout.slots, layout.views(masters))
    }
    state.update(buffers)
    return state
