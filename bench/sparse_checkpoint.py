"""Checkpoints of a big sparse table through the server's real checkpointer, in one process (not a test).

A ParameterServer holds one table (dim ``--dim``, the product's default row optimizer and settings)
and a small dense head; pushes go through the worker API (``WorkerService.push``: checks, the
server's lock, the row optimizer), and its ``Checkpointer`` writes snapshots into ``--dir`` with the
product's commit protocol. A probe thread takes the server's lock the way a push does, all along,
and records how long it waited: that is the training pause a snapshot causes. Side by side in one run:

1. ``--rows`` rows (pulls of new ids), then the first snapshot: a full copied in slices off the
   request path, closed under the lock, written (torch.save + fsync + SHA-256 + rename). MB/s of
   the sparse payload over the whole snapshot, and the pause.
2. ``--deltas`` snapshots, each after ``--steps-per-delta`` pushes of Zipf(``--alpha``) batches of
   ``--batch`` ids: the pause of each, and the delta file's size against the touched rows' record
   bytes (id 8 + row and optimizer state + last_seen 4 + count 2) plus 8 bytes per tombstone. Every
   ``--sparse-full-every-deltas`` deltas the next full is prepared while pushes go on; its MB/s
   counts that preparation.
3. The old way, for comparison: the whole table copied under the server's lock (what a snapshot did
   before chains, and what a standby's state transfer still does): its pause.
4. The newest chain read back and restored onto 1 and onto 3 servers: rows compared bit for bit
   with the live table, and the time.

    python -m bench.sparse_checkpoint --dir /tmp/sparse-ckpt-bench          # 10 M rows, dim 16
    python -m bench.sparse_checkpoint --dir /tmp/sparse-ckpt-bench --rows 1000000 --steps-per-delta 100

Single process; the directory is removed at the end. Peak memory is about 6x the table's payload.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import torch
from torch import nn

from bench.common import run_in_scratch
from bench.sparse_core import Zipf
from harness.inprocess import InProcessServer, pack
from ps.checkpoints.checkpointer import Checkpointer
from ps.checkpoints.snapshot_files import list_snapshots, peek_manifest
from ps.checkpoints.sparse_checkpoint import SPARSE_FILE, read_layouts
from ps.config import CheckpointConfig
from ps.core.config import ServerCoreConfig
from ps.sparse.store import SparseConfig, SparseStore
from rpcps.messages import PushStatus
from rpcps.sparse.embedding import SparseEmbeddingBagCollection
from rpcps.sparse.hashing import derive_key, keyed_hash
from rpcps.sparse.spec import TableSpec

TABLE = "t"


class OneTable(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.embeddings = SparseEmbeddingBagCollection([TableSpec(name=TABLE, table_id=0, dim=dim)], pooling="sum")
        self.head = nn.Linear(dim, 1)


class LockProbe:
    """Takes the server's lock in a loop, as pushes do, and keeps the longest wait since ``reset``."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._stop = threading.Event()
        self.longest = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def reset(self) -> None:
        self.longest = 0.0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            with self._lock:
                waited = time.perf_counter() - start
            self.longest = max(self.longest, waited)
            time.sleep(0.0005)


class Pusher:
    """Pushes Zipf batches through the worker API, one (slot 0) step after another."""

    def __init__(self, server: InProcessServer, rows: int, batch: int, alpha: float, dim: int, key: int) -> None:
        self.server = server
        self.incarnation = server.register(0, "w0", server.signature.to_wire()).incarnation
        self.dense = pack(server.layout, [torch.zeros_like(p) for p in OneTable(dim).parameters()])
        self._zipf, self._batch, self._dim, self._key = Zipf(rows, alpha, seed=1), batch, dim, key
        self.seq = 0
        self.touched: list[torch.Tensor] = []

    def steps(self, n: int) -> None:
        for _ in range(n):
            ids = torch.unique(keyed_hash(self._zipf.sample(self._batch), self._key))
            grads = torch.randn(ids.numel(), self._dim).to(self.server.core.wire)
            reply = self.server.push(0, self.incarnation, self.seq, self.server.version, self.dense, 1.0, {TABLE: (ids, grads)})
            assert reply.status == PushStatus.APPLIED, reply
            self.touched.append(ids)
            self.seq += 1

    def take_touched(self) -> int:
        touched = torch.unique(torch.cat(self.touched)).numel() if self.touched else 0
        self.touched = []
        return touched


def _pause_sum(server: InProcessServer) -> float:
    value = server.core.metrics.registry.get_sample_value("rpcps_sparse_checkpoint_pause_seconds_sum")
    return float(value or 0.0)


def _sorted_rows(stores: list[SparseStore]) -> tuple[torch.Tensor, torch.Tensor]:
    fulls = [full["records"] for store in stores for full in store.capture()[TABLE]]
    ids = torch.cat([f["ids"] for f in fulls])
    order = torch.argsort(ids)
    return ids[order], torch.cat([f["rows"] for f in fulls])[order]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, required=True, help="scratch directory on the disk to measure (created, then removed)")
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=4096 * 26, help="ids per push (4096 samples x 26 features)")
    p.add_argument("--alpha", type=float, default=1.1)
    p.add_argument("--steps-per-delta", type=int, default=20)
    p.add_argument("--deltas", type=int, default=4)
    p.add_argument("--sparse-full-every-deltas", type=int, default=3)
    args = p.parse_args()
    run_in_scratch(args.dir, lambda: run(args))


def run(args: argparse.Namespace) -> None:
    sparse = SparseConfig(full_every_deltas=args.sparse_full_every_deltas)
    server = InProcessServer(OneTable(args.dim), ServerCoreConfig(sparse=sparse))
    table = server.core.sparse.tables[TABLE]
    key = derive_key(2024)
    start = time.perf_counter()
    for lo in range(0, args.rows, 1 << 18):
        table.pull(keyed_hash(torch.arange(lo, min(lo + (1 << 18), args.rows)), key))
    record_bytes = 8 + table.config.width * 4 + 4 + 2
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {table.config.optimizer}, width {table.config.width}, "
          f"{record_bytes} B per row record; {len(table)} rows built in {time.perf_counter() - start:.1f} s")
    meta = {"signature": server.signature.to_wire(), "optimizer": server.config.optimizer.name}
    checkpointer = Checkpointer(server.core, CheckpointConfig(directory=str(args.dir), every_seconds=None, keep=1), meta, server.core.metrics)
    assert checkpointer.sparse is not None
    prepare_s: list[float] = []
    prepare = checkpointer.sparse.prepare

    def timed_prepare() -> None:
        began = time.perf_counter()
        prepare()
        prepare_s.append(time.perf_counter() - began)

    checkpointer.sparse.prepare = timed_prepare  # type: ignore[method-assign]
    probe = LockProbe(server.core.lock)
    pusher = Pusher(server, args.rows, args.batch, args.alpha, args.dim, key)
    pusher.steps(1)
    pusher.take_touched()
    try:
        print("| snapshot | kind | rows touched | sparse.pt MB | size / (touched x record + tombstones x 8) | pause (lock, sparse part) ms "
              "| longest push wait ms | snapshot s (a full: with its copy off the lock) | full MB/s |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        carried = 0.0
        delta_waits = []
        for i in range(args.deltas + 2):
            if i:
                pusher.steps(args.steps_per_delta)
            touched = pusher.take_touched()
            tombstones = table.stats().tombstones_pending
            probe.reset()
            prepare_s.clear()
            pause0, began = _pause_sum(server), time.perf_counter()
            path, _ = checkpointer.checkpoint_now()
            seconds = time.perf_counter() - began
            pause = _pause_sum(server) - pause0
            # A prepare after this snapshot's commit copies the next full: count it there, not here.
            for_next = sum(prepare_s) if checkpointer.sparse.full_ready else 0.0
            own = seconds - for_next
            kind = peek_manifest(Path(path))["sparse"]["kind"]
            if kind == "full":
                own += carried
            carried = for_next
            if kind == "delta":
                delta_waits.append(probe.longest)
            size = (Path(path) / SPARSE_FILE).stat().st_size
            ratio = f"{size / (touched * record_bytes + tombstones * 8):.3f}" if kind == "delta" else "-"
            rate = f"{size / own / 1e6:.0f}" if kind == "full" else "-"
            print(f"| {i} | {kind} | {touched if i else '-'} | {size / 1e6:.1f} | {ratio} | {pause * 1e3:.1f} | "
                  f"{probe.longest * 1e3:.1f} | {own:.2f} | {rate} |")
        probe.reset()
        began = time.perf_counter()
        server.core.capture_state()  # the whole table under the lock, as before chains
        print(f"old way, the whole table copied under the server's lock: {(time.perf_counter() - began) * 1e3:.0f} ms, "
              f"longest push wait {probe.longest * 1e3:.0f} ms = {probe.longest / max(delta_waits):.1f} x the longest "
              f"delta's ({max(delta_waits) * 1e3:.1f} ms)")
    finally:
        probe.stop()
        checkpointer.sparse.close()  # the writer thread was never started: snapshots were taken here
    newest = list_snapshots(args.dir)[0]
    live = _sorted_rows([server.core.sparse])
    for servers in (1, 3):
        began = time.perf_counter()
        chains = read_layouts(args.dir)
        stores = [SparseStore((TableSpec(name=TABLE, table_id=0, dim=args.dim),), sparse, k, servers)
                  for k in range(servers)]
        for store in stores:
            store.restore(chains)
        restore_s = time.perf_counter() - began
        got = _sorted_rows(stores)
        same = torch.equal(got[0], live[0]) and torch.equal(got[1], live[1])
        print(f"restore of {newest.name} (a chain of {len(peek_manifest(newest)['sparse']['chain'])}) onto {servers} server(s): "
              f"{restore_s:.1f} s, rows bit-identical to the live table: {same}")
        del chains, stores, got


if __name__ == "__main__":
    main()
