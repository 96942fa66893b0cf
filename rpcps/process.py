"""Settings every rpcps process has, whatever its role, declared once for all of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rpcps import plugins
from rpcps.settings import setting

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
MIN_TRIM_S, MAX_TRIM_S = 0.5, 3600.0
"""A trim walks every arena under its lock and the pages it frees are faulted in again: one a second
already cost a quarter of the throughput (docs/BENCHMARKS.md, "Memory on defaults")."""


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
        help="intra-op CPU threads of this process, fixed; unset: OMP_NUM_THREADS, else this process's share of the "
        "usable cores with the other rpcps processes of this host, by what each uses, followed while it runs",
        metavar="N",
    )
    host_dir: str | None = setting(
        None,
        help="directory where the rpcps processes of this host find each other to share its cores (rpcps.host_registry); "
        "unset: $XDG_RUNTIME_DIR/rpcps, else /tmp/rpcps-<uid>. Containers of one host share it through a volume",
        metavar="DIR",
    )
    checkpoints_off_ok: bool = setting(
        False,
        help="this job runs without --checkpoint-dir on purpose and whoever started it has said so (rpcps local does, "
        "once, on its console): the server and the workers log it at INFO instead of warning",
    )
    malloc_trim_s: float = setting(
        3.0,
        help="seconds between malloc_trim calls that give glibc's free heap pages back to the kernel, off the request "
        "path (a third of it for the first two intervals; 0: never; rpcps.memory)",
        metavar="SECONDS",
    )

    def __post_init__(self) -> None:
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {list(LOG_LEVELS)}, got {self.log_level!r}")
        if self.threads is not None and not 1 <= self.threads <= 1024:
            raise ValueError(f"threads must be in [1, 1024], got {self.threads}")
        if not (self.malloc_trim_s == 0 or MIN_TRIM_S <= self.malloc_trim_s <= MAX_TRIM_S):
            raise ValueError(f"malloc_trim_s must be 0 (never) or in [{MIN_TRIM_S}, {MAX_TRIM_S}] seconds, got {self.malloc_trim_s}")


def model_setting() -> Any:
    """The --model setting; every role that builds the model declares its field with this."""
    return setting(
        plugins.BUILTIN_MODEL,
        help="model factory 'package.module:function' returning an nn.Module; the same on every role",
        metavar="SPEC",
    )
