"""The primary's side of replication: taking a standby in, shipping it the log, committing, its lease.

- **Attach** (a standby asks to follow): the applied state is copied under the server's lock (the
  sparse tables in slices before it, closed under it: ``ps.sparse.store.FullTables``), serialised,
  and handed out in pieces of at most 16 MB (``replica_snapshot``); every entry after it is kept for
  the standby until it acknowledges it.
- **Ship**: one sender thread sends ``replica_append`` calls in index order, up to
  ``_MAX_IN_FLIGHT`` at a time (the transfer of entry i+1 overlaps the apply of entry i), and an
  empty one (a heartbeat) after ``replica_heartbeat_s`` of silence. A call that times out makes it
  send again from the first entry not acknowledged (the standby drops repeats).
- **Hand-over**: once a catching-up standby is within a couple of entries, the primary holds its
  lock (no push is sequenced or applied), waits for the standby to acknowledge the last entry
  (tens of ms), and adds it to the view: ``{e, P, -} -> {e, P, S}``. From then on an entry commits
  only once the standby holds it; in asynchronous replication, once the standby holds the entry
  ``max_replica_lag`` before it (``ReplicationLog.commit_index``): pushes are answered before the
  standby has them, and wait only while it is that far behind.
- **Drop**: a standby whose connection fails, or that leaves waiting entries unacknowledged for
  ``standby_timeout_s``, is removed from the view (``{e, P, S} -> {e, P, -}``); entries then commit
  at once again. If that compare-and-set fails, the standby promoted itself: this primary steps down.
- **Lease**: the primary applies (and answers) only while it holds one. With a standby in the view
  it lasts ``replica_lease_s - 0.2 s`` from the *send* time of the newest acknowledged append (the
  standby promotes only after ``replica_lease_s`` without acknowledging one, counted from its
  acknowledgement, which comes later); alone, ``store_lease_s - 1 s`` from the last read of an
  unchanged view and, with the store in etcd, only while it holds its claim on the shard under an
  etcd lease of ``store_lease_s`` (``rpcps.transport.group.shard_claim``: taken when it starts
  serving, only while the view is its own; another server takes a shard over only once that
  claim is gone, ``ps.replication.claim``). A claim lost while it serves alone steps it down.
  A primary that learns of a newer epoch (a ``Fenced`` answer, a failed compare-and-set, a
  newer view) steps down: it applies nothing more and restarts itself (from a
  snapshot of its exact state when no standby was in its view: ``ps.runner``).
- **A tampered view**: the keeper reads the view every heartbeat. Anything there that does not
  replace this primary's view (deleted, unsigned or wrongly signed, a replay of an older one:
  ``rpcps.transport.registry``) is neither followed nor a reason to step down: the primary puts
  its own view back by compare-and-set (``rpcps_server_store_repairs_total{what="view"}``).
"""

from __future__ import annotations

import io
import logging
import math
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.futures import Future

from ps.checkpoints.audit import AuditLog
from ps.config import ReplicationConfig
from ps.core.server import ParameterServer
from ps.core.update_log import ReplicationLog, Sequenced, UpdateApplied
from ps.replication.auth import ReplicaGate, new_attach_id
from ps.replication.metrics import ReplicationMetrics
from ps.sparse.store import payloads
from rpcps import failpoints, replica_endpoints, transport
from rpcps.errors import AttachRefused, ServerStopping
from rpcps.jobsecret import JobSecret
from rpcps.logsafe import peer_text
from rpcps.messages import Ack, Attached, ErrorReply, Fenced, LogEntry, View
from rpcps.transport.registry import Registry, StoreUnavailable, ViewReading, ViewRecord

logger = logging.getLogger(__name__)

PIECE_BYTES = 16 * 1024 * 1024
"""Snapshot pieces: at most 16 MB each (larger tensors are bound by allocation on receipt; facts file)."""
_MAX_IN_FLIGHT = 4
_APPEND_MAX_BYTES = 24 * 1024 * 1024
"""Consecutive entries are batched into one append up to about this size (one large update alone)."""
_LEASE_MARGIN_S = 0.2
_STORE_LEASE_MARGIN_S = 1.0
_HANDOVER_WITHIN = 2
"""A catching-up standby this many entries behind (or closer) is handed over."""
_HANDOVER_WAIT_S = 1.0


class _HeldUpdates:
    """Says so when committed updates wait for the lease for longer than a keeper round should take:
    why (``reason()``), and where the keeper, the thread that renews it, is at that moment. Without
    it a primary whose lease lapsed looked merely idle: its workers' pushes went unanswered until
    their RPC timeout (CI saw a 28 s stall after an etcd leader's death, with nothing in any log)."""

    REPORT_AFTER_S = 3.0

    def __init__(self, shard: int, reason: Callable[[], str], keeper: threading.Thread) -> None:
        self._shard = shard
        self._reason = reason
        self._keeper = keeper
        self._since: float | None = None
        self._reported = False

    def holding(self, waiting: int) -> None:
        now = time.monotonic()
        if self._since is None:
            self._since = now
        elif not self._reported and now - self._since >= self.REPORT_AFTER_S:
            self._reported = True
            logger.warning(
                "shard %d: %d committed update(s) wait for %.1fs: %s; the keeper is at: %s", self._shard, waiting,
                now - self._since, self._reason() or "(the lease came back just now)", _where(self._keeper),
            )

    def released(self) -> None:
        if self._reported and self._since is not None:
            logger.warning("shard %d: applying again after %.1fs without a lease", self._shard, time.monotonic() - self._since)
        self._since, self._reported = None, False


def _where(thread: threading.Thread) -> str:
    """The innermost frames of ``thread``'s stack, on one line."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return "(not running)"
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(traceback.extract_stack(frame)[-6:]))


@dataclass
class _Follower:
    name: str
    attach_id: str
    index: int
    """The log index of the state it copies; it receives entries from index + 1."""
    pieces: list[torch.Tensor] | None
    started: float = field(default_factory=time.monotonic)
    ready: bool = False
    in_sync: bool = False
    acked: int = 0
    next_to_send: int = 0
    in_flight: int = 0
    last_send: float = 0.0
    newest_acked_send: float = 0.0
    """Monotonic send time of the newest append it acknowledged: the lease counts from here."""
    failed: str | None = None
    """Why it must be dropped (its connection failed), once set."""


class Primary:
    """Runs the primary's replication for one shard (see the module docstring). Thread-safe."""

    def __init__(
        self,
        server: ParameterServer,
        registry: Registry,
        shard: int,
        name: str,
        record: ViewRecord,
        config: ReplicationConfig,
        metrics: ReplicationMetrics,
        compatibility: dict[str, str],
        ledger: AuditLog | None,
        on_step_down: Callable[[str], None],
        secret: JobSecret | None = None,
    ) -> None:
        """``secret``: the job's; a standby must prove it to attach (``ps.replication.auth``)."""
        self.server = server
        self.log: ReplicationLog = server.log
        self.registry = registry
        self.shard = shard
        self.name = name
        self.record = record
        self.config = config
        self.metrics = metrics
        self.compatibility = compatibility
        self.ledger = ledger
        self._on_step_down = on_step_down
        self.gate = ReplicaGate(secret, name, metrics.refused)
        self._lock = threading.Lock()
        """Guards the follower and the view record (never held across a call)."""
        self._follower: _Follower | None = None
        self._view_read_at = time.monotonic()
        self._last_restored: str | None = None
        """The stored text this primary last put its view back over (logged once per text)."""
        self._incarnation: str | None = None
        """The store's incarnation this primary last read its own view in ('' in a store a server hosts)."""
        self._lease_revoked = False
        """A pipe error towards the in-sync standby: no apply until a compare-and-set settles who serves."""
        self._claim = transport.shard_claim(shard, name, math.ceil(config.store_lease_s), lambda: self.record.revision)
        """Its claim on the shard under an etcd lease (None: the store is not in etcd)."""
        self._stopped = threading.Event()
        self._watchers: list[Future] = []
        self._threads = [
            threading.Thread(target=self._keep, name="replica-keeper", daemon=True),
            threading.Thread(target=self._send_loop, name="replica-sender", daemon=True),
            threading.Thread(target=self._apply_loop, name="replica-applier", daemon=True),
        ]
        server.epoch = record.view.epoch
        server.lease = self.lease
        self.log.max_lag = config.allowed_lag

    def start(self) -> None:
        with self.log.cond:
            self.log.unwatched = self._follower is None
        self.server.on_applied(self._at_max_lag)
        if self._claim is not None:
            self._claim.start()
        replica_endpoints.publish_replica(self)
        for thread in self._threads:
            thread.start()
        metrics = self.metrics
        metrics.role.set(2)
        metrics.epoch.set(self.record.view.epoch)

    def stop(self) -> None:
        """A graceful stop (the server stopped taking pushes): applies nothing more, and tells a
        following standby, which takes over (a planned failover: it holds every committed entry)."""
        self._flush()
        self.server.deposed = True
        self._stopped.set()
        self._end_claim()
        with self.log.cond:
            self.log.cond.notify_all()
        for future in self._watchers:
            if not future.done():
                future.set_result("stopping")
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout=5)

    def _flush(self) -> None:
        """Waits (at most ``standby_timeout_s``) until the in-sync standby holds every entry applied
        here: in asynchronous replication some may still be on their way, and a planned hand-over
        must not lose them."""
        follower, log = self._follower, self.log
        if follower is None or not follower.in_sync:
            return
        deadline = time.monotonic() + self.config.standby_timeout_s
        with log.cond:
            while follower.acked < log.applied_index and follower.failed is None and time.monotonic() < deadline:
                log.cond.wait(0.01)

    def lag(self) -> tuple[float, float]:
        """(entries sequenced and not acknowledged by the standby, age of the oldest of them in seconds)."""
        follower = self._follower
        if follower is None or not follower.ready:
            return 0.0, 0.0
        return float(max(self.log.last_index - follower.acked, 0)), self.log.oldest_unacked_age(follower.acked, time.monotonic())

    def _at_max_lag(self, event: UpdateApplied) -> None:
        """An ``on_applied`` listener: where a fault run kills an asynchronous primary at its worst
        moment, applying the entry that puts it ``max_lag`` ahead of its standby."""
        del event
        if 0 < self.log.max_lag <= self.log.unreplicated + 1:
            failpoints.hit("replication.at_max_lag")

    # ---- the lease ------------------------------------------------------------------------------

    def lease(self) -> float | None:
        """Asked before every apply: the unix time of the decision, or None when not allowed now."""
        return None if self._without_lease() else time.time()

    def _without_lease(self) -> str:
        """Why this primary may not apply now ('' when it may)."""
        if self.server.deposed or self._stopped.is_set():
            return "it no longer serves the shard"
        now = time.monotonic()
        follower = self._follower
        if follower is not None and follower.in_sync:
            if self._lease_revoked:
                return f"the link to its standby {follower.name} failed; the view must settle who serves"
            if now >= follower.newest_acked_send + self.config.replica_lease_s - _LEASE_MARGIN_S:
                return f"its standby {follower.name} acknowledged nothing sent in the last {self.config.replica_lease_s:g}s"
            return ""
        if now >= self._view_read_at + self.config.store_lease_s - _STORE_LEASE_MARGIN_S:
            return f"it last read its own view in the group's store {now - self._view_read_at:.1f}s ago"
        if self._claim is not None and not self._claim.held():
            return "etcd has not confirmed its claim on the shard within the claim's lease"
        return ""

    # ---- the replication API (called by the standby over RPC) ------------------------------------

    def attach(self, name: str, compatibility: dict[str, str], nonce: str, issued_at: float, mac: str) -> Attached:
        self.gate.check_attach(name, nonce, issued_at, mac)  # before anything about this process is told
        difference = _first_difference(self.compatibility, compatibility)
        if difference is not None:
            raise AttachRefused(f"{name} cannot be this primary's standby: {difference}; run both with the same settings")
        with self._lock:
            current = self._follower
            if current is not None and current.name != name and current.failed is None:
                raise AttachRefused(f"shard {self.shard} already has a standby ({current.name})")
        server = self.server
        # Sparse tables are copied in slices under their own locks first, training going on; the
        # closing step under the server's lock makes them the tables of the dense state's instant.
        tables = server.sparse.begin_full() if server.sparse is not None else None
        try:
            if tables is not None:
                tables.copy_slices()
            with server.lock:
                if server.deposed:
                    raise AttachRefused("this process is no longer the shard's primary")
                state = server.capture_replica_state_locked(include_sparse=tables is None)
                closed = tables.close() if tables is not None else None
                index = self.log.applied_index
                with self.log.cond:
                    self.log.retain_from = index + 1
                    self.log.unwatched = False  # the sender streams every entry from now on
        finally:
            if tables is not None:
                tables.abort()
        if closed is not None:
            state["sparse"] = payloads(closed)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
        pieces = list(torch.split(data, PIECE_BYTES))
        follower = _Follower(name, new_attach_id(), index, pieces, acked=index, next_to_send=index + 1)
        with self._lock:
            self._follower = follower
        logger.info(
            "%s attached as standby: copying %.1f MB of state at version %d (log index %d) in %d pieces", peer_text(name),
            data.numel() / 1e6, state["version"], index, len(pieces),
        )
        return Attached(follower.attach_id, self.record.view.epoch, index, int(state["version"]), data.numel(), len(pieces))

    def snapshot_piece(self, attach_id: str, piece: int) -> torch.Tensor:
        follower = self._attached(attach_id, f"snapshot piece {peer_text(piece)}")
        if follower.pieces is None or not 0 <= piece < len(follower.pieces):
            raise AttachRefused(f"no piece {piece} of the state for {follower.name}")
        return follower.pieces[piece].clone()  # a view would send the whole buffer

    def ready(self, attach_id: str) -> None:
        follower = self._attached(attach_id, "ready")
        follower.pieces = None
        follower.ready = True
        self.metrics.catchup_seconds.set(time.monotonic() - follower.started)
        with self.log.cond:
            self.log.cond.notify_all()
        logger.info("%s restored the state; streaming the log from index %d", peer_text(follower.name), follower.index + 1)

    def append(self, attach_id: str, epoch: int, sender: str, entries: list[LogEntry], sent_at: float, in_view: bool) -> Fenced:
        """Only a replaced primary sends here; the answer tells it so (nothing here changes)."""
        del attach_id, entries, sent_at, in_view
        logger.warning(  # anyone may call this: sender and epoch are whatever the caller sent
            "%s (epoch %s) sent log entries to this primary (epoch %d): it was replaced", peer_text(sender), peer_text(epoch),
            self.record.view.epoch,
        )
        return Fenced(self.record.view.epoch, self.name)

    def watch(self, attach_id: str) -> Future:
        self._attached(attach_id, "watch")
        future: Future = Future()
        self._watchers.append(future)
        return future

    def _attached(self, attach_id: str, what: str) -> _Follower:
        """The follower ``attach_id`` was issued to; raises ReplicaRefused (logged, counted) for any other."""
        follower = self._follower
        self.gate.check_attach_id(follower.attach_id if follower is not None else None, attach_id, what)
        assert follower is not None  # check_attach_id refuses when none was issued
        return follower

    # ---- shipping --------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        beat = self.config.replica_heartbeat_s
        while not self._stopped.is_set():
            follower = self._follower
            with self.log.cond:
                if follower is None or not follower.ready or follower.failed is not None:
                    self.log.cond.wait(beat)
                    continue
                have_more = follower.next_to_send <= self.log.last_index
                if follower.in_flight >= _MAX_IN_FLIGHT or (not have_more and time.monotonic() - follower.last_send < beat):
                    self.log.cond.wait(beat / 2)
                    continue
            try:
                batch = self.log.entries_from(follower.next_to_send, _APPEND_MAX_BYTES) if have_more else []
            except LookupError as e:
                self._fail(follower, f"it fell behind what this primary keeps ({e})")
                continue
            self._send(follower, batch)

    def _send(self, follower: _Follower, batch: list[Sequenced]) -> None:
        sent_at = time.monotonic()
        entries = [s.entry for s in batch]
        with self.log.cond:
            follower.in_flight += 1
            follower.last_send = sent_at
            if batch:
                follower.next_to_send = batch[-1].index + 1
        self.metrics.sent_bytes.inc(sum(s.nbytes for s in batch))
        try:
            pending = transport.call_async(
                follower.name, replica_endpoints.replica_append,
                # in_sync: the view names it (the hand-over wrote it before any entry that waits for its ack).
                (follower.attach_id, self.record.view.epoch, self.name, entries, sent_at, follower.in_sync),
                timeout_s=max(5.0, 4 * self.config.standby_timeout_s),
            )
        except transport.CallFailed as e:
            self._on_reply(follower, sent_at, None, e)
            return
        pending.on_done(lambda done: self._settle(follower, sent_at, done))

    def _settle(self, follower: _Follower, sent_at: float, pending: transport.Pending) -> None:
        try:
            reply = pending.wait()
        except Exception as e:  # noqa: BLE001 - every failure is handled below
            self._on_reply(follower, sent_at, None, e)
            return
        self._on_reply(follower, sent_at, reply, None)

    def _on_reply(self, follower: _Follower, sent_at: float, reply: object, error: BaseException | None) -> None:
        with self.log.cond:
            follower.in_flight -= 1
            self.log.cond.notify_all()
        if isinstance(reply, Fenced):
            self._step_down(f"{follower.name} serves epoch {reply.epoch} (primary {reply.primary})")
            return
        if isinstance(reply, Ack):
            with self.log.cond:
                follower.acked = max(follower.acked, reply.have_through)
                follower.newest_acked_send = max(follower.newest_acked_send, sent_at)
            self.log.acknowledged(reply.have_through, retain=follower.in_sync)
            return
        if isinstance(reply, ErrorReply) and reply.kind == ServerStopping.__name__:
            self._fail(follower, f"it stopped following ({reply.message})")
            return
        if isinstance(error, transport.PeerTimeout) or isinstance(reply, ErrorReply):
            with self.log.cond:  # send again from the first entry it has not acknowledged
                follower.next_to_send = min(follower.next_to_send, follower.acked + 1)
            return
        self._fail(follower, f"its connection failed ({error or reply})")

    def _fail(self, follower: _Follower, why: str) -> None:
        if follower.failed is None:
            follower.failed = why
            if follower.in_sync:
                self._lease_revoked = True  # it may be promoting: apply nothing until the view says who serves
            logger.warning("standby %s: %s", peer_text(follower.name), why)
        with self.log.cond:
            self.log.cond.notify_all()

    # ---- applying --------------------------------------------------------------------------------

    def _apply_loop(self) -> None:
        log = self.log
        held = _HeldUpdates(self.shard, self._without_lease, self._threads[0])
        while not self._stopped.is_set():
            with log.cond:
                idle = log.applied_index >= log.commit_index
                if idle:
                    log.cond.wait(0.05)
            if idle:
                held.released()
                continue
            with self.server.lock:
                done = self.server.apply_committed_locked()
                # Without a standby the thread that sequenced an entry applies it: one may have
                # done so since this loop looked, which is no hold.
                waiting = log.commit_index - log.applied_index
            if done or not waiting:
                held.released()
                if done:
                    self.answer(done)
            else:
                held.holding(waiting)
                self._stopped.wait(0.01)  # committed but not allowed (no lease): the keeper settles it

    def answer(self, done: list[tuple[Future, object]]) -> None:
        """Completes applied entries' futures, unless the lease ran out meanwhile (then the workers are
        told to ask the shard's primary again; a resent push is answered 'duplicate' there)."""
        refused = ErrorReply("NotPrimary", f"{self.name} lost its lease; read shard {self.shard}'s view again")
        ok = self.lease() is not None
        for future, value in done:
            future.set_result(value if ok else refused)

    # ---- the keeper: hand-over, drops, the view, the store lease ---------------------------------

    def _keep(self) -> None:
        every = self.config.replica_heartbeat_s
        while not self._stopped.wait(every):
            try:
                self._keep_once()
            except StoreUnavailable as e:
                logger.warning("shard %d's view: %s", self.shard, e)
            except Exception:  # the keeper must outlive one bad round
                logger.exception("replication keeper failed; trying again")

    def _keep_once(self) -> None:
        follower = self._follower
        if self._claim is not None and self._claim.ended and (follower is None or not follower.in_sync):
            self._step_down(f"its claim's etcd lease ended (frozen or cut off from etcd for over {self._claim.ttl_s}s), "
                            "so another server may serve the shard")
            return
        if follower is not None:
            if follower.failed is not None:
                self._drop(follower)
                return
            if follower.in_sync:
                age = self.log.oldest_unacked_age(follower.acked, time.monotonic())
                if age > self.config.standby_timeout_s:
                    self._fail(follower, f"it left entries unacknowledged for {age:.2f}s")
                    self._drop(follower)
                    return
                self._read_view()  # its lease counts from the standby's acks; this puts a tampered view back
                return
            if follower.ready and follower.acked >= self.log.last_index - _HANDOVER_WITHIN:
                self._hand_over(follower)
                return
        self._read_view()

    def _read_view(self) -> None:
        """Renews the store lease on reading this primary's own view; steps down for a view that
        replaces it; puts its own back over anything else (``_restore``)."""
        reading = self.registry.read_view(self.shard)
        record, mine = reading.record, self.record
        if record is not None and record.raw == mine.raw:
            # Its own text, perhaps written again since (a repair): its next change compares this revision.
            self.record = record
            self._view_read_at = time.monotonic()
            if self._incarnation is None:
                self._incarnation = self.registry.incarnation()
            return
        if record is not None and (record.view.epoch > mine.view.epoch or record.view.primary != self.name):
            self._step_down(f"the view is now {record.view}")
            return
        self._restore(reading)

    def _restore(self, reading: ViewReading) -> None:
        """Puts this primary's view back over a stored text that does not replace it: nothing (deleted),
        a record the registry refused (unsigned, wrongly signed, or a replay of an older epoch), or an
        earlier view of its own epoch (a replay: within an epoch only this primary changes the view,
        and any other replica's view has a newer epoch). The lease is not renewed by it: only by
        reading its own view back, so a primary cut off from the store still stops in time."""
        if reading.refused is not None:
            found = f"a record it refused ({reading.refused.replace('_', ' ')})"
        elif reading.record is not None:
            found = f"an earlier view of its own epoch ({reading.record.view})"
        else:
            found = "nothing (the key was deleted)"
        restored = self.registry.restore_view(self.shard, reading, self.record)
        if restored is None:
            return  # changed again meanwhile: the next round reads it
        self.record = restored
        if not reading.raw and self._store_restarted():
            logger.warning("shard %d's view: the group's coordinator restarted empty; wrote this primary's view (%s) back",
                           self.shard, self.record.view)
            return
        self.server.metrics.store_repairs.labels("view").inc()
        if reading.raw != self._last_restored:
            self._last_restored = reading.raw
            logger.error(
                "shard %d's view in the group's store was replaced by %s: put this primary's view (%s) back; someone "
                "outside this job writes to the store (docs/SECURITY.md)", self.shard, found, self.record.view,
            )

    def _store_restarted(self) -> bool:
        """Whether the store's incarnation changed since this primary last looked: a new coordinator
        serves an empty store, so an empty view key is no stranger's doing (``rpcps.transport.rebuild``)."""
        now = self.registry.incarnation()
        before, self._incarnation = self._incarnation, now
        return bool(now) and before is not None and before != now

    def _hand_over(self, follower: _Follower) -> None:
        """Adds a caught-up standby to the view, holding the server's lock for the final few entries."""
        started = time.monotonic()
        server, log = self.server, self.log
        with server.lock:
            with log.cond:
                deadline = started + _HANDOVER_WAIT_S
                while follower.acked < log.last_index and follower.failed is None and time.monotonic() < deadline:
                    log.cond.wait(0.01)
                caught_up = follower.acked >= log.last_index and follower.failed is None
            if not caught_up:
                return
            record = self._change_view(self.record, View(self.record.view.epoch, self.name, follower.name))
            if record is None:
                return
            with log.cond:
                follower.in_sync = True
                log.acked_index = follower.acked
                log.cond.notify_all()
        pause = time.monotonic() - started
        self.metrics.handover_pause_seconds.set(pause)
        self.metrics.standby_in_sync.set(1)
        logger.info("standby %s is in sync (hand-over paused sequencing for %.0f ms); pushes now wait for it", follower.name, 1000 * pause)

    def _drop(self, follower: _Follower) -> None:
        """Forgets a failed standby; one in the view is removed from it first (then commits flow again)."""
        if follower.in_sync:
            record = self._change_view(self.record, View(self.record.view.epoch, self.name))
            if record is None:
                return
            self.metrics.standby_drops.inc()
            self.metrics.standby_in_sync.set(0)
        with self._lock:
            if self._follower is follower:
                self._follower = None
        with self.log.cond:
            self.log.acked_index = None
            self.log.retain_from = None
            self._lease_revoked = False
            self._view_read_at = time.monotonic()
            self.log.cond.notify_all()
        logger.warning("dropped standby %s (%s); shard %d goes on alone", peer_text(follower.name), follower.failed, self.shard)

    def _change_view(self, expected: ViewRecord, new: View) -> ViewRecord | None:
        """Compare-and-set of the shard's view; a failure caused by a newer epoch steps this primary down.

        A failure caused by text that does not replace this primary's view (see ``_restore``) puts
        that view back and tries once more: a stranger's write must not depose it."""
        record = self.registry.change_view(self.shard, expected, new)
        if record is None:
            now = self.registry.read_view(self.shard)
            replaced = now.record is not None and (now.record.view.epoch > expected.view.epoch or now.record.view.primary != self.name)
            if not replaced:
                self._restore(now)
                record = self.registry.change_view(self.shard, self.record, new)  # as put back (its new revision)
        if record is None:
            now = self.registry.read_view(self.shard)
            self._step_down(f"the view changed under it to {now.record.view if now.record is not None else now.raw or 'nothing'}")
            return None
        self.record = record
        self._view_read_at = time.monotonic()
        if self.ledger is not None:
            self.ledger.view(new)
        return record

    def _step_down(self, why: str) -> None:
        """Stops serving for good (may run while this thread holds the server's lock: it does not take it)."""
        with self._lock:
            if self.server.deposed:
                return
            self.server.not_primary_reason = f"{self.name} was replaced as shard {self.shard}'s primary; read its view again"
            self.server.deposed = True  # read under the server's lock before every sequence and apply
        logger.error("stepping down as shard %d's primary (epoch %d): %s", self.shard, self.record.view.epoch, why)
        self.metrics.stepdowns.inc()
        if self.ledger is not None:
            self.ledger.stepped_down(self.record.view.epoch)
        self._stopped.set()
        self._end_claim()
        self._on_step_down(why)

    def _end_claim(self) -> None:
        """Revokes the claim's lease: another server need not wait it out to take the shard over."""
        if self._claim is not None:
            self._claim.stop()


def _first_difference(ours: dict[str, str], theirs: dict[str, str]) -> str | None:
    for key in sorted(set(ours) | set(theirs)):
        if ours.get(key) != theirs.get(key):
            return f"{key} is {ours.get(key)!r} here and {theirs.get(key)!r} there"
    return None
