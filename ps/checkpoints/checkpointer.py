"""Periodic, on-demand and final snapshots of the server, written in the background; and resume.

Triggers: every N applied updates, every T seconds, on demand (control plane) and on a graceful stop.
Taking a snapshot copies the state in memory under the server's lock (fast), then this module's
own thread writes it without holding that lock, so training goes on while the disk works. One write
at a time: a periodic trigger that fires during a write is folded into the next one.

Sparse tables are not copied whole under the lock: each snapshot holds a delta of them (the rows
touched since the previous snapshot) chained to an earlier full, and a full is copied by this
module's thread between snapshots, off the request path (ps/checkpoints/sparse_checkpoint.py). The purge keeps
every snapshot a kept snapshot's chain needs.

A failed write (full disk, read-only or vanished directory) is logged and counted, leaves the
previous snapshots untouched, and is retried at the next trigger.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ps.checkpoints.audit import AuditLog
from ps.checkpoints.reshard import ReshardRefused
from ps.checkpoints.reshard_files import JOURNAL, journal_of, layout_dir, layouts
from ps.checkpoints.snapshot_files import (
    FINISHED_FILE,
    InvalidSnapshot,
    Signer,
    SnapshotInfo,
    UnsignedSnapshot,
    leftover_tmp_dirs,
    list_snapshots,
    load_snapshot,
    peek_manifest,
    snapshot_name,
    write_json_durably,
    write_snapshot,
)
from ps.checkpoints.sparse_checkpoint import (
    MANIFEST_KEY,
    SPARSE_FILE,
    BrokenChain,
    SparseCapture,
    SparseCheckpoints,
    chain_names,
    read_chain,
)
from ps.config import CheckpointConfig
from ps.core.metrics import ServerMetrics
from ps.sparse.store import SparseStore
from rpcps import failpoints
from rpcps.errors import NotPrimary
from rpcps.signature import ModelSignature

if TYPE_CHECKING:
    from ps.core.update_log import UpdateApplied

logger = logging.getLogger(__name__)

class Snapshottable(Protocol):
    """What the checkpointer needs of the server (``ps.core.server.ParameterServer``)."""

    version: int
    mirroring: bool
    """A standby: it writes no snapshots of its own (its primary does)."""
    deposed: bool
    """A replaced primary: it writes nothing more."""
    not_primary_reason: str
    lock: threading.Lock
    sparse: SparseStore | None

    def capture_state_locked(self, include_sparse: bool = True) -> tuple[int, dict[str, Any]]: ...


@dataclass
class _Captured:
    """One snapshot's state as copied under the server's lock, not written yet."""

    version: int
    state: dict[str, Any]
    sparse: SparseCapture | None


class CheckpointUnavailable(RuntimeError):
    """Checkpointing is not configured on this server."""


class Checkpointer:
    def __init__(
        self,
        server: Snapshottable,
        config: CheckpointConfig,
        meta: dict[str, Any],
        metrics: ServerMetrics,
        ledger: AuditLog | None = None,
        sign: Signer | None = None,
    ) -> None:
        if config.directory is None:
            raise CheckpointUnavailable("checkpointing is off; start the server with --checkpoint-dir DIR")
        self.server = server
        self.config = config
        self.directory = Path(config.directory)
        self.meta = meta
        self.metrics = metrics
        self.ledger = ledger
        """Told of each snapshot just before it is committed (fault-injection checks)."""
        self.sign = sign
        """Signs each manifest (``--sign-checkpoints``: an HMAC keyed by the job secret)."""
        self._write_lock = threading.Lock()
        """One write at a time."""
        self._due = threading.Event()
        self._stop = threading.Event()
        self._last_version = server.version
        self._armed_from = server.version
        self._handoff = threading.Lock()
        """Guards the three fields below between the apply path and the writer (never held across I/O)."""
        self._capture_wanted = False
        self._captured: _Captured | None = None
        self._writing = False
        self._newest: SnapshotInfo | None = None
        self.durable_progress: dict[int, int] = {}
        """Per worker slot, its first step the newest committed snapshot does not hold."""
        self._finished_lock = threading.Lock()
        self._finished = _read_finished(self.directory / FINISHED_FILE)
        self.sparse = SparseCheckpoints(server.sparse, metrics) if server.sparse is not None else None
        """The chain of the sparse tables' deltas (None for a model without sparse tables)."""
        self._thread = threading.Thread(target=self._loop, name="checkpointer", daemon=True)

    # ---- public API ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def on_applied(self, event: UpdateApplied) -> None:
        """An ``on_applied`` listener (under the server's lock): captures the state every N updates.

        The copy is taken right here, at the update that makes it due, rather than by the writer
        thread: on a busy server that thread can wait behind a queue of pushes for the lock while
        hundreds of updates go by, which would stretch the interval (and what a crash can lose).
        While a write is under way the capture waits for the first update after it commits.
        """
        every = self.config.every_updates
        if every is not None and event.version - self._armed_from >= every:
            self._capture_wanted = True
        if not self._capture_wanted:
            return
        with self._handoff:
            if self._writing or self._captured is not None:
                return
            self._capture_wanted = False
            self._armed_from = event.version
            self._captured = self._capture_locked()
        if self.ledger is not None:
            self.ledger.captured(event.version)
        self._due.set()

    def checkpoint_now(self, stepping_down: bool = False) -> tuple[str, int]:
        """Writes a snapshot now (waiting for a write in progress) and returns (path, version).

        Raises OSError when the write fails; earlier snapshots stay intact. Raises NotPrimary on a
        standby or a replaced primary: only the process serving the shard writes its snapshots.
        ``stepping_down``: a primary that stepped down with no standby writes its exact state once
        more, to restart from it (``ps.runner``): nobody else holds what it applied.
        """
        if self.server.mirroring or (self.server.deposed and not stepping_down):
            raise NotPrimary(self.server.not_primary_reason or "this process does not serve its shard now")
        info = self._write(force=True)
        assert info is not None
        return str(info.path), info.version

    def ensure_durable(self, version: int) -> SnapshotInfo:
        """A committed snapshot holding at least ``version``: the newest one, or one written now.

        Raises OSError when the write fails (earlier snapshots stay intact).
        """
        newest = self._newest
        if newest is not None and newest.version >= version:
            return newest
        info = self._write(force=True, at_least=version)
        assert info is not None
        return info

    def record_finished(self, slot: int, steps: int) -> None:
        """Notes durably that ``slot``'s worker finished all ``steps`` (after ``ensure_durable``)."""
        with self._finished_lock:
            if self._finished.get(slot) == steps:
                return
            self._finished[slot] = steps
            write_json_durably(self.directory / FINISHED_FILE, {str(k): v for k, v in sorted(self._finished.items())})

    def finished_slots(self) -> dict[int, int]:
        """Slot -> steps of every worker slot that finished (recorded in finished.json)."""
        with self._finished_lock:
            return dict(self._finished)

    def newest(self) -> tuple[str, int, float] | None:
        info = self._newest
        return None if info is None else (str(info.path), info.version, info.created_unix)

    def stop(self, final: bool) -> None:
        """Stops the periodic thread; with ``final``, writes one last snapshot (failure is logged)."""
        self._stop.set()
        self._due.set()
        if self._thread.ident is not None:  # a standby's checkpointer starts only on promotion
            self._thread.join(timeout=120)
        if final:
            try:
                path, version = self.checkpoint_now()
                logger.info("final snapshot at version %d: %s", version, path)
            except OSError as e:
                logger.error("final snapshot failed: %s", e)
        if self.sparse is not None:
            with self._write_lock:
                self.sparse.close()

    def adopt(self, info: SnapshotInfo, state: dict[str, Any]) -> None:
        """Records the snapshot the server resumed from (and its captured ``state``) as the newest."""
        self._newest = info
        self.durable_progress = _progress(state)
        self._last_version = self._armed_from = info.version
        self._publish(info)

    # ---- internals -----------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._write_lock:
                self._prepare_sparse()
            self._due.wait(timeout=self.config.every_seconds)
            self._due.clear()
            if self._stop.is_set():
                return
            try:
                self._write(force=False)
            except OSError:
                pass  # logged and counted in _write; the next trigger retries

    def _capture_locked(self) -> _Captured:
        """Under the server's lock: the dense state, and the sparse tables' part of the chain."""
        if self.sparse is None:
            return _Captured(*self.server.capture_state_locked(), sparse=None)
        version, state = self.server.capture_state_locked(include_sparse=False)
        return _Captured(version, state, self.sparse.capture_locked())

    def _prepare_sparse(self) -> None:
        """Under the write lock: copies a due sparse full off the request path (see
        ps/checkpoints/sparse_checkpoint.py); the apply path takes no capture meanwhile, so the next one closes it."""
        if self.sparse is None or not self.sparse.full_due():
            return
        with self._handoff:
            if self._captured is not None:
                return  # a capture waits to be written; the full is prepared after it
            writing, self._writing = self._writing, True
        try:
            self.sparse.prepare()
        except Exception:  # the next capture copies the full under the lock instead
            self.metrics.checkpoint_failures.inc()
            logger.exception("preparing a full copy of the sparse tables failed; the next snapshot copies it under the lock")
        finally:
            with self._handoff:
                self._writing = writing

    def _take_capture(self, force: bool, at_least: int | None) -> _Captured | None:
        """What to write now: the copy the apply path took, or a fresh one; None when nothing is new."""
        with self._handoff:
            captured, self._captured = self._captured, None
            self._writing = True
        if captured is not None and (at_least is None or captured.version >= at_least):
            return captured
        if captured is not None and self.sparse is not None:
            self.sparse.broken(f"the capture of version {captured.version} was replaced by a newer one before it was written")
        if not force and self.server.version == self._last_version:
            return None  # nothing new since the last snapshot (a timed trigger on an idle server)
        self._prepare_sparse()
        with self.server.lock:
            captured = self._capture_locked()
        if self.ledger is not None:
            self.ledger.captured(captured.version)
        return captured

    def _write(self, force: bool, at_least: int | None = None) -> SnapshotInfo | None:
        with self._write_lock:
            newest = self._newest
            if force and newest is not None and newest.version >= (self.server.version if at_least is None else at_least):
                return newest  # a write that finished while we waited for the lock already holds it
            try:
                return self._write_captured(force, at_least)
            finally:
                with self._handoff:
                    self._writing = False

    def _write_captured(self, force: bool, at_least: int | None) -> SnapshotInfo | None:
        """Under the write lock: captures (or takes the apply path's copy) and writes one snapshot."""
        started = time.perf_counter()
        captured = self._take_capture(force, at_least)
        if captured is None:
            return None
        version, state = captured.version, captured.state
        meta, files = self.meta, {}
        if captured.sparse is not None and self.sparse is not None:
            try:
                sparse = captured.sparse.payload()  # builds a prepared full's rows: outside the lock, before the I/O
            except Exception as e:  # out of memory, most likely: this capture is lost, the next trigger retries
                self.sparse.broken(f"building the sparse part of version {version} failed")
                self.metrics.checkpoint_failures.inc()
                logger.exception("snapshot of version %d failed before its write; training goes on, the next trigger retries", version)
                raise OSError(f"snapshot of version {version}: building its sparse tables' payload failed: {e}") from e
            meta = {**self.meta, MANIFEST_KEY: self.sparse.manifest_entry(captured.sparse, snapshot_name(version))}
            files = {SPARSE_FILE: sparse}

        def before_commit() -> None:
            # The ledger hears of the snapshot before the rename that commits it: a crash in
            # between may leave it committed, so a resume to it must find its line already there.
            if self.ledger is not None:
                self.ledger.snapshot(version)
            failpoints.hit("snapshot.before_commit")

        try:
            info = write_snapshot(
                self.directory, version, state, meta, before_commit=before_commit, sign=self.sign, extra_files=files
            )
        except OSError as e:
            if self.sparse is not None:
                self.sparse.broken(f"the snapshot of version {version} failed")
            self.metrics.checkpoint_failures.inc()
            logger.error(
                "snapshot of version %d in %s failed: %s; training goes on, previous snapshots are intact, "
                "the next trigger retries", version, self.directory, e,
            )
            raise
        if self.ledger is not None:
            self.ledger.committed(version)
        if captured.sparse is not None and self.sparse is not None:
            self.sparse.committed(captured.sparse, info.path.name, files[SPARSE_FILE])
            self._prepare_sparse()
        with self._handoff:  # committed: the apply path may take the next copy now, not after the purge below
            self._writing = False
        failpoints.hit("snapshot.after_commit")
        seconds = time.perf_counter() - started
        self.metrics.checkpoint_seconds.observe(seconds)
        self._newest = info
        self.durable_progress = _progress(state)
        self._last_version = version
        self._publish(info)
        self._note_lag(version, seconds)
        logger.info("snapshot of version %d written to %s in %.2fs", version, info.path, seconds)
        self._purge(info)
        return info

    def _note_lag(self, version: int, seconds: float) -> None:
        """Counts the updates applied while this snapshot was written: a crash just before its commit
        loses them on top of the interval (docs/FAULT_TOLERANCE.md), so say when they outgrow it."""
        during = self.server.version - version
        self.metrics.checkpoint_write_updates.set(during)
        every = self.config.every_updates
        if every is not None and during > every:
            self.metrics.checkpoint_behind.inc()
            logger.warning(
                "writing the snapshot of version %d took %.2fs, during which %d updates were applied (more than "
                "--checkpoint-every-updates %d): a crash now can lose up to %d updates; use faster storage or a "
                "larger interval", version, seconds, during, every, every + during,
            )

    def _publish(self, info: SnapshotInfo) -> None:
        self.metrics.checkpoint_bytes.set(info.size_bytes)
        self.metrics.checkpoint_last_success.set(info.created_unix)
        self.metrics.checkpoint_version.set(info.version)

    def _purge(self, newest: SnapshotInfo) -> None:
        """Deletes all but the newest ``keep`` snapshots and the links of their sparse chains; never
        the one just written; never raises."""
        others = [p for p in list_snapshots(self.directory) if p != newest.path]
        kept = [newest.path, *others[: self.config.keep - 1]]
        needed = {name for path in kept for name in _chain_of(path)}
        for path in others[self.config.keep - 1 :]:
            if path.name in needed:
                continue
            try:
                shutil.rmtree(path)
            except OSError as e:
                logger.warning("could not delete old snapshot %s: %s; will try again next time", path, e)
        for tmp in leftover_tmp_dirs(self.directory):
            if _writer_alive(tmp):
                continue
            try:
                shutil.rmtree(tmp)
            except OSError as e:
                logger.warning("could not delete leftover %s: %s", tmp, e)


def _chain_of(path: Path) -> list[str]:
    """The snapshots (names) whose sparse files ``path`` needs; none when its manifest is unreadable."""
    try:
        return chain_names(peek_manifest(path))
    except InvalidSnapshot:
        return []


def _read_finished(path: Path) -> dict[int, int]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.error("cannot read %s (%s): which worker slots finished is unknown; ctl status will not show them", path, e)
        return {}
    return {int(slot): int(steps) for slot, steps in data.items()}


def _progress(state: dict[str, Any]) -> dict[int, int]:
    """Per worker slot, its first step a captured state does not hold."""
    return {int(slot): int(tracker["floor"]) + 1 for slot, tracker in state["workers"].items()}


def _writer_alive(tmp: Path) -> bool:
    """True when the process that created this temporary snapshot directory still runs."""
    try:
        pid = int(tmp.name.rsplit("-", 2)[-2])
    except (ValueError, IndexError):
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


ResumePoint = tuple[SnapshotInfo, dict[str, Any]]
"""A snapshot chosen to resume from, and the state it holds."""


class ResumeRefused(ValueError):
    """The chosen snapshot cannot be resumed into this server (different model or optimizer)."""


def shard_checkpoint_config(config: CheckpointConfig, shard_index: int, shard_count: int) -> CheckpointConfig:
    """Where shard ``shard_index`` of ``shard_count`` keeps its snapshots.

    One server writes into --checkpoint-dir itself; shards write into ``shard-K-of-S`` below it.
    A directory holding snapshots of another shard count is refused, whatever --resume says:
    resuming from it would mix parameters or partitions, and starting fresh beside it (``never``)
    would leave two layouts no later resume can choose between. ``rpcps reshard`` converts it
    (ps/checkpoints/reshard_files.py); while a conversion is unfinished, the directory is refused too.
    """
    if config.directory is None:
        return config
    root = Path(config.directory)
    if root.exists() and not root.is_dir():  # else the first file looked for inside it would be named instead
        raise ResumeRefused(f"--checkpoint-dir {root} is a file, not a directory: point it at a directory (it is created if missing)")
    mine = layout_dir(root, shard_index, shard_count)
    name = "unsharded" if shard_count == 1 else mine.name
    try:
        journal = journal_of(root)
    except ReshardRefused as e:
        raise ResumeRefused(str(e)) from None
    if journal is not None:
        raise ResumeRefused(
            f"{root} holds an unfinished rpcps reshard from {journal['from']} to {journal['to']} shard(s) ({JOURNAL}); "
            f"finish it: rpcps reshard --checkpoint-dir {root} --shards {journal['to']}"
        )
    others = sorted(count for count in layouts(root) if count != shard_count)
    if others:
        found = ", ".join(f"{count} shard(s)" for count in others)
        raise ResumeRefused(
            f"{root} holds snapshots of {found}, but this server is {name} (--shards {shard_count}); resume with "
            f"--shards {others[0]}, or convert the directory first with the job stopped: rpcps reshard --checkpoint-dir {root} "
            f"--shards {shard_count} (docs/FAULT_TOLERANCE.md, Resharding), or point --checkpoint-dir at an empty directory"
        )
    if shard_count == 1:
        return config
    return replace(config, directory=str(mine))


def find_resume_point(
    config: CheckpointConfig,
    signature: ModelSignature,
    optimizer: str,
    partition: str | None = None,
    verify: Signer | None = None,
) -> ResumePoint | None:
    """Picks the snapshot to resume from per ``config.resume``; None to start fresh.

    ``auto`` walks from the newest snapshot to older ones, skipping (and logging why) any that is
    incomplete, truncated or corrupt; skipped ones are renamed ``.invalid-*`` so later versions
    never sort behind them. Raises ResumeRefused for a snapshot of another model or optimizer.

    With ``verify`` (``--sign-checkpoints``) a snapshot signed with another key counts as corrupt;
    an unsigned one refuses ``auto`` (it may be this job's own, from before signing was on, so it
    is neither skipped nor moved aside), and is taken, with a warning, only when named by ``--resume PATH``.
    """
    if config.resume == "never":
        if config.directory and list_snapshots(Path(config.directory)):
            raise ResumeRefused(
                f"--resume never, but {config.directory} already holds snapshots; use an empty --checkpoint-dir "
                "or --resume auto (new snapshots would mix with the old run's)"
            )
        return None
    if config.resume == "auto":
        if config.directory is None:
            return None
        candidates = list_snapshots(Path(config.directory))
        if not candidates:
            logger.info("no snapshot in %s; starting fresh", config.directory)
            return None
    else:
        candidates = [Path(config.resume)]
        if not candidates[0].is_dir():
            raise ResumeRefused(f"--resume {config.resume}: no such snapshot directory")
    for path in candidates:
        checks = verify
        try:
            manifest, state = load_snapshot(path, verify)
        except UnsignedSnapshot:
            if config.resume == "auto":
                raise ResumeRefused(
                    f"snapshot {path} is not signed, and this server requires signed snapshots (--sign-checkpoints): "
                    f"if it is this job's own, resume it once with --resume {path}; otherwise remove it"
                ) from None
            logger.warning("resuming from the unsigned snapshot %s because --resume names it", path)
            manifest, state = load_snapshot(path)
            checks = None
        except InvalidSnapshot as e:
            if config.resume != "auto":
                raise ResumeRefused(f"--resume {path}: {e}") from None
            logger.warning("skipping snapshot %s: %s", path, e)
            _quarantine(path)
            continue
        _check_compatible(path, manifest, signature, optimizer)
        if partition is not None and manifest.get("partition_digest", partition) != partition:
            raise ResumeRefused(
                f"snapshot {path} belongs to a different partition of the model (other --shards); resume with the "
                "same --shards or start a fresh --checkpoint-dir"
            )
        if MANIFEST_KEY in manifest:  # read last: it may be hundreds of MB
            state["sparse"] = _read_sparse_chain(path, manifest, checks)
        info = SnapshotInfo(path, int(manifest["version"]), float(manifest["created_unix"]),
                            sum(f["size"] for f in manifest["files"].values()))
        return info, state
    logger.warning("no valid snapshot left in %s; starting fresh", config.directory)
    return None


def _read_sparse_chain(path: Path, manifest: dict[str, Any], verify: Signer | None) -> dict[str, Any]:
    """The sparse tables' chains of a verified snapshot; ResumeRefused, naming the unusable file and
    what to do, when a link is broken (nothing is moved aside: the other snapshots are intact)."""
    try:
        return read_chain(path, manifest, verify)
    except BrokenChain as e:
        older = [p for p in list_snapshots(path.parent) if p.name < e.link.name]
        instead = (
            f"resume the newest snapshot before it with --resume {older[0]} (workers recompute the steps after it)"
            if older else "no older snapshot is left to resume instead; start a fresh --checkpoint-dir"
        )
        raise ResumeRefused(f"{e}. Restore that file from a backup, or {instead}") from None
    except InvalidSnapshot as e:
        raise ResumeRefused(f"snapshot {path}: {e}") from None


def _check_compatible(path: Path, manifest: dict[str, Any], signature: ModelSignature, optimizer: str) -> None:
    theirs = ModelSignature.from_wire(manifest.get("signature", []))
    if signature.buffers and not theirs.buffers:
        logger.warning(
            "snapshot %s was written before rpcps kept a model's buffers: resuming its parameters, with the model's "
            "initial buffers (BatchNorm statistics start afresh)", path,
        )
        signature = ModelSignature(signature.params)
    diff = signature.first_difference(theirs, ours="server", theirs="snapshot")
    if diff is not None:
        raise ResumeRefused(
            f"snapshot {path} was written for a different model: {diff}; "
            "point --checkpoint-dir elsewhere or use the model it was written for"
        )
    if manifest.get("optimizer") != optimizer:
        raise ResumeRefused(
            f"snapshot {path} holds {manifest.get('optimizer')!r} optimizer state but this server runs {optimizer!r}; "
            "resume with the same --optimizer or start a fresh --checkpoint-dir"
        )


def _quarantine(path: Path) -> None:
    target = path.with_name(f".invalid-{path.name}-{int(time.time())}")
    try:
        os.rename(path, target)
        logger.warning("moved invalid snapshot aside to %s", target)
    except OSError as e:
        logger.warning("could not move invalid snapshot %s aside: %s", path, e)
