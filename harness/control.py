"""Holding training still from a test: a server's control plane (pause, resume) called in this process.

A test that needs training not to have ended when something slow lands (a replacement replica
starting and catching up, a stranger's attack, a planned kill whose target is restarting) holds it
with the product's own pause instead of hoping a pace or a step count outlasts that something. The
call is made here, not through ``rpcps ctl`` in a subprocess: a client interpreter starting up
(seconds on a loaded machine) would itself race the end of training before the pause landed.
Plaintext and token-less: the servers tests start bind their control planes on loopback.
"""

from __future__ import annotations

import os

# gRPC's C core logs connection failures to stderr on its own; callers get the error instead.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import grpc

from cli import ctl

__all__ = ["pause", "resume"]

CALL_TIMEOUT_S = 20.0


def pause(address: str, timeout_s: float = CALL_TIMEOUT_S, wait_for_ready: bool = False) -> int:
    """Holds every push at the server whose control plane is at ``address`` (HOST:PORT); with a
    standby the pause is a log entry, so the standby holds it too. ``wait_for_ready``: a control
    plane not listening yet (a server still starting) is waited for, up to ``timeout_s``, instead of
    failing at once. Returns the model version it holds at.

    Raises:
        grpc.RpcError: when the server does not answer within ``timeout_s``.
        grpc.FutureTimeoutError: with ``wait_for_ready``, when nothing listens within ``timeout_s``.
    """
    with grpc.insecure_channel(address) as channel:
        if wait_for_ready:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
        return int(ctl.call("pause", channel, (), timeout_s)["model_version"])


def resume(address: str, timeout_s: float = CALL_TIMEOUT_S) -> int:
    """Lets training at ``address`` go on (idempotent). Returns the model version it resumed at.

    Raises:
        grpc.RpcError: when the server does not answer within ``timeout_s``.
    """
    with grpc.insecure_channel(address) as channel:
        return int(ctl.call("resume", channel, (), timeout_s)["model_version"])
