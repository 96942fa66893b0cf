"""Which kernel an optimizer steps with (``rpcps.optim_kernels``), and that the worker's inner optimizer takes it."""

from __future__ import annotations

import torch

from rpcps.optim_kernels import FAST_KERNELS, fast_kernel
from worker.config import WorkerConfig
from worker.local_steps import inner_optimizer


def test_cpu_parameters_take_the_fused_kernel_where_the_optimizer_has_one() -> None:
    params = [torch.zeros(3, requires_grad=True)]
    assert fast_kernel("adamw", params) == {"fused": True}
    assert fast_kernel("sgd", params) == {"fused": True}
    assert fast_kernel("rmsprop", params) == {}  # no fused kernel: torch's default


def test_a_device_without_fused_kernels_or_an_integer_tensor_keeps_torchs_default() -> None:
    assert fast_kernel("adam", [torch.zeros(3, device="meta")]) == {}
    assert fast_kernel("adam", [torch.zeros(3), torch.zeros(3, dtype=torch.int64)]) == {}


def test_the_inner_optimizer_steps_fused_and_as_torchs_fused_adamw_does() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    reference = torch.nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    config = WorkerConfig(model="rpcps.tasks:teacher_student_model", local_steps=4)
    inner = inner_optimizer(config, list(model.parameters()))
    assert inner.param_groups[0]["fused"] is True and config.inner_optimizer in FAST_KERNELS
    expected = torch.optim.AdamW(reference.parameters(), lr=config.inner_lr, fused=True)
    for _ in range(3):
        x = torch.randn(8, 4)
        for m, opt in ((model, inner), (reference, expected)):
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
