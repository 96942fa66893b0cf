"""Which kernel an optimizer steps with (``rpcps.optim_kernels``), and that the worker's inner optimizer takes it."""

from __future__ import annotations

import pytest
import torch

from rpcps.optim_kernels import FAST_KERNELS, fast_kernel
from worker.config import INNER_OPTIMIZERS, WorkerConfig
from worker.local_steps import FusedInnerStep, inner_optimizer


def test_cpu_parameters_take_the_fused_kernel_where_the_optimizer_has_one() -> None:
    params = [torch.zeros(3, requires_grad=True)]
    assert fast_kernel("adamw", params) == {"fused": True}
    assert fast_kernel("sgd", params) == {"fused": True}
    assert fast_kernel("rmsprop", params) == {}  # no fused kernel: torch's default


def test_a_device_without_fused_kernels_or_an_integer_tensor_keeps_torchs_default() -> None:
    assert fast_kernel("adam", [torch.zeros(3, device="meta")]) == {}
    assert fast_kernel("adam", [torch.zeros(3), torch.zeros(3, dtype=torch.int64)]) == {}


class TwoHeads(torch.nn.Module):
    """A model whose second head gets no gradient on some steps (torch.optim skips such a parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, use_head: bool) -> torch.Tensor:
        y = self.body(x)
        return self.head(y) if use_head else y


@pytest.mark.parametrize("name", INNER_OPTIMIZERS)
def test_the_inner_optimizer_steps_as_torchs_fused_optimizer_does_bit_for_bit(name: str) -> None:
    torch.manual_seed(0)
    model, reference = TwoHeads(), TwoHeads()
    reference.load_state_dict(model.state_dict())
    config = WorkerConfig(model="rpcps.tasks:teacher_student_model", local_steps=4, inner_optimizer=name, inner_lr=0.01)
    inner = inner_optimizer(config, list(model.parameters()))
    assert isinstance(inner, FusedInnerStep) and name in FAST_KERNELS
    torch_class = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[name]
    expected = torch_class(reference.parameters(), lr=config.inner_lr, fused=True)
    for step in range(5):
        x = torch.randn(8, 4)
        for m, opt in ((model, inner), (reference, expected)):
            m(x, use_head=step % 2 == 0).square().sum().backward()
            opt.step()
            opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    if name != "sgd":  # the head stepped 3 times (steps 0, 2, 4), the body 5
        assert [int(s) for s in inner.steps] == [5, 5, 3, 3]


def test_the_inner_optimizer_refuses_a_sparse_gradient_and_leaves_the_parameters() -> None:
    model = torch.nn.Embedding(10, 3, sparse=True)
    before = model.weight.detach().clone()
    inner = inner_optimizer(WorkerConfig(model="rpcps.tasks:teacher_student_model", local_steps=2), list(model.parameters()))
    model(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse=False"):
        inner.step()
    assert torch.equal(model.weight.detach(), before)


def test_a_device_without_fused_kernels_gets_torchs_own_optimizer() -> None:
    params = [torch.zeros(3, device="meta", requires_grad=True)]
    inner = inner_optimizer(WorkerConfig(model="rpcps.tasks:teacher_student_model", local_steps=2), params)
    assert isinstance(inner, torch.optim.AdamW) and not inner.param_groups[0]["fused"]
