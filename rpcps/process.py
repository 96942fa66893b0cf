"""Settings every rpcps process has, whatever its role, declared once for all of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rpcps import plugins
from rpcps.settings import setting

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(kw_only=True, frozen=True)
class ProcessOptions:
    """Process."""

    log_level: str = setting("INFO", help="logging level", choices=lambda: LOG_LEVELS)
    summary_json: str | None = setting(None, help="write a JSON summary of the run to this file at the end", metavar="PATH")
    metrics_addr: str = setting(
        "127.0.0.1",
        help="address /metrics listens on; 0.0.0.0 for a Prometheus on another host (read-only, no secrets: docs/SECURITY.md)",
    )
    threads: int | None = setting(
        None,
        help="intra-op CPU threads of this process; unset: OMP_NUM_THREADS, else this process's share of the usable "
        "cores (LOCAL_WORLD_SIZE processes share them; local divides them between its children)",
        metavar="N",
    )

    def __post_init__(self) -> None:
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {list(LOG_LEVELS)}, got {self.log_level!r}")
        if self.threads is not None and not 1 <= self.threads <= 1024:
            raise ValueError(f"threads must be in [1, 1024], got {self.threads}")


def model_setting() -> Any:
    """The --model setting; every role that builds the model declares its field with this."""
    return setting(
        plugins.BUILTIN_MODEL,
        help="model factory 'package.module:function' returning an nn.Module; the same on every role",
        metavar="SPEC",
    )
