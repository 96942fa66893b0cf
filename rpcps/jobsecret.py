"""The job secret: what a process proves to show it belongs to this job (docs/SECURITY.md).

Every process of a job reads the same secret from a file (``--job-secret-file``). It never crosses
the wire: a worker registering for a slot answers the server's fresh, single-use challenge with an
HMAC over the challenge, the slot and its RPC name, so a proof seen on the network cannot be used
again, for another slot or under another name. Leaving the group, signing snapshot manifests and
signing the records in the group's store (``rpcps.transport.registry``) use keys derived from the same secret, each for its own purpose, so a value made for one can never
pass for another.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from rpcps.secret_files import read_secret_line, warn_if_readable_by_others

MIN_LENGTH = 32
"""Characters a secret must have at least (``openssl rand -hex 32`` gives 64)."""
_REGISTER, _LEAVE, _MANIFEST, _REPLICA_ATTACH = b"register/v1", b"leave/v1", b"manifest/v1", b"replica-attach/v1"
_OBSERVE = b"observe/v1"
_STORE_RECORD = b"store-record/v1"


class JobSecret:
    """The secret of one job, read once at start. ``repr`` never shows it."""

    __slots__ = ("_key",)

    def __init__(self, value: str) -> None:
        if len(value) < MIN_LENGTH:
            raise ValueError(f"the job secret must be at least {MIN_LENGTH} characters; make one with `openssl rand -hex 32`")
        self._key = value.encode("utf-8")

    @classmethod
    def from_file(cls, path: str) -> JobSecret:
        """Raises OSError (unreadable) or ValueError (empty, several words, too short), naming the file."""
        value = read_secret_line(path, "job secret file")
        warn_if_readable_by_others(path)
        try:
            return cls(value)
        except ValueError as e:
            raise ValueError(f"job secret file {path}: {e}") from None

    def __repr__(self) -> str:
        return "JobSecret(<hidden>)"

    def _mac(self, purpose: bytes, *parts: str) -> str:
        key = hmac.new(self._key, purpose, hashlib.sha256).digest()  # one key per purpose
        return hmac.new(key, "\0".join(parts).encode("utf-8"), hashlib.sha256).hexdigest()

    def registration_proof(self, challenge: str, slot: int, rpc_name: str) -> str:
        """What a worker sends with ``register``: binds the server's challenge, the slot and the name."""
        return self._mac(_REGISTER, challenge, str(slot), rpc_name)

    def observe_proof(self, challenge: str) -> str:
        """What an observer (the sidecar evaluator) sends with ``observe``: answers one challenge, so a
        stranger cannot read the model's parameters."""
        return self._mac(_OBSERVE, challenge)

    def leave_proof(self, rpc_name: str) -> str:
        """What a departing process sends to be dropped from the group (its name is never reused)."""
        return self._mac(_LEAVE, rpc_name)

    def replica_attach_proof(self, nonce: str, issued_at: float, name: str, primary: str) -> str:
        """What a standby sends with ``replica_attach``: binds a fresh nonce, its time, the standby's
        name and the primary it asks (the primary accepts a nonce once, within a short window)."""
        return self._mac(_REPLICA_ATTACH, nonce, repr(float(issued_at)), name, primary)

    def store_record_mac(self, kind: str, subject: str, epoch: int, writer: str, body: str) -> str:
        """HMAC of a record in the group's store (a shard's view, a server's replica record, a dead
        member): binds what it is (``kind``), what it is about (the shard, or the member's name), the
        view's epoch (0 for records without one), the process that wrote it and its canonical text,
        so a record moved to another key, epoch or writer no longer verifies."""
        return self._mac(_STORE_RECORD, kind, subject, str(int(epoch)), writer, body)

    def manifest_signature(self, manifest: dict[str, Any]) -> str:
        """HMAC of a snapshot manifest (every field but the signature itself, canonical JSON)."""
        body = {k: v for k, v in manifest.items() if k != "hmac"}
        return self._mac(_MANIFEST, json.dumps(body, sort_keys=True, separators=(",", ":"), default=str))


def matches(expected: str, given: object) -> bool:
    """Constant-time comparison of a proof (anything a peer sent) with the expected one."""
    return isinstance(given, str) and hmac.compare_digest(expected.encode("utf-8"), given.encode("utf-8", "replace"))
