"""glibc malloc settings for a process that moves large tensors: set once at start-up, and freed
memory given back to the kernel every few seconds.

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
large buffers instead of allocating them per message (``ps.core.pull_copies``, ``GradientStager.bind``).

A setting whose ``MALLOC_*_`` environment variable is set is left to glibc (which read it at
start-up): an operator's choice wins. Other allocators (musl, jemalloc via LD_PRELOAD) are left alone.

Even with two arenas and no per-message allocation rpcps controls, TensorPipe's receive buffers (a
server's pushes, a worker's replies) are allocated and freed per message, and glibc keeps what they
leave free: measured, a worker whose blocks in use were 90-280 MB held 690-1050 MB of free arena
pages resident, a server 580-860 MB. ``malloc_trim(0)`` gives every free page back (``madvise``),
so a ``Trimmer`` calls it every ``interval_s`` on a background thread, off the request path: the
pages a later message reuses are faulted in again, which is why it runs every few seconds rather
than after every message (a trim per second cost a quarter of the throughput; docs/BENCHMARKS.md).

Those per-message blocks are also why every message page-faults: TensorPipe receives into a fresh
block, and the pages the trimmer gave back are faulted in again, 4 KiB at a time (on the 5M MLP a
fifth of a worker's CPU went to page faults, most of it zeroing pages inside the copy that receives
a reply). torch's CPU allocator asks the kernel for transparent huge pages for blocks of 2 MB and
more when ``THP_MEM_ALLOC_ENABLE=1``, which makes 512 times fewer faults; rpcps turns that on
(``prefer_huge_pages``, first thing in every rpcps process: torch reads it at its first allocation)
unless the environment says otherwise. Measured: hand-started, 5M MLP, +12 % updates/s over five
interleaved pairs (docs/BENCHMARKS.md, "Huge pages").

The first seconds of traffic are trimmed more often (``WARMUP_INTERVALS``): while the arenas first
grow to their working span, every page they take is new and stays resident until the next trim,
so the first interval after start-up rose about twice as far above the live data as a steady one
and was a worker's peak of a 10-minute run (1104 MB against steady tops of 845-1032; 0.1 s
timeline, docs/BENCHMARKS.md "When the peaks come"). The cost is four extra trims (30-50 ms each)
once; a server's warm-up starts when it starts serving, so workers that join later than a few
seconds after it find it over (a server's peak is its steady state anyway).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time
from collections.abc import Mapping, MutableMapping

from rpcps.periodic import Periodic

logger = logging.getLogger(__name__)

ARENA_MAX = 2
"""Malloc arenas: one for the main thread and one shared by every other (RPC, intra-op, I/O) thread."""

WARMUP_INTERVALS, WARMUP_SPLIT = 2, 3
"""For the first ``WARMUP_INTERVALS`` trim intervals the trimmer trims ``WARMUP_SPLIT`` times per interval."""

_M_ARENA_MAX = -8
_SETTINGS = ((_M_ARENA_MAX, ARENA_MAX, "MALLOC_ARENA_MAX"),)

HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
"""torch's switch: its CPU allocator ``madvise``s blocks of 2 MB and more ``MADV_HUGEPAGE`` when it is 1."""
KERNEL_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def tune_malloc() -> dict[str, int]:
    """Applies the settings above (those the environment does not set); returns what it set, by variable name."""
    libc = _glibc()
    if libc is None:
        return {}
    applied = {}
    for param, value, env in _SETTINGS:
        if left_to_environment(env, os.environ):
            continue
        if libc.mallopt(param, value) == 1:
            applied[env] = value
        else:
            logger.warning("mallopt refused %s=%d", env, value)
    logger.info("malloc: %s; huge pages: %s", ", ".join(f"{k}={v}" for k, v in applied.items()) or "left to the environment",
                huge_pages_state(os.environ))
    return applied


def prefer_huge_pages(environ: MutableMapping[str, str]) -> None:
    """Turns torch's transparent huge pages on, unless ``environ`` already decides (an operator's 0 wins).
    Only takes effect before torch's first CPU allocation in this process; children inherit it."""
    environ.setdefault(HUGE_PAGES_ENV, "1")


def huge_pages_state(environ: Mapping[str, str], mode_file: str = KERNEL_THP_MODE) -> str:
    """What the start-up log says of huge pages: torch's switch and the kernel's mode (``[madvise]``
    or ``[always]``: torch's requests are honoured; ``[never]`` or no file: they are not)."""
    asked = environ.get(HUGE_PAGES_ENV)
    if asked != "1":
        return f"off ({HUGE_PAGES_ENV}={asked})" if asked is not None else f"off ({HUGE_PAGES_ENV} unset)"
    try:
        with open(mode_file) as modes:
            text = modes.read()
    except OSError:
        return "asked for, but this kernel has no transparent huge pages"
    mode = text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()
    if mode == "never":
        return "asked for, but the kernel's transparent huge pages are off (never)"
    return f"on for blocks of 2 MB and more (kernel mode {mode})"


def left_to_environment(variable: str, environ: Mapping[str, str]) -> bool:
    """Whether glibc took this malloc setting from the environment at start-up (``MALLOC_ARENA_MAX``,
    its ``MALLOC_ARENA_MAX_`` spelling, or any ``glibc.malloc`` tunable), so rpcps must not override it."""
    return variable in environ or variable + "_" in environ or "glibc.malloc" in environ.get("GLIBC_TUNABLES", "")


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


def trim_due(tick: int) -> bool:
    """Whether the trimmer trims at its ``tick``-th wake-up (from 1; it wakes ``WARMUP_SPLIT`` times per
    interval): at every wake-up during the warm-up, then at the end of each interval."""
    return tick <= WARMUP_INTERVALS * WARMUP_SPLIT or tick % WARMUP_SPLIT == 0


class Trimmer:
    """Calls glibc's ``malloc_trim(0)`` every ``interval_s`` seconds (more often during the warm-up:
    ``trim_due``) on a daemon thread until stopped."""

    def __init__(self, libc: ctypes.CDLL, interval_s: float) -> None:
        self._trim = libc.malloc_trim
        self.trims = 0
        self.seconds = 0.0
        """Time spent inside ``malloc_trim`` (it holds each arena's lock while it walks it)."""
        self._ticks = 0
        self._task = Periodic("malloc-trim", interval_s / WARMUP_SPLIT, self._tick)

    def _tick(self) -> None:
        self._ticks += 1
        if trim_due(self._ticks):
            self.trim()

    def trim(self) -> None:
        started = time.perf_counter()
        self._trim(0)
        self.seconds += time.perf_counter() - started
        self.trims += 1

    def start(self) -> None:
        self._task.start()

    def stop(self) -> None:
        self._task.stop()
        logger.debug("malloc_trim: %d calls, %.2f s in all", self.trims, self.seconds)


def start_trimming(interval_s: float) -> Trimmer | None:
    """Starts a ``Trimmer`` (``interval_s`` 0: none). Without glibc there is nothing to trim: says so, returns None."""
    if interval_s == 0:
        logger.info("malloc_trim: off")
        return None
    libc = _glibc()
    if libc is None:
        logger.info("malloc_trim: not glibc, nothing to trim")
        return None
    trimmer = Trimmer(libc, interval_s)
    trimmer.trim()  # start-up (imports, model, snapshot restore) leaves the most free memory behind
    trimmer.start()
    logger.info("malloc_trim: every %gs (every %gs for the first %gs)", interval_s, interval_s / WARMUP_SPLIT,
                interval_s * WARMUP_INTERVALS)
    return trimmer
