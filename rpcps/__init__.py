"""Shared pieces of rpcps used by both roles: the wire protocol, plug-in loading, built-in tasks,
the command line and the local launcher. Server logic lives in ``ps``; worker logic in ``worker``."""

__version__ = "0.1.0"
