"""Builds an in-process server (no RPC) and packs gradients for it, for tests that need no processes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ps.api.service import WorkerService
from ps.core.config import ServerCoreConfig
from ps.core.metrics import ServerStats
from ps.core.optim import OptimizerConfig
from ps.core.server import ParameterServer
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


class InProcessServer:
    """A server as its workers see it (the WorkerService) and as its owner sees it (the
    ParameterServer), in one handle: attributes are looked up on the service, then the server."""

    def __init__(self, model: nn.Module, config: ServerCoreConfig) -> None:
        self.core = ParameterServer(model, config)
        self.service = WorkerService(self.core)

    @property
    def stats(self) -> ServerStats:
        return self.core.metrics.stats

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(self.service, name)
        except AttributeError:
            return getattr(self.core, name)


def make_server(
    optimizer: OptimizerConfig | None = None, zero: bool = False, **core: object
) -> tuple[InProcessServer, nn.Module]:
    model = make_model(zero)
    config = ServerCoreConfig(optimizer=optimizer or OptimizerConfig(), chunk_bytes=SMALL_CHUNK_BYTES, **core)  # type: ignore[arg-type]
    return InProcessServer(model, config), model


def pack(layout: FlatLayout, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-parameter gradients (signature order) -> the flat wire chunks a worker would send."""
    chunks = layout.empty_chunks()
    for view, grad in zip(layout.views(chunks), grads):
        view.copy_(grad)
    return chunks


def grads_like(model: nn.Module, seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) * scale for p in model.parameters()]


def snapshot(server: InProcessServer) -> dict[str, torch.Tensor]:
    return server.master_tensors()


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert torch.equal(value, b[name]), f"parameter {name!r} changed"
