"""Settings of ``rpcps ctl``, the control plane's client.

Apart from ``cli.config`` on purpose: that module pulls in every role's config and with them torch
(2-3 s of start-up), which a gRPC client that asks a server for its status has no use for.
"""

from __future__ import annotations

from dataclasses import dataclass

from rpcps.address import Address
from rpcps.model_file import FORMATS
from rpcps.settings import setting


@dataclass(kw_only=True, frozen=True)
class CtlConfig:
    """Control-plane client."""

    addr: Address = setting(
        Address("127.0.0.1", 9500), help="HOST:PORT of the server's control plane (its --control-addr/--control-port)",
        metavar="HOST:PORT",
    )
    token_file: str | None = setting(None, help="file holding the token the server requires (its --control-token-file)", metavar="PATH")
    tls_ca: str | None = setting(None, help="PEM certificate that signed the server's --tls-cert; turns TLS on", metavar="PATH")
    timeout_s: float = setting(30.0, help="deadline of the call")
    out: str | None = setting(
        None, help="with export: the file to write the trained model's state_dict to; for a model with sparse tables, "
        "the directory (the state_dict and every table's ids and rows, docs/SPARSE.md)", metavar="PATH",
    )
    file_format: str = setting(
        "auto", flag="--format", help="with export: torch, safetensors, or auto (safetensors for a .safetensors --out)",
        choices=lambda: FORMATS,
    )
    optimizer_state: bool = setting(False, help="with export of a model with sparse tables: also each row's optimizer state")

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.file_format not in FORMATS:
            raise ValueError(f"format must be one of {list(FORMATS)}, got {self.file_format!r}")
