"""Where a model computes: the device the inputs it scores must be moved to.

What must not live here: choosing a device for a role (``worker.device.pick_device``).
"""

from __future__ import annotations

import itertools

import torch


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter, else of its first buffer, else the CPU.

    A model that holds no tensor (a fixed function, say) runs wherever its inputs are; the CPU is
    where the data factories make them. ``next(model.parameters())`` would raise a bare
    StopIteration for such a model, which inside a generator ends it without a word.
    """
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor.device
    return torch.device("cpu")
