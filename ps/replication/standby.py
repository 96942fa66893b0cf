"""The standby's side of replication: copy a live primary, follow its log, take over when it fails.

- **Catch-up**: attach to the primary, fetch its state in pieces (four in flight), restore it, then
  say ready; the primary streams the log from the state's index on and adds this process to the
  view once it has caught up (``ps.replication.primary``).
- **Follow**: ``replica_append`` calls from the view's primary, in the current epoch, are put back in
  index order and acknowledged on receipt (the entry is in this process's memory: "the standby has
  it"); an applier thread applies them in order with the server's one apply function. At most
  ``MAX_UNAPPLIED`` entries may wait for it: beyond that an append waits (backpressure), so a
  starved standby cannot fall arbitrarily behind. Calls from anyone else, or of another epoch, are
  answered ``Fenced``: that is what stops a primary that was replaced.
- **Failover**: a long-poll on the primary (``replica_watch``) fails within tens of milliseconds of
  its process dying; nothing heard for ``replica_lease_s`` means it hangs or is cut off. Either way
  this process promotes itself: it stops acknowledging, moves the view ``{e, P, S} -> {e+1, S, -}``
  by compare-and-set, applies every entry it holds, removes P from the group, and serves. A
  connection error is trusted to mean the process exited (assumption A1, docs/FAULT_TOLERANCE.md)
  unless the primary's record names this host and its process still runs: then the lease is
  waited out as for a hang. With the coordinator down, the promotion waits for it to come back
  (``coordinator_wait_s``); back with an empty store, the view this standby followed is the one it
  moves on from.
- A standby that is not in the view (still catching up, or dropped) cannot promote; it detaches and
  its process restarts to attach again (or to take the shard over from snapshots if nobody serves it).
  It learns that the view names it from its primary's appends (each says so once the hand-over wrote
  the view, before any entry waits for this standby), not only from reading the view every
  ``_VIEW_CHECK_S``: a primary that died with the coordinator between the hand-over and that read
  left a standby holding every acknowledged entry that, finding the restarted store empty, could
  not tell it was the view's and detached (the shard then came back from an older snapshot).
"""

from __future__ import annotations

import io
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from torch.futures import Future

from ps.checkpoints.audit import AuditLog
from ps.config import ReplicationConfig
from ps.core.server import ParameterServer
from ps.core.update_log import ReorderBuffer, Sequenced
from ps.replication.auth import ReplicaGate, attach_proof
from ps.replication.metrics import ROLE_PRIMARY, ROLE_STANDBY, ReplicationMetrics
from rpcps import failpoints, replica_endpoints, transport
from rpcps.errors import ERROR_TYPES, RpcpsError, ServerStopping
from rpcps.jobsecret import JobSecret
from rpcps.logsafe import MESSAGE_LIMIT, peer_text
from rpcps.messages import Ack, Attached, ErrorReply, Fenced, LogEntry, View
from rpcps.transport import membership
from rpcps.transport.registry import Registry, StoreUnavailable, ViewReading, ViewRecord

logger = logging.getLogger(__name__)

MAX_UNAPPLIED = 16
_PIECES_IN_FLIGHT = 4
_VIEW_CHECK_S = 0.5
_STORE_RETRY_S = 0.05
"""A promotion waiting for the store asks again this often (a refused connect costs well under a millisecond)."""


class CatchUpFailed(RuntimeError):
    """The primary refused this process or went away while it copied the state (restart and claim again)."""


def _unwrap(value: object) -> object:
    if isinstance(value, ErrorReply):
        raise ERROR_TYPES.get(value.kind, RpcpsError)(value.message)
    return value


class Standby:
    def __init__(
        self,
        server: ParameterServer,
        registry: Registry,
        shard: int,
        name: str,
        config: ReplicationConfig,
        metrics: ReplicationMetrics,
        compatibility: dict[str, str],
        ledger: AuditLog | None,
        on_promoted: Callable[[ViewRecord, float], None],
        on_detached: Callable[[str], None],
        rpc_timeout_s: float,
        secret: JobSecret | None = None,
    ) -> None:
        """``secret``: the job's, which the primary demands to attach and the store's host before it
        drops a replaced primary."""
        self.server = server
        self.log = server.log
        self.registry = registry
        self.shard = shard
        self.name = name
        self.config = config
        self.metrics = metrics
        self.compatibility = compatibility
        self.ledger = ledger
        self._on_promoted = on_promoted
        self._on_detached = on_detached
        self.rpc_timeout_s = rpc_timeout_s
        self.secret = secret
        self.primary = ""
        self.epoch = 0
        self.attach_id: str | None = None
        """Issued by the primary on an authenticated attach; its appends must carry it."""
        self.gate = ReplicaGate(secret, name, metrics.refused)
        self.in_view = False
        """The shard's view names this process as the standby (it is in sync; commits wait for it)."""
        self._buffer = ReorderBuffer(0)
        self._receive = threading.Lock()
        """Orders receipt: reorder buffer and log appends (never held while applying)."""
        self._heard = time.monotonic()
        self._primary_pid: int | None = None
        self._leaving = threading.Event()
        """Set once this process stops following (promoting, detaching or shutting down): appends are
        refused from then on. Only the first of those moves happens (``_leave``)."""
        self._promoting = False
        """Set (under ``_leave_lock``) by the one ``_leave`` that promotes: only then is the primary fenced."""
        self._leave_lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._apply_loop, name="standby-applier", daemon=True),
            threading.Thread(target=self._monitor, name="standby-monitor", daemon=True),
        ]

    # ---- catch-up --------------------------------------------------------------------------------

    def catch_up(self, primary: str) -> None:
        """Copies ``primary``'s state and starts following its log (blocks until the state is restored)."""
        started = time.monotonic()
        server = self.server
        server.mirroring = True
        server.not_primary_reason = f"{self.name} is shard {self.shard}'s standby; read the shard's view for its primary"
        try:
            attached: Attached = _unwrap(transport.call(  # type: ignore[assignment]
                primary, replica_endpoints.replica_attach,
                (self.name, self.compatibility, *attach_proof(self.secret, self.name, primary)), self.rpc_timeout_s,
            ))
            state = self._fetch(primary, attached)
        except (transport.CallFailed, RpcpsError) as e:
            raise CatchUpFailed(f"could not copy shard {self.shard}'s state from {primary}: {e}") from e
        server.restore_state(state)
        self.primary, self.epoch, self.attach_id = primary, attached.epoch, attached.attach_id
        server.epoch = attached.epoch
        self._buffer = ReorderBuffer(attached.index)
        self._primary_pid = self._local_pid(primary)
        self._heard = time.monotonic()
        replica_endpoints.publish_replica(self)
        for thread in self._threads:
            thread.start()
        try:
            _unwrap(transport.call(primary, replica_endpoints.replica_ready, (attached.attach_id,), self.rpc_timeout_s))
            watch = transport.call_async(primary, replica_endpoints.replica_watch, (attached.attach_id,), timeout_s=0)
        except (transport.CallFailed, RpcpsError) as e:
            raise CatchUpFailed(f"{primary} went away while this process caught up: {e}") from e
        watch.on_done(self._watch_ended)
        logger.info(
            "copied shard %d's state from %s at version %d (%.1f MB in %.2fs); following its log", self.shard, peer_text(primary),
            attached.version, attached.size_bytes / 1e6, time.monotonic() - started,
        )

    def _fetch(self, primary: str, attached: Attached) -> dict:
        pieces: list[torch.Tensor | None] = [None] * attached.pieces
        for first in range(0, attached.pieces, _PIECES_IN_FLIGHT):
            batch = range(first, min(first + _PIECES_IN_FLIGHT, attached.pieces))
            calls = [transport.call_async(primary, replica_endpoints.replica_snapshot, (attached.attach_id, k), self.rpc_timeout_s)
                     for k in batch]
            for k, pending in zip(batch, calls):
                pieces[k] = cast(torch.Tensor, _unwrap(pending.wait()))  # a replica_snapshot piece
        data = torch.cat([p for p in pieces if p is not None]).numpy().tobytes()
        if len(data) != attached.size_bytes:
            raise CatchUpFailed(f"the state from {primary} came to {len(data)} bytes, not {attached.size_bytes}")
        return torch.load(io.BytesIO(data), weights_only=True)

    def _local_pid(self, primary: str) -> int | None:
        """The primary's pid when its record names this host (a crash is then checked, not assumed)."""
        try:
            record = self.registry.replica(primary)
        except StoreUnavailable:
            return None
        if record is None or record.get("host") != socket.gethostname():
            return None
        return int(record["pid"])

    # ---- following -------------------------------------------------------------------------------

    def append(self, attach_id: str, epoch: int, sender: str, entries: list[LogEntry], sent_at: float, in_view: bool) -> Ack | Fenced | ErrorReply:
        """``in_view``: the sender's view names this standby (its acknowledgements now commit entries)."""
        del sent_at
        self.gate.check_attach_id(self.attach_id, attach_id, f"append from '{peer_text(sender)}'")  # before any state is told
        if self._leaving.is_set():
            if self._promoting:  # taking over: the old primary must apply nothing more
                return Fenced(self.epoch + 1, None)
            # Shutting down or restarting to claim again: the primary drops this standby and goes on
            # (a Fenced here would depose a healthy primary whenever its standby is stopped).
            return ErrorReply(ServerStopping.__name__, f"standby {self.name} stopped following; drop it")
        if epoch != self.epoch or sender != self.primary:
            return Fenced(self.epoch, None)
        if in_view and not self.in_view:
            self._named_in_view()
        log = self.log
        with self._receive:
            for entry in self._buffer.add(entries):
                log.append(Sequenced(entry))
            have = self._buffer.have_through
            self._heard = time.monotonic()
        deadline = time.monotonic() + self.config.standby_timeout_s / 2
        with log.cond:  # backpressure: hold the acknowledgement while the applier is far behind
            while log.last_index - log.applied_index > MAX_UNAPPLIED and time.monotonic() < deadline and not self._leaving.is_set():
                log.cond.wait(0.01)
        if entries and self.in_view:  # only acknowledgements the primary's commits (or async lag) wait for
            failpoints.hit("replication.standby_before_ack")
        return Ack(epoch, have, log.applied_index)

    def attach(self, name: str, compatibility: dict[str, str], nonce: str, issued_at: float, mac: str) -> Attached:
        del compatibility, nonce, issued_at, mac
        raise RpcpsError(f"{self.name} is a standby of {self.primary}; {name} must attach to the primary")

    def snapshot_piece(self, attach_id: str, piece: int) -> torch.Tensor:
        raise RpcpsError(f"{self.name} is a standby; no attach {attach_id} piece {piece} here")

    def ready(self, attach_id: str) -> None:
        raise RpcpsError(f"{self.name} is a standby; no attach {attach_id} here")

    def watch(self, attach_id: str) -> Future:
        raise RpcpsError(f"{self.name} is a standby; no attach {attach_id} here")

    def _apply_loop(self) -> None:
        """Applies what arrived, in order; ends once this process stopped following and applied it all,
        or serves: what a promoted process sequences is its primary's to apply, because only that
        loop answers the callers (here entries have none, so what this loop applies it answers to
        nobody: a push sequenced before the new primary held its lease lost its reply, CI)."""
        log, server = self.log, self.server
        while True:
            with log.cond:
                while log.applied_index >= log.last_index:
                    if self._leaving.is_set():
                        log.cond.notify_all()
                        return
                    log.cond.wait(0.1)
            with server.lock:
                if not server.mirroring:  # promoted (set after the drain applied every received entry)
                    return
                server.apply_committed_locked()
            with log.cond:
                log.cond.notify_all()

    def lag(self) -> tuple[float, float]:
        """(entries received and not applied, age of the oldest of them in seconds)."""
        waiting = self.log.unapplied()
        return float(len(waiting)), (time.monotonic() - waiting[0].at) if waiting else 0.0

    # ---- noticing a failure, promoting -----------------------------------------------------------

    def _watch_ended(self, pending: transport.Pending) -> None:
        try:
            pending.wait()
        except transport.CallFailed as e:
            if self._leaving.is_set():
                return
            if self._primary_pid is not None and _running(self._primary_pid):
                logger.warning("lost the connection to primary %s, whose process still runs: waiting out its lease", peer_text(self.primary))
                return
            why = f"its process is gone ({e})"
        else:
            why = "it stopped serving (shut down gracefully)"  # a planned hand-over: it applies nothing more
        threading.Thread(target=self._promote, args=(why,), name="promote", daemon=True).start()

    def _monitor(self) -> None:
        last_view = 0.0
        while not self._leaving.is_set():
            time.sleep(self.config.replica_heartbeat_s / 2)
            silent = time.monotonic() - self._heard
            if silent > self.config.replica_lease_s:
                self._promote(f"nothing heard from it for {silent:.2f}s")
                return
            if self._primary_pid is not None and not _running(self._primary_pid):
                self._promote(f"its process {self._primary_pid} exited")
                return
            if time.monotonic() - last_view > _VIEW_CHECK_S:
                last_view = time.monotonic()
                self._check_view()

    def _check_view(self) -> None:
        try:
            record = self.registry.view(self.shard)
        except StoreUnavailable:
            return
        if record is None:
            return
        view = record.view
        if view.standby == self.name and view.primary == self.primary:
            self._named_in_view()
        elif view.epoch != self.epoch or view.primary != self.primary or self.in_view:
            # A new epoch or primary, or the same primary that dropped this standby from its view (it
            # sends no more entries): following on would promote from a state that misses updates.
            self._detach(f"the shard's view moved on without this standby ({view})")

    def _named_in_view(self) -> None:
        self.in_view = True
        self.metrics.role.set(ROLE_STANDBY)

    def _leave(self, promoting: bool = False) -> bool:
        """Stops following; True for the one caller that did it (the monitor, the watch callback and a
        shutdown may race: exactly one of promote, detach and stop may act)."""
        with self._leave_lock:
            if self._leaving.is_set():
                return False
            self._promoting = promoting
            self._leaving.set()
            return True

    def stop(self) -> None:
        """This process is shutting down: it neither promotes nor restarts from now on."""
        self._leave()

    def _promote(self, why: str) -> None:
        if not self._leave(promoting=True):
            return
        # A worker may read the new view and call here before this process serves (the drain below
        # comes after the compare-and-set): its call waits for the outcome instead of being refused.
        promotion = threading.Event()
        self.server.promotion = promotion
        try:
            self._take_over(why, promotion)
        finally:
            promotion.set()  # gave up: the callers waiting are told to look again

    def _take_over(self, why: str, promotion: threading.Event) -> None:
        noticed = time.monotonic()
        old = self.primary
        logger.warning("primary %s of shard %d failed: %s; promoting this standby", peer_text(old), self.shard, peer_text(why, MESSAGE_LIMIT))
        try:
            reading = self._read_view_when_store_answers()
            failpoints.hit("replication.standby_before_promote")
            record = reading.record
            if record is None and not reading.raw and self.in_view:
                # The coordinator restarted empty and the primary died before it wrote its view back:
                # the view this standby followed ({e, P, S}, it was in it) is the shard's last one.
                new = self.registry.change_view(self.shard, reading, View(self.epoch + 1, self.name))
            elif record is None or record.view.standby != self.name or record.view.primary != old:
                self._detach(f"it is not the view's standby ({record.view if record else 'no view'}), so it cannot promote", left=True)
                return
            else:
                new = self.registry.change_view(self.shard, record, View(record.view.epoch + 1, self.name))
        except StoreUnavailable as e:
            self._detach(f"the store did not answer the promotion ({e})", left=True)
            return
        if new is None:
            self._detach("the view changed first (the primary dropped this standby)", left=True)
            return
        self._drain()
        server = self.server
        with server.lock:
            server.mirroring = False
            server.epoch = new.view.epoch
        if self.ledger is not None:
            self.ledger.promoted(new.view.epoch, server.version)
            self.ledger.view(new.view)
        self.metrics.failovers.inc()
        self.metrics.role.set(ROLE_PRIMARY)
        took = time.monotonic() - noticed
        self.metrics.failover_seconds.set(took)
        logger.warning(
            "promoted to shard %d's primary, epoch %d, at version %d (%.0f ms after noticing)", self.shard, new.view.epoch,
            server.version, 1000 * took,
        )
        self._on_promoted(new, took)
        promotion.set()
        # Serving first: removing the old primary from the group takes the group token and a few
        # store writes (etcd transactions when the store is in etcd), which the workers need not wait for.
        _forget(old, self.secret)

    def _read_view_when_store_answers(self) -> ViewReading:
        """The shard's view, waiting up to ``coordinator_wait_s`` for a store that does not answer (its
        coordinator is down: the promotion needs its compare-and-set, and a supervised coordinator
        comes back); raises StoreUnavailable after that."""
        deadline = time.monotonic() + self.config.coordinator_wait_s
        waiting = False
        while True:
            try:
                return self.registry.read_view(self.shard)
            except StoreUnavailable as e:
                if time.monotonic() >= deadline:
                    raise
                if not waiting:
                    waiting = True
                    logger.warning("the group's store does not answer (%s); promoting once it is back (waiting up to %.0fs)",
                                   e, self.config.coordinator_wait_s)
                time.sleep(_STORE_RETRY_S)

    def _drain(self) -> None:
        """Applies every entry received from the old primary (they become part of the new history)."""
        log = self.log
        with log.cond:
            while log.applied_index < log.last_index:
                log.cond.wait(0.01)

    def _detach(self, why: str, left: bool = False) -> None:
        """Stops following and asks for a restart (``left``: the caller already stopped following)."""
        if not left and not self._leave():
            return
        logger.warning(
            "standby %s stops following %s: %s; restarting to claim the shard again", self.name, peer_text(self.primary), peer_text(why, MESSAGE_LIMIT)
        )
        self._on_detached(why)


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a killed process is a zombie until reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _forget(name: str, secret: JobSecret | None) -> None:
    """Removes the replaced primary from the group, so a new standby can join at once (best effort:
    the janitor removes it too, within a second or its lease).

    The store's host is asked to do it (with the job secret's proof), so its own agent forgets the
    member too: changed behind its back, its store guard would take the shorter member list for a
    stranger's tampering and put the dead primary back.
    """
    try:
        store_host = transport.store_host()
    except RuntimeError as e:  # the store this agent joined through is gone (a restarted coordinator's holds no member list)
        logger.debug("could not remove %s from the group: %s", name, str(e).splitlines()[0] if str(e) else e)
        return
    if store_host != membership.my_name() and transport.leave(name, store_host, secret, timeout_s=1.0):
        return
    for _ in range(20):
        try:
            membership.forget_member(name)
            return
        except membership.TokenBusy:
            time.sleep(0.01)
        except RuntimeError as e:
            logger.debug("could not remove %s from the group: %s", name, e)
            return
