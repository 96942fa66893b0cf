"""Builds an in-process ParameterServer (no RPC) and packs gradients for it, for unit tests."""

from __future__ import annotations

import torch
from torch import nn

from ps.optim import OptimizerConfig
from ps.server import ParameterServer, ServerCoreConfig
from rpcps.signature import FlatLayout

# 1 KiB chunks (256 floats) split this model over several chunks, so every test also checks that
# stepping the optimizer over flat chunks equals stepping it per parameter.
SMALL_CHUNK_BYTES = 1024


def make_model(zero: bool = False) -> nn.Module:
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 3))
    if zero:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    return model


def make_server(
    optimizer: OptimizerConfig | None = None, zero: bool = False, **core: object
) -> tuple[ParameterServer, nn.Module]:
    model = make_model(zero)
    config = ServerCoreConfig(optimizer=optimizer or OptimizerConfig(), chunk_bytes=SMALL_CHUNK_BYTES, **core)  # type: ignore[arg-type]
    return ParameterServer(model, config), model


def pack(layout: FlatLayout, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-parameter gradients (signature order) -> the flat wire chunks a worker would send."""
    chunks = layout.empty_chunks()
    for view, grad in zip(layout.views(chunks), grads):
        view.copy_(grad)
    return chunks


def grads_like(model: nn.Module, seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) * scale for p in model.parameters()]


def snapshot(server: ParameterServer) -> dict[str, torch.Tensor]:
    return server.master_tensors()


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert torch.equal(value, b[name]), f"parameter {name!r} changed"
