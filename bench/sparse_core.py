"""Memory and speed of the server-side sparse table core, in one process (not a test).

What it measures, in this order, on one table (dim 16, row-wise Adagrad by default):

1. Build: pulls ``--rows`` distinct 64-bit ids in batches of ``--batch`` (every pull creates rows:
   admission, deterministic init, index insert, slab write). Reports VmRSS growth per row from
   /proc/self/status (after a warm-up table has paid torch's one-time first-call costs), VmHWM
   growth (the peak, including the growth copies), VmRSS again after glibc's malloc_trim(0) (what
   the allocator keeps of freed temporaries is the difference), the table's own accounting, and the
   index's bytes per row. Compare with MALLOC_MMAP_THRESHOLD_=131072 in the environment. With
   ``--malloc-trim-s`` (default: the product's, as every server runs) the product's own trimmer
   (rpcps.memory) runs during the build, and VmRSS is read again after its next trim: what a server
   holds as it runs.
2. Zipf(``--alpha``) batches of ``--batch`` ids over the built ids, as a CTR step would send them:
   index lookup of the raw batch (duplicates included), then pull and apply of its unique ids.
3. Delta captures after each of ``--delta-steps`` counts of such steps (touched rows only): time
   (all of it under the table lock, so it is the training pause) and size against touched x
   (id + row) bytes.
4. Full snapshot into memory: bytes/s, and the longest single lock hold during it.
5. With ``--write-dir``: the full written to disk with ps/checkpoints/snapshot_files.py (torch.save, fsync,
   SHA-256 manifest, rename) and read back verified with weights_only=True, in MB/s.
6. Raw IdIndex.insert speed on a fresh index.

Run it alone on the machine (single process; on a shared machine under the CPU lock):

    python -m bench.sparse_core                       # 10M rows, dim 16, row-wise Adagrad
    python -m bench.sparse_core --rows 1000000 --optimizer lazy_adam
    python -m bench.sparse_core --via-store --build-only  # memory of the table as the server builds and fills it
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import proc_memory_kb
from ps.checkpoints.snapshot_files import load_snapshot, write_snapshot
from ps.sparse.checkpoint import payload_nbytes
from ps.sparse.index import IdIndex
from ps.sparse.row_optim import FTRL, SGD, Adagrad, LazyAdam, RowWiseAdagrad
from ps.sparse.store import SparseConfig, SparseStore
from ps.sparse.table import SparseTable, TableConfig
from rpcps.memory import Trimmer, prefer_huge_pages, start_trimming, tune_malloc
from rpcps.process import ProcessOptions
from rpcps.sparse.hashing import derive_key, keyed_hash
from rpcps.sparse.spec import TableSpec

OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "sgd": lambda: SGD(lr=0.01),
    "adagrad": lambda: Adagrad(lr=0.01),
    "rowwise_adagrad": lambda: RowWiseAdagrad(lr=0.01),
    "lazy_adam": lambda: LazyAdam(lr=0.001),
    "ftrl": lambda: FTRL(lr=0.05),
}


class TimedLock:
    """A drop-in for the table's threading.Lock that remembers its longest hold."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since = 0.0
        self.longest = 0.0

    def __enter__(self) -> None:
        self._lock.acquire()
        self._since = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.longest = max(self.longest, time.perf_counter() - self._since)
        self._lock.release()


class Zipf:
    """Ranks 0..n-1 with P(rank k) proportional to (k+1)**-alpha, by inverse-CDF lookup."""

    def __init__(self, n: int, alpha: float, seed: int) -> None:
        weights = torch.arange(1, n + 1, dtype=torch.float64).pow_(-alpha)
        self._cdf = torch.cumsum(weights, 0).div_(weights.sum())
        self._gen = torch.Generator().manual_seed(seed)

    def sample(self, size: int) -> torch.Tensor:
        u = torch.rand(size, dtype=torch.float64, generator=self._gen)
        return torch.searchsorted(self._cdf, u).clamp_(max=self._cdf.numel() - 1)


def _rss_kb() -> tuple[int, int]:
    memory = proc_memory_kb(os.getpid())
    assert memory is not None
    return memory


def _best(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of ``repeats`` timed calls, in seconds (the machine is shared and noisy)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _timed_capture(lock: TimedLock, capture: Callable[[], dict[str, Any]]) -> tuple[int, float]:
    """(payload bytes, seconds) of one capture; lock.longest is then its longest lock hold."""
    lock.longest = 0.0
    start = time.perf_counter()
    payload = capture()
    return payload_nbytes(payload), time.perf_counter() - start


def _measure_disk(table: SparseTable, directory: Path) -> None:
    """Writes one full with the existing commit protocol and loads it back verified."""
    full = table.capture_full()
    size = payload_nbytes(full)
    directory.mkdir(parents=True, exist_ok=False)
    try:
        start = time.perf_counter()
        info = write_snapshot(directory, 1, full, {"sparse": "full"})
        write_s = time.perf_counter() - start
        del full
        start = time.perf_counter()
        load_snapshot(info.path)
        read_s = time.perf_counter() - start
    finally:
        shutil.rmtree(directory)
    print(
        f"full snapshot to disk: {info.size_bytes / 1e6:.0f} MB file ({info.size_bytes / size:.4f} x payload) "
        f"written in {write_s:.2f} s = {size / write_s / 1e6:.0f} MB/s, read back verified in {read_s:.2f} s"
    )


Pull = Callable[[torch.Tensor], object]


def _table(config: TableConfig, via_store: bool) -> tuple[SparseTable, Pull]:
    """A fresh table and the call that pulls its ids: the table itself, or the server's SparseStore
    (``ps.sparse.store``: the table built from a SparseConfig as the server builds it, pulls through
    the store's request checks, rows returned in the fp32 wire dtype; the server's pulls only admit
    new ids and its next update creates their rows, so each pull here is followed by that update)."""
    if not via_store:
        table = SparseTable(config)
        return table, table.pull
    sparse = SparseConfig(optimizer=config.optimizer.name, lr=config.optimizer.lr)
    store = SparseStore((TableSpec(name=config.name, table_id=config.table_id, dim=config.dim),), sparse, 0, 1)

    def pull_then_create(ids: torch.Tensor) -> object:
        rows = store.pull({config.name: ids}, torch.float32)
        store.apply(None, store.take_admitted())
        return rows

    return store.tables[config.name], pull_then_create


def _rss_after_next_trim(trimmer: Trimmer, deadline_s: float = 60.0) -> int:
    """VmRSS (kB) once the running trimmer has trimmed again after this call."""
    seen = trimmer.trims
    deadline = time.monotonic() + deadline_s
    while trimmer.trims == seen:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the malloc trimmer did not run within {deadline_s:.0f} s")
        time.sleep(0.05)
    return _rss_kb()[0]


def _measure_build(config: TableConfig, rows: int, batch: int, key: int, via_store: bool, trim_s: float) -> SparseTable:
    warm, pull = _table(config, via_store)  # torch's lazy one-time initialisation is not the table's memory
    pull(torch.arange(5000))
    warm.apply(torch.arange(5000), torch.zeros(5000, config.dim))
    warm.capture_full()
    del warm, pull
    rss0, hwm0 = _rss_kb()
    table, pull = _table(config, via_store)
    trimmer = start_trimming(trim_s)
    start = time.perf_counter()
    for lo in range(0, rows, batch):
        pull(keyed_hash(torch.arange(lo, min(lo + batch, rows)), key))
    build_s = time.perf_counter() - start
    rss1, hwm1 = _rss_kb()
    running = "trimmer off"
    if trimmer is not None:
        running = f"VmRSS after the running trimmer's next trim (every {trim_s:g} s) +{(_rss_after_next_trim(trimmer) - rss0) * 1024 / rows:.1f} B/row"
        trimmer.stop()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    rss2, _ = _rss_kb()
    stats = table.stats()
    print(f"build{' through ps.sparse.store.SparseStore' if via_store else ''}: {rows} rows in {build_s:.1f} s = "
          f"{rows / build_s / 1e6:.2f} M rows/s (pull of new ids)")
    per_row = {name: (kb - base) * 1024 / rows for name, kb, base in (("rss", rss1, rss0), ("hwm", hwm1, hwm0), ("trim", rss2, rss0))}
    print(
        f"memory: VmRSS +{per_row['rss']:.1f} B/row, VmHWM +{per_row['hwm']:.1f} B/row, "
        f"{running}, VmRSS after malloc_trim +{per_row['trim']:.1f} B/row; table accounts {stats.bytes_per_row:.1f} B/row, "
        f"index {stats.index_bytes_per_row:.2f} B/row (payload {config.width * 4} B/row)"
    )
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="rowwise_adagrad")
    p.add_argument("--batch", type=int, default=4096 * 26, help="ids per step (4096 samples x 26 features)")
    p.add_argument("--alpha", type=float, default=1.1)
    p.add_argument("--delta-steps", default="10,100", help="comma-separated step counts, one delta after each")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--write-dir", type=Path, help="an empty scratch directory on the disk to measure (removed after)")
    p.add_argument("--via-store", action="store_true", help="build the table as the server does (ps.sparse.store) and pull through it")
    p.add_argument("--build-only", action="store_true", help="stop after the build (memory) figures")
    p.add_argument(
        "--malloc-trim-s",
        type=float,
        default=ProcessOptions().malloc_trim_s,
        help="run the product's malloc trimmer during the build every this many seconds, as a server does "
        "(default: the product's default; 0: off)",
    )
    args = p.parse_args()
    prefer_huge_pages(os.environ)  # what every rpcps command does first (torch reads it at its first allocation, still to come)
    tune_malloc()  # what every rpcps process does first (arenas capped); MALLOC_* in the environment wins
    key = derive_key(2024)
    config = TableConfig(spec=TableSpec(name="bench", table_id=0, dim=args.dim), optimizer=OPTIMIZERS[args.optimizer]())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {config.optimizer}, width {config.width}")
    print(f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}")
    table = _measure_build(config, args.rows, args.batch, key, args.via_store, args.malloc_trim_s)
    if args.build_only:
        return
    lock = TimedLock()
    table._lock = lock  # type: ignore[assignment]

    zipf = Zipf(args.rows, args.alpha, seed=1)
    steps = [int(n) for n in args.delta_steps.split(",")]
    batches = [keyed_hash(zipf.sample(args.batch), key) for _ in range(max(steps))]
    uniques = [torch.unique(b) for b in batches]
    grads = [torch.randn(u.numel(), args.dim) for u in uniques]
    print(f"zipf({args.alpha}) batches of {args.batch} ids: {sum(u.numel() for u in uniques) / len(uniques):.0f} unique on average")
    index = table._index
    for name, ids, fn in (
        ("index lookup, raw batch", batches[0], index.lookup),
        ("index lookup, unique ids", uniques[0], index.lookup),
        ("pull, unique ids", uniques[0], table.pull),
    ):
        t = _best(lambda fn=fn, ids=ids: fn(ids), args.repeats)
        print(f"{name}: {ids.numel() / t / 1e6:.2f} M ids/s ({ids.numel()} ids in {t * 1e3:.1f} ms)")
    step_s = []
    for u, g in zip(uniques, grads, strict=True):
        start = time.perf_counter()
        table.apply(u, g)
        step_s.append(time.perf_counter() - start)
    mean_rows = sum(u.numel() for u in uniques) / len(uniques)
    print(
        f"apply ({config.optimizer.name}): {mean_rows / (sum(step_s) / len(step_s)) / 1e6:.2f} M rows/s mean, "
        f"{mean_rows / min(step_s) / 1e6:.2f} M rows/s best step ({min(step_s) * 1e3:.1f} ms)"
    )

    for n in steps:
        table.capture_delta()  # start a clean interval
        for u, g in zip(uniques[:n], grads[:n], strict=True):
            table.apply(u, g)
        touched = torch.unique(torch.cat(uniques[:n])).numel()
        size, seconds = _timed_capture(lock, table.capture_delta)
        print(
            f"delta after {n} steps: {touched} touched rows, {size / 1e6:.1f} MB = "
            f"{size / (touched * (8 + config.width * 4)):.3f} x touched (id + row) bytes, "
            f"{size / (touched * config.width * 4):.3f} x touched row bytes; "
            f"capture {seconds * 1e3:.1f} ms, longest lock hold {lock.longest * 1e3:.1f} ms"
        )

    for u, g in zip(uniques[:10], grads[:10], strict=True):
        table.apply(u, g)  # pending dirty rows for the full's closing step
    size, seconds = _timed_capture(lock, table.capture_full)
    print(
        f"full snapshot into memory: {size / 1e6:.0f} MB in {seconds:.2f} s = {size / seconds / 1e6:.0f} MB/s, "
        f"longest lock hold {lock.longest * 1e3:.1f} ms"
    )

    if args.write_dir is not None:
        _measure_disk(table, args.write_dir)

    fresh_ids = keyed_hash(torch.arange(args.rows, args.rows + 1_000_000), key)
    fresh = IdIndex()
    start = time.perf_counter()
    for lo in range(0, fresh_ids.numel(), args.batch):
        chunk = fresh_ids[lo : lo + args.batch]
        fresh.insert(chunk, torch.arange(lo, lo + chunk.numel()))
    t = time.perf_counter() - start
    print(f"raw index insert, 1M new ids in batches of {args.batch}: {1 / t:.2f} M ids/s")


if __name__ == "__main__":
    main()
