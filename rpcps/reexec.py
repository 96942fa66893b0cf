"""Restarting the current process in place (same PID, same command line) with ``os.execv``.

Used when torch RPC state cannot be repaired inside a process (a broken connection cached forever,
a closed listener). Every socket torch, gRPC and prometheus_client open is close-on-exec, so the
fresh process can bind the same ports at once.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn, Protocol

from rpcps import transport
from rpcps.logsafe import MESSAGE_LIMIT, peer_text

logger = logging.getLogger(__name__)

EXIT_SERVER_LOST = 3
"""A client role's exit status once it has given up reconnecting to a lost server."""


class _Shutdown(Protocol):
    def shutdown(self) -> None: ...


def restart_self(env: dict[str, str]) -> NoReturn:
    os.environ.update(env)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def rejoin_or_give_up(
    role: str, error: Exception, reconnects: int, max_reconnects: int, http: _Shutdown, carry: dict[str, str]
) -> int:
    """A client role (worker, evaluator) lost its server: restart in place to rejoin, or give up.

    Returns ``EXIT_SERVER_LOST`` once ``max_reconnects`` restarts were spent; otherwise does not return.
    ``carry`` holds the environment the fresh process needs (its reconnect count, what it must keep).
    """
    # One line: an expected loss of the server, whose transport error can carry torch's C++ frames.
    why = (str(error).splitlines() or [type(error).__name__])[0]
    if reconnects >= max_reconnects:
        logger.error("lost the server (%s) and gave up after %d reconnects", peer_text(why, MESSAGE_LIMIT), reconnects)
        return EXIT_SERVER_LOST
    logger.warning("lost the server (%s); restarting the %s to rejoin (reconnect %d)", peer_text(why, MESSAGE_LIMIT), role, reconnects + 1)
    transport.shutdown()
    http.shutdown()
    restart_self(carry)
