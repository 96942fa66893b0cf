"""Where a CTR step's sparse server time goes, in one process without RPC (not a test).

Builds the server's ``SparseStore`` for the CTR task's 26 tables (``rpcps.examples.ctr``) and feeds it what a
server with two workers sees: per step, a pull of one 4096-sample batch's unique ids per table, and a
push of (seeded random) gradients for exactly the ids of an earlier pull, through ``check_push`` and
``apply``, as a worker pushes the unique ids it pulled. The push comes ``--push-lag`` pulls after its
own (default 3: the other worker's pull, then both workers' next ones, since a worker's next step
pulls while its push is in flight). After ``--warmup`` steps (the tables fill, as in a run),
``--steps`` steps are timed in CPU time of this process (``time.process_time``: the machine is
shared, and wall time there mostly measures the neighbours), per phase of the server's path, with
the calls per step of each:

    python -m bench.sparse_server_path                    # row-wise Adagrad, 60 + 40 steps
    python -m bench.sparse_server_path --fused-index       # also: 26 indices against one

The process computes with the intra-op threads the product's host budget gives a server that keeps
about one core busy beside two CPU workers on this machine's cores (``rpcps.threads.share``, the
rule every rpcps process follows, however it was started).

``--fused-index`` answers "would one index for all tables be faster than one per table": the same
ids in 26 ``IdIndex``es and in one ``IdIndex`` keyed by a hash of (table, id) (not an exact key: a
measurement of the probing cost only), each step a lookup, an insert of the absent ids and a second
lookup (what a pull and a push do), timed the same way.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import ps.sparse.table as table_module
from ps.sparse.index import IdIndex
from ps.sparse.store import SPARSE_OPTIMIZERS, SparseConfig, SparseStore
from ps.sparse.table import SparseTable
from rpcps.examples import ctr
from rpcps.host_registry import Entry
from rpcps.memory import prefer_huge_pages
from rpcps.sparse.hashing import keyed_hash
from rpcps.sparse.spec import SparsePull
from rpcps.threads import share, usable_cores


@dataclass
class Timings:
    seconds: Counter[str] = field(default_factory=Counter)
    calls: Counter[str] = field(default_factory=Counter)


def _request(step: int) -> SparsePull:
    """Step ``step``'s pull: batch step // 2 of worker step % 2, unique ids per table."""
    _, ranks, _ = ctr.draw(step % 2, step // 2, ctr.BATCH)
    ids = ctr.ids_of(ranks)
    return {spec.name: torch.unique(ids[:, spec.table_id]) for spec in ctr.table_specs()}


def _timed(timings: Timings, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            timings.seconds[label] += time.process_time() - start
            timings.calls[label] += 1

    return wrapper


def _instrument(store: SparseStore, timings: Timings) -> None:
    """Times the server path's phases (class attributes patched for this process only)."""
    IdIndex._find = _timed(timings, "index lookups (IdIndex._find)", IdIndex._find)  # type: ignore[method-assign]
    IdIndex.insert_absent = _timed(timings, "index inserts, rehash included", IdIndex.insert_absent)  # type: ignore[method-assign]
    table_module.initial_rows = _timed(timings, "row init (initial_rows)", table_module.initial_rows)
    SparseTable._create = _timed(timings, "row creation (SparseTable._create)", SparseTable._create)  # type: ignore[method-assign]
    for name in ("pull", "check_push", "apply"):
        setattr(store, name, _timed(timings, f"SparseStore.{name} (total)", getattr(store, name)))


def server_path(optimizer: str, warmup: int, steps: int, push_lag: int) -> None:
    store = SparseStore(ctr.table_specs(), SparseConfig(optimizer=optimizer), shard_index=0, shard_count=1)
    timings = Timings()
    _instrument(store, timings)
    generator = torch.Generator().manual_seed(0)
    pulled: list[SparsePull] = []
    for step in range(warmup + push_lag + steps):
        if step == warmup + push_lag:
            timings.seconds.clear()
            timings.calls.clear()
        request = _request(step)
        store.pull(request, torch.float32)
        pulled.append(request)
        if len(pulled) > push_lag:
            ids_of = pulled.pop(0)
            push = {name: (ids, torch.randn(ids.numel(), ctr.DIM, generator=generator) * 0.01) for name, ids in ids_of.items()}
            store.apply(store.check_push(push, torch.float32))
    # The batches and gradients are made outside the timed calls: a server receives them.
    per_step = sum(seconds for label, seconds in timings.seconds.items() if label.startswith("SparseStore.")) / steps
    rows = sum(s.rows for s in store.stats().values())
    print(f"{optimizer}: {per_step * 1e3:.1f} ms CPU per step (pull + push of {ctr.BATCH} samples), "
          f"{ctr.BATCH / per_step:,.0f} samples/s of server CPU; {rows:,} rows after {warmup + push_lag + steps} pulls")
    print("| phase | ms per step | share | calls per step |\n|---|---:|---:|---:|")
    for label, seconds in timings.seconds.most_common():
        print(f"| {label} | {seconds / steps * 1e3:.1f} | {seconds / steps / per_step:.0%} | {timings.calls[label] / steps:.1f} |")


def fused_index(warmup: int, steps: int) -> None:
    tables = ctr.table_specs()
    separate = [IdIndex() for _ in tables]
    fused = IdIndex()
    spent = [0.0, 0.0]
    for step in range(warmup + steps):
        request = _request(step)
        keyed = torch.cat([keyed_hash(request[s.name], s.table_id) for s in tables])
        times = [time.process_time()]
        for index, spec in zip(separate, tables):
            _lookup_insert_lookup(index, request[spec.name])
        times.append(time.process_time())
        _lookup_insert_lookup(fused, keyed)
        times.append(time.process_time())
        if step >= warmup:
            spent[0] += times[1] - times[0]
            spent[1] += times[2] - times[1]
    print(f"lookup + insert + lookup per step: {len(tables)} indices {spent[0] / steps * 1e3:.1f} ms, "
          f"one index {spent[1] / steps * 1e3:.1f} ms")


def _lookup_insert_lookup(index: IdIndex, ids: torch.Tensor) -> None:
    absent = ids[index.lookup(ids) < 0]
    index.insert_absent(absent, torch.arange(len(index), len(index) + absent.numel()))
    index.lookup(ids)


def server_threads(cores: int) -> int:
    """The product's share (``rpcps.threads.share``) for a server using one core beside two CPU workers."""
    now = time.time()
    me = Entry(os.getpid(), "server", "light", now, use=1.0, threads=1)
    workers = [Entry(0, "worker", "compute", now, use=1.0, threads=1) for _ in range(2)]
    return share(cores, me, workers, None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizer", default="rowwise_adagrad", choices=sorted(SPARSE_OPTIMIZERS))
    p.add_argument("--warmup", type=int, default=60, help="untimed steps first (the tables fill)")
    p.add_argument("--steps", type=int, default=40, help="timed steps")
    p.add_argument("--push-lag", type=int, default=3, help="pulls between a pull and the push of its ids (see the docstring)")
    p.add_argument("--fused-index", action="store_true", help="also time 26 indices against one (see the docstring)")
    args = p.parse_args()
    if args.warmup < 0 or args.steps < 1 or args.push_lag < 0:
        p.error(f"--warmup and --push-lag must be >= 0 and --steps >= 1, got {args.warmup}, {args.push_lag} and {args.steps}")
    prefer_huge_pages(os.environ)  # as every rpcps command does, before torch's first allocation (still to come)
    threads = server_threads(usable_cores())
    torch.set_num_threads(threads)
    print(f"intra-op threads: {threads} (what the host budget gives a busy server beside 2 CPU workers here)")
    server_path(args.optimizer, args.warmup, args.steps, args.push_lag)
    if args.fused_index:
        fused_index(args.warmup, args.steps)


if __name__ == "__main__":
    main()
