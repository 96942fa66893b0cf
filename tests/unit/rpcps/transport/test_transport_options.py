"""Which TensorPipe channels a process offers: what it was told, else what fits its tensors."""

from __future__ import annotations

from rpcps.transport import TransportOptions
from rpcps.transport.config import CMA_MIN_TENSOR_BYTES


def test_unset_channels_follow_the_size_of_the_tensors() -> None:
    options = TransportOptions()
    assert options.channels(16 << 20) == ("cma", "basic")  # one copy for large tensors
    assert options.channels(CMA_MIN_TENSOR_BYTES - 1) == ("basic",)  # cma's extra message costs more on small ones
    assert options.channels() == ("cma", "basic")  # a worker: the server's offer decides


def test_channels_given_are_used_as_given() -> None:
    assert TransportOptions(rpc_channels=("basic",)).channels(64 << 20) == ("basic",)
    assert TransportOptions(rpc_channels=("cma", "basic")).channels(1024) == ("cma", "basic")
