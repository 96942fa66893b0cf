"""Settings of the torch RPC transport shared by every role (where to listen or connect is the role's)."""

from __future__ import annotations

from dataclasses import dataclass

from rpcps.address import Address
from rpcps.settings import setting

__all__ = ["Address", "TransportOptions"]

KNOWN_TRANSPORTS = ("uv", "shm", "ibv")
KNOWN_CHANNELS = ("basic", "cma", "mpt_uv", "xth", "cuda_ipc", "cuda_basic", "cuda_gdr", "cuda_xth")

CMA_MIN_TENSOR_BYTES = 1 << 20
"""A server whose largest chunk is smaller offers only the ``basic`` channel (see ``channels``)."""


@dataclass(kw_only=True, frozen=True)
class TransportOptions:
    """Transport (torch RPC over TensorPipe)."""

    rpc_timeout_s: float = setting(30.0, help="deadline of one RPC call; a hung peer fails after this")
    rpc_threads: int = setting(32, help="threads serving incoming RPCs in this process")
    rpc_transports: tuple[str, ...] = setting(
        ("uv",), help="TensorPipe transports, comma-separated (uv = TCP; shm busy-polls a core per process)"
    )
    rpc_channels: tuple[str, ...] | None = setting(
        None,
        help="TensorPipe channels for tensor payloads, comma-separated, preferred first; unset: cma,basic (cma copies a "
        "tensor once between processes on one host; TensorPipe falls back to basic where it cannot), except on a server "
        "whose largest chunk is under 1 MiB, which offers basic only (cma's extra control message per tensor costs more "
        "than it saves on small ones)",
    )
    connect_timeout_s: float = setting(60.0, help="how long a joining process waits for the rendezvous store to answer")
    job_secret_file: str | None = setting(
        None,
        help="file holding the job's secret (one line, >= 32 characters, the same on every process): workers prove it "
        "to take a slot; required when the RPC port is not on loopback (docs/SECURITY.md)",
        metavar="PATH",
    )
    max_message_mb: float | None = setting(
        None,
        help="refuse an incoming RPC message larger than this (MiB) before anything in it runs; "
        "unset: 12 bytes per model parameter + 16 MiB",
        metavar="MB",
    )

    def __post_init__(self) -> None:
        for name in ("rpc_timeout_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_message_mb is not None and not self.max_message_mb > 0:
            raise ValueError(f"max_message_mb must be > 0, got {self.max_message_mb}")
        if not 1 <= self.rpc_threads <= 1024:
            raise ValueError(f"rpc_threads must be in [1, 1024], got {self.rpc_threads}")
        for t in self.rpc_transports:
            if t not in KNOWN_TRANSPORTS:
                raise ValueError(f"unknown TensorPipe transport {t!r}; choose from {sorted(KNOWN_TRANSPORTS)}")
        for c in self.rpc_channels or ():
            if c not in KNOWN_CHANNELS:
                raise ValueError(f"unknown TensorPipe channel {c!r}; choose from {sorted(KNOWN_CHANNELS)}")

    def channels(self, largest_tensor_bytes: int | None = None) -> tuple[str, ...]:
        """The channels to offer: ``rpc_channels`` when set; else by the largest tensor this process
        sends and receives (None: not known, as on a worker; the server's offer decides a pipe's channel)."""
        if self.rpc_channels is not None:
            return self.rpc_channels
        if largest_tensor_bytes is not None and largest_tensor_bytes < CMA_MIN_TENSOR_BYTES:
            return ("basic",)
        return ("cma", "basic")
