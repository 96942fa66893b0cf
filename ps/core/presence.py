"""No gradient, no move: a parameter a push carries no gradient for is left exactly as it was.

``torch.optim`` skips a parameter whose ``.grad`` is None, so a branch not taken, an unused expert
or a frozen head keeps its weights and its optimizer state. The server steps its optimizer over flat
chunks that pack many parameters, so it cannot leave one out of the step: a zero gradient would
still move it (Adam's momentum, weight decay). Instead an update carries a presence mask
(``Update.absent``: bit ``i`` set means the shard's parameter ``i``, in signature order, got no
gradient), and the apply step holds those parameters' slices of the masters and of every per-element
optimizer state tensor across the step, then puts them back. The mask is part of the log entry, so a
standby applies it bit-identically; what a snapshot captures is the state after it, so resume needs
nothing more.

What is not held: the optimizer's per-chunk step counter (Adam's bias correction then counts the
chunk's steps, not the parameter's own) and the learning-rate schedule, which step once per update.
The common case (every parameter has a gradient: mask 0) costs one integer test.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rpcps.signature import FlatLayout, Slot


def check_absent(absent: object, params: int) -> str | None:
    """What is wrong with a received presence mask, or None."""
    if type(absent) is not int:
        return f"has a presence mask of type {type(absent).__name__}, expected int"
    if absent < 0 or absent >> params:
        return f"has a presence mask naming parameters outside the shard's {params}"
    return None


def absent_slots(layout: FlatLayout, absent: int) -> list[Slot]:
    """The slots of the parameters bit-set in ``absent``."""
    return [slot for i, slot in enumerate(layout.slots) if absent >> i & 1]


class HeldSlices:
    """Copies of the absent parameters' slices (masters and optimizer state), put back by ``restore``.

    Optimizer state that does not exist yet (torch creates it lazily at a parameter's first step) is
    put back as zeros, its value before any step for every optimizer offered (Adagrad, whose
    accumulator may start elsewhere, creates its state at construction, so it is held like the rest).
    """

    def __init__(self, layout: FlatLayout, masters: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, absent: int) -> None:
        self._masters = masters
        self._optimizer = optimizer
        self._slots = absent_slots(layout, absent)
        self._saved: list[tuple[torch.Tensor, int, int, torch.Tensor]] = []
        chunks = {slot.chunk for slot in self._slots}
        self._fresh = [c for c in chunks if not optimizer.state.get(masters[c])]
        """Chunks without optimizer state yet: the step creates it, and the absent slices are zeroed."""
        with torch.no_grad():
            for slot in self._slots:
                for tensor in self._per_element(masters[slot.chunk]):
                    self._hold(tensor, slot)

    def _per_element(self, master: torch.Tensor) -> list[torch.Tensor]:
        state = self._optimizer.state.get(master, {})
        return [master, *(v for v in state.values() if isinstance(v, torch.Tensor) and v.shape == master.shape)]

    def _hold(self, tensor: torch.Tensor, slot: Slot) -> None:
        end = slot.offset + slot.spec.numel
        self._saved.append((tensor, slot.offset, end, tensor[slot.offset : end].clone()))

    def restore(self) -> None:
        with torch.no_grad():
            for tensor, start, end, saved in self._saved:
                tensor[start:end].copy_(saved)
            for slot in self._slots:
                if slot.chunk not in self._fresh:
                    continue
                master = self._masters[slot.chunk]
                for tensor in self._per_element(master)[1:]:
                    tensor[slot.offset : slot.offset + slot.spec.numel].zero_()
