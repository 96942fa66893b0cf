"""Bearer-token authentication of control-plane calls.

Every call to the Control service must carry the metadata ``authorization: Bearer <token>`` when
the server was started with ``--control-token-file``. The Health service stays open on purpose:
load balancers and Kubernetes probes cannot send a token, and health reveals nothing but SERVING or
NOT_SERVING. The token is a shared secret read from a file so it never shows up in ``ps`` output or
shell history.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from rpcps.logsafe import peer_text
from rpcps.secret_files import read_secret_line, warn_if_readable_by_others

__all__ = ["TokenInterceptor", "bearer_metadata", "check_bearer", "read_token", "warn_if_readable_by_others"]

logger = logging.getLogger(__name__)

AUTH_METADATA_KEY = "authorization"
"""gRPC metadata keys are lower-case; HTTP/2 would reject an upper-case one."""
SCHEME = "Bearer"


def read_token(path: str) -> str:
    """Reads a token file: one line of printable text without spaces (``rpcps.secret_files``).

    Raises:
        OSError: the file cannot be read (the message names the file).
        ValueError: the file is empty or holds more than one word.
    """
    return read_secret_line(path, "token file")


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata a client sends with every Control call."""
    return ((AUTH_METADATA_KEY, f"{SCHEME} {token}"),)


def check_bearer(metadata: Iterable[tuple[str, str | bytes]], token: str) -> str | None:
    """Checks a call's metadata against the expected token.

    Returns:
        None when the call carries exactly the right token, else the reason for refusing it (safe
        to send back: it never contains either token).
    """
    values = [v for k, v in metadata if k.lower() == AUTH_METADATA_KEY]
    if not values:
        return f"missing '{AUTH_METADATA_KEY}: {SCHEME} <token>' metadata; this server requires a token (pass --token-file)"
    if len(values) > 1:
        return f"more than one '{AUTH_METADATA_KEY}' metadata entry; send exactly one"
    value = values[0]
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    scheme, _, given = value.strip().partition(" ")
    if scheme.lower() != SCHEME.lower() or not given.strip():
        return f"'{AUTH_METADATA_KEY}' metadata is not of the form '{SCHEME} <token>'"
    # Constant-time comparison: a byte-by-byte early exit would leak the token's prefix through timing.
    if not hmac.compare_digest(given.strip().encode("utf-8"), token.encode("utf-8")):
        return "wrong token"
    return None


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls to the methods under ``protected_prefix`` that lack the right bearer token."""

    def __init__(self, token: str, protected_prefix: str, on_refused: Callable[[str], None] | None = None) -> None:
        """
        Args:
            token: the expected token.
            protected_prefix: method paths starting with this ("/package.Service/") need the token.
            on_refused: called with the method path of each refused call (to count it).
        """
        self._token = token
        self._prefix = protected_prefix
        self._on_refused = on_refused

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method
        if not method.startswith(self._prefix):
            return continuation(handler_call_details)
        reason = check_bearer(handler_call_details.invocation_metadata or (), self._token)
        if reason is None:
            return continuation(handler_call_details)
        logger.warning("refused control call %s: %s", peer_text(method), reason)  # the caller chose the method path
        if self._on_refused is not None:
            self._on_refused(method)
        return _refusal(reason)


def _refusal(reason: str) -> grpc.RpcMethodHandler:
    # Every Control method is unary-unary; the request is left as raw bytes because it is never read.
    def deny(_request: Any, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    return grpc.unary_unary_rpc_method_handler(deny)
