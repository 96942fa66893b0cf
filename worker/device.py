"""Device selection and moving gradients off the device without stalling compute."""

from __future__ import annotations

import os

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
        self.direct = device.type == "cpu" and all(p.device.type == "cpu" and p.dtype == dtype for p in params)
        """Backward can accumulate straight into the wire buffers (``bind``): CPU parameters of the
        buffers' dtype. Otherwise gradients are computed into their own tensors and ``stage``d."""

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
        for view, p in zip(self.layout.views(buffers), self.params):
            p.grad = view

    def new_buffers(self) -> list[torch.Tensor]:
        return self.layout.empty_chunks(pin_memory=self._stream is not None, dtype=self.dtype)

    def stage(self, buffers: list[torch.Tensor]) -> None:
        views = self.layout.views(buffers)
        if self._stream is None:
            with torch.no_grad():
                for view, p in zip(views, self.params):
                    if p.grad is None:
                        view.zero_()
                    else:
                        view.copy_(p.grad)
            return
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream), torch.no_grad():
            for view, p in zip(views, self.params):
                if p.grad is None:
                    view.zero_()
                else:
                    p.grad.record_stream(self._stream)
                    view.copy_(p.grad, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(self._stream)

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None


def load_parameters(layout: FlatLayout, params: list[torch.nn.Parameter], chunks: list[torch.Tensor]) -> None:
    """Copies pulled flat chunks into the model's own parameters (any device, any float dtype)."""
    with torch.no_grad():
        for view, p in zip(layout.views(chunks), params):
            p.copy_(view, non_blocking=True)


def memory_in_use(device: torch.device) -> tuple[int, int]:
    """(bytes allocated now, peak bytes) on a GPU; (0, 0) on the CPU."""
    if device.type != "cuda":
        return 0, 0
    return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
