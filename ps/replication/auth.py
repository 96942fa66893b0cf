"""Who may use the replication API: the job secret for attaching, a random token for the rest.

Without this, any process that reaches a server's RPC port could attach as its standby and copy the
whole model and optimizer state, or send a standby forged log entries. So:

- ``replica_attach`` carries, with a job secret, an HMAC over a fresh nonce, its unix time, the
  standby's name and the primary's (``rpcps.jobsecret``). The primary accepts a time within
  ``WINDOW_S`` of its own clock and each nonce once (it remembers those it saw for that long), so a
  proof seen on the wire cannot be replayed. Without a job secret (loopback only, ``ps.lifecycle.exposure``)
  every attach is accepted, as worker registrations are.
- Only then does the primary issue an attach id: 128 random bits (``secrets``), the only credential
  the rest of that attachment carries (snapshot pieces, ready, the death watch, and the primary's
  appends to that standby), compared in constant time on both sides.

Every refusal is an error reply to the caller, a warning in the log, and a count by reason
(``rpcps_replica_refused``).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from collections import OrderedDict

from prometheus_client import Counter

from rpcps.errors import ReplicaRefused
from rpcps.jobsecret import JobSecret, matches
from rpcps.logsafe import peer_text

logger = logging.getLogger(__name__)

WINDOW_S = 60.0
"""How far an attach proof's time may be from the primary's clock (the processes of a job share hosts
or synchronised clocks; a proof is sent the moment it is made)."""
MAX_REMEMBERED = 4096
"""Nonces kept at once; beyond that the oldest go. Only nonces of valid proofs are kept, so a stranger
cannot flood this."""
REASONS = ("no_proof", "stale_proof", "replayed_proof", "bad_proof", "bad_attach_id")
"""Why a replication call was refused (a metric label)."""


def new_attach_id() -> str:
    """An unguessable attach id (128 random bits)."""
    return secrets.token_hex(16)


def same_attach_id(expected: str | None, given: object) -> bool:
    """Constant-time comparison of an attach id a peer sent with the one issued (None: none issued)."""
    return expected is not None and isinstance(given, str) and hmac.compare_digest(expected.encode(), given.encode("utf-8", "replace"))


def attach_proof(secret: JobSecret | None, name: str, primary: str) -> tuple[str, float, str]:
    """(nonce, issued_at, mac) for ``replica_attach``; an empty mac without a job secret."""
    nonce, issued_at = secrets.token_hex(16), time.time()
    return nonce, issued_at, secret.replica_attach_proof(nonce, issued_at, name, primary) if secret is not None else ""


class ReplicaGate:
    """Checks attach proofs (replay-protected) and counts and logs every refusal. Thread-safe."""

    def __init__(self, secret: JobSecret | None, name: str, refused: Counter) -> None:
        """``name``: this process's RPC name (proofs made for another primary are refused)."""
        self.secret = secret
        self.name = name
        self.refused = refused
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def check_attach(self, name: str, nonce: object, issued_at: object, mac: object) -> None:
        """Returns when ``name`` may attach; raises ReplicaRefused (logged, counted) otherwise."""
        if self.secret is None:
            return
        if not mac or not isinstance(nonce, str) or not isinstance(issued_at, float):
            self.refuse("no_proof", f"attach by '{peer_text(name)}'", "no proof of the job secret (start it with --job-secret-file)")
        now = time.time()
        if abs(now - issued_at) > WINDOW_S:  # type: ignore[operator]
            self.refuse("stale_proof", f"attach by '{peer_text(name)}'", f"its proof is not from the last {WINDOW_S:.0f}s (clocks apart?)")
        if not matches(self.secret.replica_attach_proof(nonce, issued_at, str(name), self.name), mac):  # type: ignore[arg-type]
            self.refuse("bad_proof", f"attach by '{peer_text(name)}'", "wrong proof (is --job-secret-file the same on both servers?)")
        with self._lock:
            while self._seen and (now - next(iter(self._seen.values())) > 2 * WINDOW_S or len(self._seen) >= MAX_REMEMBERED):
                self._seen.popitem(last=False)
            if nonce in self._seen:
                replayed = True
            else:
                replayed = False
                self._seen[nonce] = now  # type: ignore[index]
        if replayed:
            self.refuse("replayed_proof", f"attach by '{peer_text(name)}'", "its proof was used already")

    def check_attach_id(self, expected: str | None, given: object, what: str) -> None:
        """Returns when ``given`` is the attach id issued; raises ReplicaRefused (logged, counted) otherwise.

        ``what`` names the call for the log; what a peer sent in it must be shown through ``peer_text``."""
        if not same_attach_id(expected, given):
            self.refuse("bad_attach_id", what, "not the current attachment's id (attach again)")

    def refuse(self, reason: str, what: str, why: str) -> None:
        """``what`` goes into the log as it is: show what a peer sent in it through ``peer_text``."""
        self.refused.labels(reason).inc()
        logger.warning("refused replication call (%s): %s", what, why)
        raise ReplicaRefused(f"{what} refused: {why}")
