"""Test and fault-injection machinery shared by ``tests/``, ``bench/`` and ``tools/``; never imported by
the runtime packages (``rpcps``, ``ps``, ``worker``, ``cli``)."""
