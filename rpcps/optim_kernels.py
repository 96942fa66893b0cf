"""The torch.optim kernel each optimizer steps with in every rpcps process that steps one: the
server's optimizer (``ps.core.optim``) and a worker's inner optimizer in ``--mode local-steps``
(``worker.local_steps``).

On the CPU torch.optim defaults to its single-tensor loop: a 5M-parameter Adam step took 26 ms on one
thread, 87 % of a server's time. The fused CPU kernels (torch >= 2.4) make one vectorised pass over each
tensor: 3.4 ms for the 5M step (docs/BENCHMARKS.md), and the 22k-parameter MLP's whole inner step
(forward, backward, AdamW; one thread) 519 instead of 696 us (docs/EXAMPLES.md, local steps; 0.36 ms
since the CLI loop calls the fused update without torch.optim's per-step bookkeeping:
``worker.local_steps.FusedInnerStep``). RMSprop
has no fused kernel, and its foreach one measured no faster than the loop, so it keeps torch's default;
so does a device without fused kernels. Fused results differ from the loop's in the last bit (Adam,
AdamW, Adagrad; not SGD), and the server's equal the fused kernel stepped on the model's own tensors bit
for bit (tests/unit/ps/core/test_server_optim.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

FAST_KERNELS: dict[str, dict[str, bool]] = {
    "sgd": {"fused": True},
    "adam": {"fused": True},
    "adamw": {"fused": True},
    "adagrad": {"fused": True},
}
"""The keyword arguments that select each optimizer's fast kernel (none: torch's default)."""


def fast_kernel(name: str, params: Sequence[torch.Tensor]) -> dict[str, bool]:
    """``FAST_KERNELS[name]`` when every parameter lives on a device with fused kernels, else nothing.
    A sequence, not any iterable: the optimizer built with the result reads the same parameters."""
    supported = set(_get_fused_kernels_supported_devices())
    if all(p.device.type in supported and p.is_floating_point() for p in params):
        return FAST_KERNELS.get(name, {})
    return {}
