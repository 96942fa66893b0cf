"""Restarting the current process in place (same PID, same command line) with ``os.execv``.

Used when torch RPC state cannot be repaired inside a process (a broken connection cached forever,
a closed listener). Every socket torch, gRPC and prometheus_client open is close-on-exec, so the
fresh process can bind the same ports at once.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

logger = logging.getLogger(__name__)


def restart_self(env: dict[str, str]) -> NoReturn:
    os.environ.update(env)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
