"""The group's shared facts, kept in its rendezvous store: who serves each shard, and who died how.

Keys (all JSON or plain text, all rpcps's own):

- ``rpcps/shards``: how many server shards the job has (the first server writes it, the others must agree);
- ``rpcps/view/<K>``: shard K's ``View`` (epoch, primary, standby), changed only by compare-and-set;
- ``rpcps/replica/<name>``: what a server process says about itself at start (shard, control and
  metrics addresses, host, pid), for ``ctl`` and the fault harness;
- ``rpcps/dead/<name>``: written by the group janitor when it removes a member whose connection was
  refused or reset (its process is gone, not merely unreachable): a starting server may take over
  that member's shard at once instead of waiting out its lease.

The store is the third party two replicas need to break a tie: both may try to change a view, and
compare-and-set lets exactly one of them win. It carries no training traffic and decides nothing by
itself. Every operation here is bounded by the client's timeout (a store cut off by the network
fails the call rather than hanging the caller).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from rpcps.messages import View

logger = logging.getLogger(__name__)

SHARDS_KEY = "rpcps/shards"
_VIEW_KEY = "rpcps/view/{}"
_REPLICA_KEY = "rpcps/replica/{}"
_DEAD_KEY = "rpcps/dead/{}"


class StoreClient(Protocol):
    """The part of ``torch.distributed.Store`` used here (a TCPStore client in production)."""

    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...

    def set(self, key: str, value: str) -> None: ...


class StoreUnavailable(RuntimeError):
    """The store did not answer (it is gone, or cut off): nothing was read or changed."""


class ShardCountMismatch(ValueError):
    """This server was started with another shard count than the group already has."""


@dataclass(frozen=True)
class ViewRecord:
    """A view as read, with the exact text it was stored as (what a compare-and-set must match)."""

    view: View
    raw: str


def encode_view(view: View) -> str:
    # Canonical text: compare-and-set compares bytes, so one view must always encode the same way.
    return json.dumps({"epoch": view.epoch, "primary": view.primary, "standby": view.standby}, sort_keys=True, separators=(",", ":"))


def decode_view(raw: str) -> View:
    data = json.loads(raw)
    return View(int(data["epoch"]), str(data["primary"]), data.get("standby"))


class Registry:
    """Reads and changes the group's shared facts in its store. Thread-safe."""

    def __init__(self, store: StoreClient) -> None:
        self._store = store
        self._lock = threading.Lock()
        """One operation at a time on the client's single connection."""

    def _cas(self, key: str, expected: str, desired: str) -> str:
        try:
            with self._lock:
                return self._store.compare_set(key, expected, desired).decode()
        except (RuntimeError, OSError) as e:  # torch's store errors (DistStoreError, DistNetworkError) are RuntimeErrors
            raise StoreUnavailable(f"the group's store did not answer ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e

    def _read(self, key: str) -> str:
        """The key's text, '' when it was never written (a compare-and-set of '' with '' reads without waiting)."""
        return self._cas(key, "", "")

    def _write(self, key: str, value: str) -> None:
        try:
            with self._lock:
                self._store.set(key, value)
        except (RuntimeError, OSError) as e:
            raise StoreUnavailable(f"the group's store did not answer ({type(e).__name__})") from e

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

    def view(self, shard: int) -> ViewRecord | None:
        raw = self._read(_VIEW_KEY.format(shard))
        return ViewRecord(decode_view(raw), raw) if raw else None

    def change_view(self, shard: int, expected: ViewRecord | None, new: View) -> ViewRecord | None:
        """Compare-and-set: replaces ``expected`` (None: no view yet) with ``new``.

        Returns the new record on success, None when the view was no longer ``expected`` (someone
        else changed it first: read it again to see who).
        """
        desired = encode_view(new)
        held = self._cas(_VIEW_KEY.format(shard), expected.raw if expected is not None else "", desired)
        # Every change names its author (a new primary or standby), so no two parties ever ask for
        # the same text: reading ``desired`` back means this call made the change.
        return ViewRecord(new, desired) if held == desired else None

    # ---- replica records and dead members ----------------------------------------------------

    def put_replica(self, name: str, info: dict[str, Any]) -> None:
        self._write(_REPLICA_KEY.format(name), json.dumps(info, sort_keys=True))

    def replica(self, name: str) -> dict[str, Any] | None:
        raw = self._read(_REPLICA_KEY.format(name))
        return json.loads(raw) if raw else None

    def mark_dead(self, name: str) -> None:
        """Records that member ``name``'s process is gone (its connection was refused or reset)."""
        self._write(_DEAD_KEY.format(name), "gone")

    def is_dead(self, name: str) -> bool:
        return self._read(_DEAD_KEY.format(name)) == "gone"
