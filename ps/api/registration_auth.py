"""Who may take a worker slot or read the model: registrations and observations must prove they hold the job secret.

Without this, any process that reaches the RPC port could register for a running worker's slot and
take it over (the real worker's calls are refused from then on). With a job secret the server hands
out a fresh random challenge per registration attempt (``challenge``); the worker answers with an
HMAC over that challenge, its slot and its RPC name (``rpcps.jobsecret``). A challenge is good once
and for ``TTL_S``, so a proof seen on the wire cannot be replayed, for any slot or name. Without a
job secret (allowed only on loopback, ``ps.lifecycle.exposure``) every registration is accepted.

``observe`` (the sidecar evaluator's read-only look at the parameters) answers a challenge the same
way, with its own HMAC purpose: the parameters are the job's model, not something to hand to anyone
who reaches the port.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from typing import NoReturn

from prometheus_client import Counter

from rpcps.errors import RegistrationRefused
from rpcps.jobsecret import JobSecret, matches
from rpcps.logsafe import peer_text
from rpcps.messages import RegistrationProof

logger = logging.getLogger(__name__)

TTL_S = 60.0
"""How long a challenge stays good (a registration answers it within one RPC round trip)."""
MAX_OUTSTANDING = 1024
"""Challenges kept at once; a peer asking for more only evicts the oldest (bounded memory)."""


class RegistrationGate:
    def __init__(self, secret: JobSecret | None, refused: Counter) -> None:
        """``refused``: counts each refusal, labelled by ``reason`` (``ps.core.metrics.REGISTRATION_REFUSALS``)."""
        self.secret = secret
        self.refused = refused
        self._issued: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def required(self) -> bool:
        return self.secret is not None

    def challenge(self) -> str:
        """A fresh challenge (also when no secret is required: workers need not know which)."""
        value = secrets.token_hex(16)
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            self._issued[value] = now
            while len(self._issued) > MAX_OUTSTANDING:
                self._issued.popitem(last=False)
        return value

    def check(self, slot: int, rpc_name: str, proof: RegistrationProof | None) -> None:
        """Returns when the registration may proceed.

        Raises:
            RegistrationRefused: the server requires the job secret and ``proof`` does not show it
                (logged and counted by reason).
        """
        if self.secret is None:
            return
        if not isinstance(proof, RegistrationProof):
            self._refuse("no_proof", slot, rpc_name, "no proof of the job secret (start the worker with --job-secret-file)")
        if not self._take(proof.challenge):
            self._refuse("unknown_challenge", slot, rpc_name, "its challenge was not issued here, expired or was used already")
        if not matches(self.secret.registration_proof(proof.challenge, slot, str(rpc_name)), proof.mac):
            self._refuse("bad_proof", slot, rpc_name, "wrong proof (is --job-secret-file the same on the worker and the server?)")

    def check_observer(self, proof: RegistrationProof | None) -> None:
        """Returns when an ``observe`` may read the model.

        Raises:
            RegistrationRefused: the server requires the job secret and ``proof`` does not show it.
        """
        if self.secret is None:
            return
        if not isinstance(proof, RegistrationProof):
            self._refuse_observer("no_proof", "no proof of the job secret (start the evaluator with --job-secret-file)")
        if not self._take(proof.challenge):
            self._refuse_observer("unknown_challenge", "its challenge was not issued here, expired or was used already")
        if not matches(self.secret.observe_proof(proof.challenge), proof.mac):
            self._refuse_observer("bad_proof", "wrong proof (is --job-secret-file the same on the evaluator and the server?)")

    def _take(self, challenge: object) -> bool:
        """Uses up an issued challenge; False when it was never issued, expired or was used."""
        with self._lock:
            self._expire(time.monotonic())
            return isinstance(challenge, str) and self._issued.pop(challenge, None) is not None

    def _expire(self, now: float) -> None:
        while self._issued and now - next(iter(self._issued.values())) > TTL_S:
            self._issued.popitem(last=False)

    def _refuse_observer(self, reason: str, why: str) -> NoReturn:
        self.refused.labels(reason).inc()
        logger.warning("refused an observation of the model: %s", why)
        raise RegistrationRefused(f"observation of the model refused: {why}")

    def _refuse(self, reason: str, slot: int, rpc_name: str, why: str) -> NoReturn:
        self.refused.labels(reason).inc()
        logger.warning("refused registration of worker slot %s by '%s': %s", peer_text(slot), peer_text(rpc_name), why)
        raise RegistrationRefused(f"registration of worker slot {slot} refused: {why}")
