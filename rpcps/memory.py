"""glibc malloc settings for a process that moves large tensors, set once at start-up.

A server or worker allocates a buffer of megabytes per message: TensorPipe's receive buffers, pull
snapshots, gradients. With glibc's defaults every thread that allocates gets its own arena (up to 8
per core), a freed block can only be reused by its own arena, and after the first large free the
mmap threshold rises so that large blocks live in those arenas too: a server held 4 GB for 290 MB of
parameters and Adam state (docs/BENCHMARKS.md). Returning every large block to the kernel instead
(a low fixed mmap threshold) bounds memory but makes every message page-fault a fresh buffer, which
costs more CPU than the copy itself on small machines: with a fixed 1 MiB threshold (and torch's
transparent huge pages) the 25M MLP's RSS fell to within issue 12's budgets on the workers, but the
run made 7.0 updates/s against 10.5 with the dynamic threshold, back to back (docs/BENCHMARKS.md).
So: few arenas (freed blocks are reused by whichever thread allocates next) and the dynamic
threshold kept (large blocks are reused, not re-faulted); the server and the worker reuse their own
large buffers instead of allocating them per message (``ps.pull_copies``, ``GradientStager.bind``).

A setting whose ``MALLOC_*_`` environment variable is set is left to glibc (which read it at
start-up): an operator's choice wins. Other allocators (musl, jemalloc via LD_PRELOAD) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

ARENA_MAX = 2
"""Malloc arenas: one for the main thread and one shared by every other (RPC, intra-op, I/O) thread."""

_M_ARENA_MAX = -8
_SETTINGS = ((_M_ARENA_MAX, ARENA_MAX, "MALLOC_ARENA_MAX"),)


def tune_malloc() -> dict[str, int]:
    """Applies the settings above (those the environment does not set); returns what it set, by variable name."""
    libc = _glibc()
    if libc is None:
        return {}
    applied = {}
    for param, value, env in _SETTINGS:
        if env in os.environ or env + "_" in os.environ or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
            continue
        if libc.mallopt(param, value) == 1:
            applied[env] = value
        else:
            logger.warning("mallopt refused %s=%d", env, value)
    logger.info("malloc: %s", ", ".join(f"{k}={v}" for k, v in applied.items()) or "left to the environment")
    return applied


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it; mallopt's numbers are glibc's
    except (OSError, AttributeError):
        return None
    return libc
