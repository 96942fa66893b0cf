"""The group's shared facts, kept in its rendezvous store: who serves each shard, and who died how.

Keys (all JSON, all rpcps's own):

- ``rpcps/shards``: how many server shards the job has (the first server writes it, the others must agree);
- ``rpcps/view/<K>``: shard K's ``View`` (epoch, primary, standby), changed only by compare-and-set:
  of the stored text in a TCPStore, of the key's revision in a store that numbers changes
  (``RevisionStore``: etcd), where a view changed and changed back to the same text still makes a
  writer that read the first one lose;
- ``rpcps/claim/<K>/<name>`` (etcd only): held by shard K's primary ``name`` under an etcd lease
  (``rpcps.transport.group.shard_claim``); once it is gone, the lease has ended and that primary
  applies nothing more alone, so another server may take the shard over (``ps.replication.claim``);
- ``rpcps/replica/<name>``: what a server process says about itself at start (shard, control and
  metrics addresses, host, pid), for ``ctl``, the standby and the workers;
- ``rpcps/dead/<name>``: written by the group janitor when it removes a member whose connection was
  refused or reset (its process is gone, not merely unreachable): a starting server may take over
  that member's shard at once instead of waiting out its lease.

The store is the third party two replicas need to break a tie: both may try to change a view, and
compare-and-set lets exactly one of them win. It carries no training traffic and decides nothing by
itself. Every operation here is bounded by the client's timeout (a store cut off by the network
fails the call rather than hanging the caller).

Anyone who reaches the store's port can write these keys. With the job secret (``authenticate``)
every view, replica record and dead record is written with an HMAC bound to its kind, its shard or
member, its epoch and its writer (``JobSecret.store_record_mac``), as part of its canonical text (so
compare-and-set still compares exactly what was written). Readers ignore a record that is unsigned,
wrongly signed, malformed, or (views) older than one this process already saw, and count it once
per distinct text (``rpcps_store_records_refused_total``). Without a secret the store is trusted
as it stands, which rpcps allows only on loopback (``ps.lifecycle.exposure``, ``cli.store``, ``worker.runner``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from rpcps.jobsecret import JobSecret, matches
from rpcps.messages import View
from rpcps.transport.store_client import INCARNATION_KEY, SNAPSHOT_CLAIMS_HELD_KEY

logger = logging.getLogger(__name__)

T = TypeVar("T")

SHARDS_KEY = "rpcps/shards"
_VIEW_KEY = "rpcps/view/{}"
_REPLICA_KEY = "rpcps/replica/{}"
_DEAD_KEY = "rpcps/dead/{}"
_CLAIM_KEY = "rpcps/claim/{}/{}"

RECORD_KINDS = ("view", "replica", "dead")
REFUSAL_REASONS = ("unsigned", "bad_signature", "malformed", "stale")
"""Why a record was ignored: no HMAC where the job has a secret (or a store off loopback without
one), an HMAC that does not verify (another key, shard, epoch or writer), text that is not a record,
or a view of an older epoch than this process already saw (a replay)."""
_WHO = {
    "bad_signature": "it was signed with another job secret: this process's --job-secret-file differs from the job's, or "
    "someone outside this job writes to the store (keep its port on the training network; docs/SECURITY.md)",
    "unsigned": "the job has no secret while this process has one, or someone outside this job writes to the store "
    "(keep its port on the training network; docs/SECURITY.md)",
    "stale": "someone outside this job writes to the store (keep its port on the training network; docs/SECURITY.md)",
}
_REPORTED_MAX = 256
"""Distinct refused texts remembered (each is logged and counted once); beyond, forgotten and reported again."""


class StoreClient(Protocol):
    """The part of ``torch.distributed.Store`` used here (a TCPStore client in production)."""

    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...

    def set(self, key: str, value: str) -> None: ...

    def check(self, keys: list[str]) -> bool: ...


@runtime_checkable
class RevisionStore(Protocol):
    """A store that numbers every change of a key (etcd's mod revision: ``rpcps.etcd.store``)."""

    def get_revision(self, key: str) -> tuple[bytes, int]: ...

    def set_at_revision(self, key: str, revision: int, desired: str, absent_keys: Sequence[str] = ()) -> int | None: ...


class StoreUnavailable(RuntimeError):
    """The store did not answer (it is gone, or cut off): nothing was read or changed."""


class ShardCountMismatch(ValueError):
    """This server was started with another shard count than the group already has."""


@dataclass(frozen=True)
class Refusal:
    """A record read from the store and ignored."""

    record: str
    """One of ``RECORD_KINDS``."""
    key: str
    reason: str
    """One of ``REFUSAL_REASONS``."""


class _Refused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class ViewRecord:
    """A view as read, with the exact text it was stored as (what a compare-and-set must match)."""

    view: View
    raw: str
    revision: int | None = None
    """The key's revision when it was read or written (a ``RevisionStore``'s); None where the text is compared."""


@dataclass(frozen=True)
class ViewReading:
    """What a shard's view key holds now: a verified view, nothing (never written: ``raw`` is ''),
    or text this process refused (``refused`` says why; ``record`` is None)."""

    raw: str
    record: ViewRecord | None
    refused: str | None = None
    revision: int | None = None
    """As ``ViewRecord.revision`` (0: the key does not exist)."""


def _canonical(data: dict[str, Any]) -> str:
    # Canonical text: compare-and-set compares bytes, so one record must always encode the same way.
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def _view_body(view: View) -> dict[str, Any]:
    return {"epoch": view.epoch, "primary": view.primary, "standby": view.standby}


def encode_view(view: View, secret: JobSecret | None = None, shard: int = 0, writer: str | None = None) -> str:
    """The stored text of ``view``: unsigned without ``secret``, else with its writer and HMAC."""
    body = _view_body(view)
    if secret is None:
        return _canonical(body)
    body["writer"] = writer if writer is not None else view.primary
    return _canonical({**body, "mac": _mac(secret, "view", _view_subject(shard), body)})


def decode_view(raw: str) -> View:
    """The view in a stored text, unverified (``Registry.view`` verifies)."""
    data = json.loads(raw)
    return View(int(data["epoch"]), str(data["primary"]), data.get("standby"))


def _view_subject(shard: int) -> str:
    return f"shard {shard}"


def _mac(secret: JobSecret, kind: str, subject: str, body: dict[str, Any]) -> str:
    return secret.store_record_mac(kind, subject, int(body.get("epoch", 0)), str(body["writer"]), _canonical(body))


def require_secret_off_loopback(store_loopback: bool, secret: JobSecret | None, store: object) -> None:
    """Raises ValueError for a process that would take the store's records on trust off loopback.

    Without a job secret nothing in the store can be verified, so whoever reaches its port could
    name the process a worker sends its gradients to (a shard's view); ``rpcps ps`` and ``rpcps
    store`` already refuse to listen off loopback without a secret (``ps.lifecycle.exposure``, ``cli.store``).
    """
    if secret is None and not store_loopback:
        raise ValueError(
            f"the group's store {store} is not on loopback and there is no --job-secret-file: its shard views could "
            "not be verified, and anyone who reaches it could redirect this process; give every process of the job "
            "the same secret file (docs/SECURITY.md)"
        )


class Registry:
    """Reads and changes the group's shared facts in its store. Thread-safe."""

    def __init__(
        self,
        store: StoreClient,
        secret: JobSecret | None = None,
        writer: str = "",
        trust_unsigned: bool = True,
        on_refused: Callable[[Refusal], None] | None = None,
    ) -> None:
        self._store = store
        self._revisions = store if isinstance(store, RevisionStore) else None
        self._lock = threading.Lock()
        """One operation at a time on the client's single connection."""
        self._secret = secret
        self._writer = writer
        self._trust_unsigned = trust_unsigned
        self._on_refused = on_refused
        self._newest_epoch: dict[int, int] = {}
        """Per shard, the newest epoch this process read or wrote (an older view is a replay)."""
        self._reported: set[tuple[str, str]] = set()

    def authenticate(
        self, secret: JobSecret | None, writer: str, *, trust_unsigned: bool, on_refused: Callable[[Refusal], None] | None = None
    ) -> None:
        """Signs what this process writes and verifies what it reads from now on (call once, after joining).

        Args:
            secret: the job's; None trusts the store as it stands (``trust_unsigned`` then says whether
                unsigned records are taken at all: only on loopback).
            writer: this process's RPC name, bound into every record it writes.
            on_refused: told once per distinct record text ignored (the caller counts it).
        """
        self._secret, self._writer, self._trust_unsigned, self._on_refused = secret, writer, trust_unsigned, on_refused

    def _call(self, call: Callable[[], T]) -> T:
        try:
            with self._lock:
                return call()
        except (RuntimeError, OSError) as e:  # torch's store errors (DistStoreError, DistNetworkError) are RuntimeErrors
            raise StoreUnavailable(f"the group's store did not answer ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e

    def _cas(self, key: str, expected: str, desired: str) -> str:
        return self._call(lambda: self._store.compare_set(key, expected, desired).decode())

    def _read(self, key: str) -> str:
        """The key's text, '' when it was never written (a compare-and-set of '' with '' reads without waiting)."""
        return self._cas(key, "", "")

    def _write(self, key: str, value: str) -> None:
        """Returns once the store holds ``value``: TCPStore does not answer a set, so without the
        check (answered on the same connection, after the set) another member's read right after
        this returns could still find the old value."""
        try:
            with self._lock:
                self._store.set(key, value)
                self._store.check([key])
        except (RuntimeError, OSError) as e:
            raise StoreUnavailable(f"the group's store did not answer ({type(e).__name__})") from e

    # ---- signing and verifying -------------------------------------------------------------------

    def _sign(self, kind: str, subject: str, body: dict[str, Any]) -> str:
        if self._secret is None:
            return _canonical(body)
        return _canonical({**body, "mac": _mac(self._secret, kind, subject, body)})

    def _verify(self, kind: str, subject: str, raw: str) -> dict[str, Any]:
        """The record's fields (without its HMAC); raises _Refused."""
        try:
            data = json.loads(raw)
        except ValueError:
            raise _Refused("malformed") from None
        if not isinstance(data, dict):
            raise _Refused("malformed")
        mac = data.pop("mac", None)
        if self._secret is None:
            if not self._trust_unsigned:
                raise _Refused("unsigned")
            return data
        if mac is None:
            raise _Refused("unsigned")
        if not isinstance(data.get("writer"), str) or not isinstance(data.get("epoch", 0), int):
            raise _Refused("malformed")
        if not matches(_mac(self._secret, kind, subject, data), mac):
            raise _Refused("bad_signature")
        return data

    def _refuse(self, kind: str, key: str, raw: str, reason: str) -> None:
        """Logs and counts a refused record once per distinct text."""
        if (key, raw) in self._reported:
            return
        if len(self._reported) >= _REPORTED_MAX:
            self._reported.clear()
        self._reported.add((key, raw))
        logger.error(
            "ignoring the %s record at %s in the group's store: %s (%.120r); %s", kind, key, reason.replace("_", " "), raw,
            _WHO.get(reason, _WHO["stale"]),
        )
        if self._on_refused is not None:
            self._on_refused(Refusal(kind, key, reason))

    def incarnation(self) -> str:
        """Which start of the coordinator serves the store ('' when a server hosts it): a new value is a
        store that restarted empty (``rpcps.transport.store_client.INCARNATION_KEY``)."""
        return self._read(INCARNATION_KEY)

    def snapshot_claims_held(self) -> bool:
        """Whether the coordinator started moments ago and still keeps shards without a view from
        being served from a snapshot (``rpcps.transport.rebuild.SNAPSHOT_CLAIM_GRACE_S``)."""
        return self._read(SNAPSHOT_CLAIMS_HELD_KEY) == "1"

    # ---- shards ------------------------------------------------------------------------------

    def claim_shard_count(self, shards: int) -> None:
        """Records the job's shard count, or checks it against the one recorded; raises ShardCountMismatch."""
        held = self._cas(SHARDS_KEY, "", str(shards))
        if held != str(shards):
            raise ShardCountMismatch(
                f"the group's servers run {held} shard(s), but this server was started with --shards {shards}; "
                "start every server with the same --shards"
            )

    def shard_count(self) -> int | None:
        held = self._read(SHARDS_KEY)
        return int(held) if held else None

    # ---- views -------------------------------------------------------------------------------

    def read_view(self, shard: int) -> ViewReading:
        """The shard's view key as it stands, verified (see ``ViewReading``)."""
        key = _VIEW_KEY.format(shard)
        raw, revision = self._read_revision(key)
        if not raw:
            return ViewReading(raw, None, revision=revision)
        try:
            data = self._verify("view", _view_subject(shard), raw)
            view = View(int(data["epoch"]), str(data["primary"]), data.get("standby"))
            if view.standby is not None and not isinstance(view.standby, str):
                raise _Refused("malformed")
        except _Refused as e:
            self._refuse("view", key, raw, e.reason)
            return ViewReading(raw, None, e.reason, revision)
        except (KeyError, TypeError, ValueError):
            self._refuse("view", key, raw, "malformed")
            return ViewReading(raw, None, "malformed", revision)
        if view.epoch < self._newest_epoch.get(shard, view.epoch):
            self._refuse("view", key, raw, "stale")
            return ViewReading(raw, None, "stale", revision)
        self._newest_epoch[shard] = view.epoch
        return ViewReading(raw, ViewRecord(view, raw, revision), revision=revision)

    def _read_revision(self, key: str) -> tuple[str, int | None]:
        """The key's text and, in a ``RevisionStore``, its revision (None in any other store)."""
        revisions = self._revisions
        if revisions is None:
            return self._read(key), None
        raw, revision = self._call(lambda: revisions.get_revision(key))
        return raw.decode(), revision

    def _set_view(
        self, key: str, expected: ViewRecord | ViewReading | str | None, desired: str, absent_keys: Sequence[str] = ()
    ) -> tuple[bool, int | None]:
        """Replaces ``expected`` with ``desired``: in a ``RevisionStore`` at ``expected``'s revision
        (one known by its text only is read first) and only while the keys ``absent_keys`` do not exist,
        in any other store by the text. Returns whether it was written, and the key's new revision
        (None outside a ``RevisionStore``)."""
        text = expected.raw if isinstance(expected, (ViewRecord, ViewReading)) else expected or ""
        revisions = self._revisions
        if revisions is None:
            return self._cas(key, text, desired) == desired, None
        revision = expected.revision if isinstance(expected, (ViewRecord, ViewReading)) else None
        if revision is None:
            raw, revision = self._read_revision(key)
            if raw != text:
                return False, None
        assert revision is not None, "a RevisionStore's read has a revision"
        at = revision
        now = self._call(lambda: revisions.set_at_revision(key, at, desired, absent_keys))
        return now is not None, now

    def verified_any(self) -> bool:
        """Whether this process ever read (or wrote) a view it verified: its secret is the job's."""
        return bool(self._newest_epoch)

    def view(self, shard: int) -> ViewRecord | None:
        """The shard's verified view; None when it has none or holds one this process refused."""
        return self.read_view(shard).record

    def change_view(
        self, shard: int, expected: ViewRecord | ViewReading | str | None, new: View, unclaimed_by: str | None = None
    ) -> ViewRecord | None:
        """Compare-and-set: replaces ``expected`` (a view as read; None: no view yet; a str: that exact
        stored text) with ``new``; with ``unclaimed_by`` (a ``RevisionStore``), only while that
        primary holds no claim on the shard (``claim_ended``), in the same transaction.

        Returns the new record on success, None when the view was no longer ``expected`` (someone
        else changed it first: read it again to see who).
        """
        desired = encode_view(new, self._secret, shard, self._writer or new.primary)
        # Every change names its author (a new primary or standby), so no two parties ever ask for
        # the same text: in a TCPStore, reading ``desired`` back means this call made the change.
        claims = (_CLAIM_KEY.format(shard, unclaimed_by),) if unclaimed_by is not None else ()
        written, revision = self._set_view(_VIEW_KEY.format(shard), expected, desired, claims)
        if not written:
            return None
        self._newest_epoch[shard] = max(self._newest_epoch.get(shard, new.epoch), new.epoch)
        return ViewRecord(new, desired, revision)

    def restore_view(self, shard: int, found: ViewReading, own: ViewRecord) -> ViewRecord | None:
        """Puts ``own`` (this process's current view) back over ``found``, a reading of text it refused
        or of nothing; returns ``own`` as now stored (its new revision), None when the key had changed."""
        written, revision = self._set_view(_VIEW_KEY.format(shard), found, own.raw)
        return ViewRecord(own.view, own.raw, revision) if written else None

    # ---- claims (etcd) ---------------------------------------------------------------------------

    @staticmethod
    def view_key(shard: int) -> str:
        return _VIEW_KEY.format(shard)

    @staticmethod
    def claim_key(shard: int, name: str) -> str:
        """Where primary ``name`` holds its claim on ``shard`` under an etcd lease."""
        return _CLAIM_KEY.format(shard, name)

    def claim_ended(self, shard: int, name: str) -> bool:
        """Whether ``name``'s claim on the shard is gone (its lease ended, or it never took one) in a
        store that holds claims (a ``RevisionStore``: etcd); False in any other (nothing to tell)."""
        revisions = self._revisions
        if revisions is None:
            return False
        key = _CLAIM_KEY.format(shard, name)
        return self._call(lambda: revisions.get_revision(key))[1] == 0

    # ---- replica records and dead members ----------------------------------------------------

    def put_replica(self, name: str, info: dict[str, Any]) -> None:
        """Records what server ``name`` (this process) says about itself."""
        self._write(_REPLICA_KEY.format(name), self._sign("replica", name, {**info, "writer": name}))

    def replica(self, name: str) -> dict[str, Any] | None:
        """What server ``name`` recorded about itself; None when nothing, or nothing this process trusts."""
        key = _REPLICA_KEY.format(name)
        raw = self._read(key)
        if not raw:
            return None
        try:
            data = self._verify("replica", name, raw)
            if data.pop("writer", name) != name:
                raise _Refused("bad_signature")
        except _Refused as e:
            self._refuse("replica", key, raw, e.reason)
            return None
        return data

    def mark_dead(self, name: str) -> None:
        """Records that member ``name``'s process is gone (its connection was refused or reset)."""
        self._write(_DEAD_KEY.format(name), self._sign("dead", name, {"dead": name, "writer": self._writer or "janitor"}))

    def is_dead(self, name: str) -> bool:
        key = _DEAD_KEY.format(name)
        raw = self._read(key)
        if not raw:
            return False
        try:
            return self._verify("dead", name, raw).get("dead") == name
        except _Refused as e:
            self._refuse("dead", key, raw, e.reason)
            return False
