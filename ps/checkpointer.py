"""Periodic, on-demand and final snapshots of the server, written in the background; and resume.

Triggers: every N applied updates, every T seconds, on demand (control plane) and on a graceful stop.
Taking a snapshot copies the state in memory under the server's lock (fast), then this module's
own thread writes it without holding that lock, so training goes on while the disk works. One write
at a time: a periodic trigger that fires during a write is folded into the next one.

A failed write (full disk, read-only or vanished directory) is logged and counted, leaves the
previous snapshots untouched, and is retried at the next trigger.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from ps.audit import AuditLog
from ps.config import CheckpointConfig
from ps.metrics import ServerMetrics
from ps.snapshot_files import (
    InvalidSnapshot,
    SnapshotInfo,
    leftover_tmp_dirs,
    list_snapshots,
    load_snapshot,
    write_snapshot,
)
from rpcps.signature import ModelSignature

logger = logging.getLogger(__name__)


class Snapshottable(Protocol):
    """What the checkpointer needs of the server (``ps.server.ParameterServer``)."""

    version: int

    def capture_state(self) -> tuple[int, dict[str, Any]]: ...


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
        self._write_lock = threading.Lock()
        self._due = threading.Event()
        self._stop = threading.Event()
        self._last_version = server.version
        self._armed_from = server.version
        self._newest: SnapshotInfo | None = None
        self._thread = threading.Thread(target=self._loop, name="checkpointer", daemon=True)

    # ---- public API ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def notify_update(self, version: int) -> None:
        """Called after each applied update; cheap: at most sets an event."""
        every = self.config.every_updates
        if every is not None and version - self._armed_from >= every:
            self._armed_from = version  # one trigger per interval, even while the write is running
            self._due.set()

    def checkpoint_now(self) -> tuple[str, int]:
        """Writes a snapshot now (waiting for a write in progress) and returns (path, version).

        Raises OSError when the write fails; earlier snapshots stay intact.
        """
        info = self._write(force=True)
        assert info is not None
        return str(info.path), info.version

    def newest(self) -> tuple[str, int, float] | None:
        info = self._newest
        return None if info is None else (str(info.path), info.version, info.created_unix)

    def stop(self, final: bool) -> None:
        """Stops the periodic thread; with ``final``, writes one last snapshot (failure is logged)."""
        self._stop.set()
        self._due.set()
        self._thread.join(timeout=120)
        if final:
            try:
                path, version = self.checkpoint_now()
                logger.info("final snapshot at version %d: %s", version, path)
            except OSError as e:
                logger.error("final snapshot failed: %s", e)

    def adopt(self, info: SnapshotInfo) -> None:
        """Records the snapshot the server resumed from as the newest."""
        self._newest = info
        self._last_version = self._armed_from = info.version
        self._publish(info)

    # ---- internals -----------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._due.wait(timeout=self.config.every_seconds)
            self._due.clear()
            if self._stop.is_set():
                return
            try:
                self._write(force=False)
            except OSError:
                pass  # logged and counted in _write; the next trigger retries

    def _write(self, force: bool) -> SnapshotInfo | None:
        with self._write_lock:
            if not force and self.server.version == self._last_version:
                return None  # nothing new since the last snapshot
            if force and self._newest is not None and self._newest.version == self.server.version:
                return self._newest
            started = time.perf_counter()
            version, state = self.server.capture_state()
            # The ledger hears of the snapshot before the rename that commits it: a crash in between
            # may leave it committed, so a resume to it must find the ledger line already there.
            before_commit = None if self.ledger is None else (lambda: self.ledger.snapshot(version))
            try:
                info = write_snapshot(self.directory, version, state, self.meta, before_commit=before_commit)
            except OSError as e:
                self.metrics.checkpoint_failures.inc()
                logger.error(
                    "snapshot of version %d in %s failed: %s; training goes on, previous snapshots are intact, "
                    "the next trigger retries", version, self.directory, e,
                )
                raise
            self.metrics.checkpoint_seconds.observe(time.perf_counter() - started)
            self._newest = info
            self._last_version = version
            self._publish(info)
            logger.info("snapshot of version %d written to %s in %.2fs", version, info.path, time.perf_counter() - started)
            self._purge(info)
            return info

    def _publish(self, info: SnapshotInfo) -> None:
        self.metrics.checkpoint_bytes.set(info.size_bytes)
        self.metrics.checkpoint_last_success.set(info.created_unix)
        self.metrics.checkpoint_version.set(info.version)

    def _purge(self, newest: SnapshotInfo) -> None:
        """Deletes all but the newest ``keep`` snapshots; never the one just written; never raises."""
        others = [p for p in list_snapshots(self.directory) if p != newest.path]
        for path in others[self.config.keep - 1 :]:
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


class ResumeRefused(ValueError):
    """The chosen snapshot cannot be resumed into this server (different model or optimizer)."""


def shard_checkpoint_config(config: CheckpointConfig, shard_index: int, shard_count: int) -> CheckpointConfig:
    """Where shard ``shard_index`` of ``shard_count`` keeps its snapshots.

    One server writes into --checkpoint-dir itself; shards write into ``shard-K-of-S`` below it.
    A directory laid out for another shard count is refused: resuming S shards from snapshots of a
    different partition would silently start from scratch or mix parameters.
    """
    if config.directory is None:
        return config
    root = Path(config.directory)
    layouts = {p.name for p in root.glob("shard-*-of-*") if p.is_dir() and list_snapshots(p)}
    if list_snapshots(root):
        layouts.add("unsharded")
    mine = "unsharded" if shard_count == 1 else f"shard-{shard_index}-of-{shard_count}"
    others = sorted(name for name in layouts if not (name == mine or name.endswith(f"-of-{shard_count}")))
    if others and config.resume != "never":
        raise ResumeRefused(
            f"{root} holds snapshots of a different number of shards ({', '.join(others)}), but this server is {mine}; "
            "resume with the same --shards, or point --checkpoint-dir at an empty directory"
        )
    if shard_count == 1:
        return config
    return replace(config, directory=str(root / mine))


def find_resume_point(
    config: CheckpointConfig, signature: ModelSignature, optimizer: str, partition: str | None = None
) -> tuple[SnapshotInfo, dict[str, Any]] | None:
    """Picks the snapshot to resume from per ``config.resume``; None to start fresh.

    ``auto`` walks from the newest snapshot to older ones, skipping (and logging why) any that is
    incomplete, truncated or corrupt; skipped ones are renamed ``.invalid-*`` so later versions
    never sort behind them. Raises ResumeRefused for a snapshot of another model or optimizer.
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
        try:
            manifest, state = load_snapshot(path)
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
        info = SnapshotInfo(path, int(manifest["version"]), float(manifest["created_unix"]),
                            sum(f["size"] for f in manifest["files"].values()))
        return info, state
    logger.warning("no valid snapshot left in %s; starting fresh", config.directory)
    return None


def _check_compatible(path: Path, manifest: dict[str, Any], signature: ModelSignature, optimizer: str) -> None:
    theirs = ModelSignature.from_wire(manifest.get("signature", []))
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
