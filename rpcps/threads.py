"""How many CPU threads a process computes with (torch's intra-op threads), chosen once at start-up.

torch's own default is one intra-op thread per core in every process. A host that runs a server and
its workers side by side then has several times more compute threads than cores, and idle OpenMP
threads spin while they wait for work: on 2 cores, a server and two workers on torch's defaults ran
a 22k-parameter model 7x slower and a 5M one 2.5x slower than with one thread each
(shared/research/torch-rpc-facts.md). So every role picks its budget here, the same way:

1. ``--threads N`` (or ``RPCPS_THREADS``), when given;
2. ``OMP_NUM_THREADS``, when set (torchrun sets it to 1 for multi-process runs);
3. otherwise the cores this process may run on (``os.sched_getaffinity``) divided by the processes
   that share them (torchrun's ``LOCAL_WORLD_SIZE``; 1 when unset), and at most
   ``GPU_WORKER_THREADS`` for a worker that computes on a GPU (its CPU only feeds the device).

``rpcps local`` knows every process it starts, so it divides the cores itself (``split_cores``) and
hands each child its share as ``--threads``.

What must not live here: anything about the roles beyond "computes on a GPU or not".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

GPU_WORKER_THREADS = 2
"""A GPU worker's CPU threads: data, staging and the loop; more only compete with its neighbours."""


@dataclass(frozen=True)
class ThreadBudget:
    """The intra-op threads a process uses, and why (for the start-up log)."""

    intra_op: int
    reason: str

    def __post_init__(self) -> None:
        if self.intra_op < 1:
            raise ValueError(f"intra_op threads must be >= 1, got {self.intra_op}")


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def omp_num_threads(environ: Mapping[str, str] | None = None) -> int | None:
    """``OMP_NUM_THREADS`` when it is set to a whole number >= 1, else None."""
    return _positive_int(os.environ if environ is None else environ, "OMP_NUM_THREADS")


def _positive_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    try:
        value = int(raw)
    except ValueError:
        if raw:
            logger.warning("ignoring %s=%r: not a whole number", name, raw)
        return None
    return value if value >= 1 else None


def choose(requested: int | None, *, gpu: bool = False, environ: Mapping[str, str] | None = None, cores: int | None = None) -> ThreadBudget:
    """This process's budget (see the module docstring for the order of precedence).

    Args:
        requested: ``--threads`` (or ``RPCPS_THREADS``); None when not given.
        gpu: the process computes on a GPU (a worker with a CUDA device).
        environ: the environment to read (``os.environ`` when None).
        cores: the usable cores (``usable_cores()`` when None).
    """
    environ = os.environ if environ is None else environ
    if requested is not None:
        return ThreadBudget(requested, "--threads")
    omp = omp_num_threads(environ)
    if omp is not None:
        return ThreadBudget(omp, "OMP_NUM_THREADS")
    cores = usable_cores() if cores is None else cores
    sharing = _positive_int(environ, "LOCAL_WORLD_SIZE") or 1
    share = max(1, cores // sharing)
    reason = f"{cores} usable cores / {sharing} local processes"
    if gpu and share > GPU_WORKER_THREADS:
        return ThreadBudget(GPU_WORKER_THREADS, f"{reason}, capped for a GPU worker")
    return ThreadBudget(share, reason)


def apply(budget: ThreadBudget) -> int:
    """Sets torch's intra-op threads (OpenMP and MKL alike), logs the choice and returns it."""
    torch.set_num_threads(budget.intra_op)
    threads = torch.get_num_threads()
    logger.info("intra-op threads: %d (%s)", threads, budget.reason)
    return threads


def split_cores(cores: int, servers: int, workers: int, *, gpu_workers: bool = False) -> tuple[int, int]:
    """(threads per server, threads per worker) for ``servers`` + ``workers`` processes on ``cores``.

    Every process gets an equal share, at least one thread; the cores an equal split leaves over go
    to the workers (they do the forward and backward passes). GPU workers keep at most
    ``GPU_WORKER_THREADS`` and the servers share the rest: then the servers are the bottleneck.
    """
    if servers < 1 or workers < 1 or cores < 1:
        raise ValueError(f"servers, workers and cores must be >= 1, got {servers}, {workers}, {cores}")
    if gpu_workers:
        worker = min(GPU_WORKER_THREADS, max(1, cores // (servers + workers)))
        return max(1, (cores - workers * worker) // servers), worker
    server = max(1, cores // (servers + workers))
    return server, max(1, (cores - servers * server) // workers)
