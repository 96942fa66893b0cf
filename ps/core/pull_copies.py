"""The parameters as pulls send them: one copy per version, in buffers reused once the wire let go.

A pull (or a push reply that carries the parameters) must send a copy, not the masters: TensorPipe
reads a tensor after the handler returned (with the cma channel the receiver copies straight out of
this process's memory, at its own pace), while the next update rewrites the masters in place. The
copy is made once per version and shared by every reply of that version.

Allocating that copy afresh per version (a 25M-parameter model: 96 MB per update) is what made a
server's RSS grow: glibc kept the freed blocks in its arenas, fragmented by everything allocated
between them, and the heap grew to about five times the live data (docs/BENCHMARKS.md, issue 12).
Here a copy is written into a set of buffers that no reply holds any more, and only when every set
is still being sent is a new one allocated; other idle sets are dropped (the previous version's set
is the spare for the next one). So pulls allocate nothing in steady state and hold the sets being
sent plus the current one.

"No reply holds it any more" is read from reference counts: the Python list (a reply that is not
serialised yet holds it) and each tensor's storage (the RPC message holds the tensors from
serialisation until TensorPipe's write completes). tests/unit/ps/core/test_pull_copies.py pins both.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch

_LIST_REFS_WHEN_IDLE = 3
"""``sys.getrefcount`` of an idle set inside ``_idle``: ``self._sets``'s entry, ``_idle``'s argument,
and ``getrefcount``'s own."""
_STORAGE_REFS_WHEN_IDLE = 2
"""The storage's use count of an idle buffer inside ``_idle``: its tensor, and the Python storage
object ``untyped_storage()`` returned to ask."""


class PullCopies:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._sets: list[list[torch.Tensor]] = []
        self._current: list[torch.Tensor] | None = None
        self._version = -1

    def for_version(
        self, version: int, masters: Sequence[torch.Tensor], write: Callable[[list[torch.Tensor]], None] | None = None
    ) -> list[torch.Tensor]:
        """Under the server's lock: the copy of ``masters`` at ``version`` (made on the first ask);
        ``write``, when given, fills the buffers instead of a plain copy (weight prediction)."""
        if version != self._version or self._current is None:
            self._current = self._fill(masters, write)
            self._version = version
        return self._current

    def invalidate(self) -> None:
        """The masters changed without a new version (a snapshot was restored): copy again on the next ask."""
        self._version = -1

    @property
    def sets(self) -> int:
        """Buffer sets held (the current one and those that were being sent at the last new version)."""
        return len(self._sets)

    def _fill(self, masters: Sequence[torch.Tensor], write: Callable[[list[torch.Tensor]], None] | None) -> list[torch.Tensor]:
        idle = [s for s in self._sets if s is not self._current and self._idle(s)]
        if idle:
            dropped = idle[1:]
            self._sets = [s for s in self._sets if not any(s is x for x in dropped)]
            target = idle[0]
            del idle, dropped
        elif write is None:
            target = [m.detach().to(self.dtype, copy=True) for m in masters]
            self._sets.append(target)
            return target
        else:
            target = [torch.empty_like(m, dtype=self.dtype) for m in masters]
            self._sets.append(target)
        if write is not None:
            write(target)
        else:
            with torch.no_grad():
                for buffer, master in zip(target, masters):
                    buffer.copy_(master)
        return target

    @staticmethod
    def _idle(copy: list[torch.Tensor]) -> bool:
        if sys.getrefcount(copy) > _LIST_REFS_WHEN_IDLE + 1:  # + the comprehension's loop variable
            return False
        return all(torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= _STORAGE_REFS_WHEN_IDLE for t in copy)
