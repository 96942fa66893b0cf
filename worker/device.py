"""Device selection and moving gradients off the device without stalling compute."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from rpcps.signature import FlatLayout


def pick_device(spec: str) -> torch.device:
    """'auto' takes a GPU when there is one and the CPU otherwise; 'cuda' without a GPU is an error.

    With several GPUs, 'auto' takes GPU ``LOCAL_RANK`` (modulo the count): torchrun and
    deploy/bare-metal/rpcps-node.sh set it per process, and without it every worker of a node would
    share GPU 0.
    """
    if spec == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"--device {spec!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {spec!r}: only auto, cpu, cuda and cuda:N are supported")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {spec!r} asked for a GPU but none is available here; use --device auto or cpu")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device {spec!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


class GradientStager:
    """Copies a model's gradients into flat host buffers for the wire.

    On CUDA the device-to-host copies go into pinned buffers on a side stream, so they overlap with
    whatever the default stream does next; ``wait`` blocks only until that copy is done. On the CPU
    the copy is an ordinary memcpy.
    """

    def __init__(
        self, layout: FlatLayout, params: list[torch.nn.Parameter], device: torch.device, dtype: torch.dtype = torch.float32
    ) -> None:
        self.layout = layout
        self.dtype = dtype
        self.params = params
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._event: torch.cuda.Event | None = None
        self._views: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        """Per-parameter views of each buffer set this stager made, by ``id`` of the set (held here
        too, so the id is never reused): a worker cycles through the same few sets every step, and
        slicing them anew cost as much as the copies on a small model."""
        self.direct = device.type == "cpu" and all(p.device.type == "cpu" and p.dtype == dtype for p in params)
        """Backward can accumulate straight into the wire buffers (``bind``): CPU parameters of the
        buffers' dtype. Otherwise gradients are computed into their own tensors and ``stage``d."""
        self._got = bytearray(len(params))
        """Direct only: per parameter, whether a backward accumulated into it since ``bind`` (a bound
        ``.grad`` exists whether or not the parameter was used, so its presence says nothing)."""
        if self.direct:
            for i, p in enumerate(params):
                p.register_post_accumulate_grad_hook(self._hook(i))

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        got = self._got

        def seen(_: torch.Tensor) -> None:
            got[i] = 1

        return seen

    def _views_of(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        made = self._views.get(id(buffers))
        return made[1] if made is not None and made[0] is buffers else self.layout.views(buffers)

    def bind(self, buffers: list[torch.Tensor]) -> None:
        """Zeroes ``buffers`` and makes their views the parameters' ``.grad``, so that the next backward
        accumulates into them (autograd adds in place into a ``.grad`` that exists).

        A worker then holds no gradient besides its window's buffers, and the step allocates and
        copies no gradient-sized tensor: with separate ``.grad`` tensors a 25M-parameter worker
        allocated and freed 96 MB per step, which glibc kept as fragmented free heap (issue 12).
        Only when ``direct``.
        """
        with torch.no_grad():
            for buffer in buffers:
                buffer.zero_()
        for view, p in zip(self._views_of(buffers), self.params):
            p.grad = view
        self._got[:] = bytes(len(self._got))

    def absent_bound(self, buffers: list[torch.Tensor]) -> int:
        """After the backward(s) of a ``bind``: the presence mask (bit i set: parameter i got no
        gradient). A ``.grad`` the caller replaced (``zero_grad(set_to_none=True)`` unbinds the view,
        and the next backward makes a tensor of its own) is copied into the buffers here."""
        absent = 0
        views = self._views_of(buffers)
        for i, (view, p) in enumerate(zip(views, self.params)):
            grad = p.grad
            if grad is view:
                if not self._got[i]:
                    absent |= 1 << i
                continue
            with torch.no_grad():
                if grad is None:
                    view.zero_()
                    absent |= 1 << i
                else:
                    view.copy_(grad)
        return absent

    def new_buffers(self) -> list[torch.Tensor]:
        buffers = self.layout.empty_chunks(pin_memory=self._stream is not None, dtype=self.dtype)
        self._views[id(buffers)] = (buffers, self.layout.views(buffers))
        return buffers

    def stage(self, buffers: list[torch.Tensor]) -> int:
        """Copies the parameters' gradients into ``buffers``; returns the presence mask (bit i set:
        parameter i has no ``.grad``, and its part of the buffers is zeros)."""
        views = self._views_of(buffers)
        absent = 0
        if self._stream is None:
            with torch.no_grad():
                for i, (view, p) in enumerate(zip(views, self.params)):
                    if p.grad is None:
                        view.zero_()
                        absent |= 1 << i
                    else:
                        view.copy_(p.grad)
            return absent
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream), torch.no_grad():
            for i, (view, p) in enumerate(zip(views, self.params)):
                if p.grad is None:
                    view.zero_()
                    absent |= 1 << i
                else:
                    p.grad.record_stream(self._stream)
                    view.copy_(p.grad, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(self._stream)
        return absent

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None


def load_parameters(layout: FlatLayout, params: list[torch.nn.Parameter], chunks: list[torch.Tensor]) -> None:
    """Copies pulled flat chunks into the model's own parameters (any device, any float dtype)."""
    with torch.no_grad():
        for view, p in zip(layout.views(chunks), params):
            p.copy_(view, non_blocking=True)


ADOPT_BYTES_PER_PARAMETER = 64 * 1024
"""Pulled chunks are adopted (``ParameterSink``) when they hold at least this much per parameter:
re-pointing a parameter costs about 8 us and copying about 0.2 us per KiB (measured on the 2-core
machine: the 22k-parameter MLP, 6 parameters in 86 KiB, loads in 13 us by copy and 50 us by
adoption; the 5M MLP, 10 parameters in 20 MiB, in 4.3 ms by copy and 0.12 ms by adoption)."""


class ParameterSink:
    """Loads pulled flat chunks into the parameters of one shard of a model, every step.

    When the parameters are CPU tensors of the wire's dtype (a CPU worker on the default fp32
    wire), each parameter's data is a view of a flat tensor laid out like the wire's chunks. A load
    then adopts the pulled chunks themselves as that flat storage (each parameter's data becomes a
    view of the chunk that arrived): the RPC layer received them into tensors of their own that
    nothing else writes, so the model needs no copy of them. On the 5M MLP that copy was a tenth of
    a worker's CPU per update. Anything else (a GPU, a narrower wire dtype, a chunk that is not a
    plain contiguous tensor) is copied, parameter by parameter (``load_parameters``) or chunk by chunk,
    and so are chunks too small for re-pointing every parameter to pay (``ADOPT_BYTES_PER_PARAMETER``).
    """

    def __init__(self, layout: FlatLayout, params: list[torch.nn.Parameter], wire: torch.dtype) -> None:
        self.layout = layout
        self.params = params
        self.wire = wire
        self.flat: list[torch.Tensor] | None = None
        if all(p.device.type == "cpu" and p.dtype == wire and p.is_contiguous() for p in params):
            flat = layout.empty_chunks(dtype=wire)
            with torch.no_grad():
                for view, p in zip(layout.views(flat), params):
                    view.copy_(p)
                    p.data = view
            self.flat = flat
        self.adopts = self.flat is not None and layout.nbytes >= ADOPT_BYTES_PER_PARAMETER * len(params)

    def load(self, chunks: list[torch.Tensor]) -> None:
        """Loads ``chunks`` into the parameters; on the flat path the model keeps ``chunks`` as its
        storage, so the caller must not write them afterwards."""
        if self.flat is None:
            load_parameters(self.layout, self.params, chunks)
            return
        if len(chunks) != len(self.flat) or any(c.shape != f.shape for c, f in zip(chunks, self.flat)):
            raise ValueError(f"pulled chunks of {[c.numel() for c in chunks]} elements; this shard's layout has "
                             f"{[f.numel() for f in self.flat]}: is the server of the same model and --chunk-mb?")
        if self.adopts and all(self._adoptable(c) for c in chunks):
            for view, p in zip(self.layout.views(chunks), self.params):
                p.data = view
            self.flat = list(chunks)
            return
        with torch.no_grad():
            for mine, theirs in zip(self.flat, chunks):
                mine.copy_(theirs)

    def subtract(self, chunks: list[torch.Tensor]) -> None:
        """Subtracts flat ``chunks`` (this shard's layout, e.g. a round's delta as pushed) from the parameters."""
        with torch.no_grad():
            if self.flat is not None:
                for mine, theirs in zip(self.flat, chunks):
                    mine.sub_(theirs)
                return
            for view, p in zip(self.layout.views(chunks), self.params):
                p.sub_(view.to(p.device, p.dtype, non_blocking=True))

    def _adoptable(self, chunk: torch.Tensor) -> bool:
        """A plain CPU tensor of the wire's dtype that is all of its storage (a view into a larger
        buffer would keep the rest of that buffer alive as long as the model uses it)."""
        return (type(chunk) is torch.Tensor and chunk.device.type == "cpu" and chunk.dtype == self.wire
                and chunk.is_contiguous() and not chunk.requires_grad
                and chunk.untyped_storage().nbytes() == chunk.numel() * chunk.element_size())


def memory_in_use(device: torch.device) -> tuple[int, int]:
    """(bytes allocated now, peak bytes) on a GPU; (0, 0) on the CPU."""
    if device.type != "cuda":
        return 0, 0
    return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
