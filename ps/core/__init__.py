"""The server's state and its one apply step: the parameters, the optimizer and everything a push changes.

``server.py`` holds the flat fp32 masters and applies one update at a time under one lock; beside it
live what that step reads and writes: the optimizer and its config (``optim.py``), the core settings
(``config.py``), the model's buffers (``buffers.py``), the worker slots (``workers.py``) and their
at-most-once sequence numbers (``dedup.py``), the reused pull copies (``pull_copies.py``), the
presence mask (``presence.py``), the checks a push passes before it is applied (``push_checks.py``),
the applied-update log a standby replays (``update_log.py``) and the Prometheus series
(``metrics.py``). The core imports nothing from ``ps.api``, ``ps.checkpoints``, ``ps.lifecycle``,
``ps.replication``, ``ps.control``, ``ps.config`` or ``ps.runner``: it is readable and importable
without them, and they are handed what they need from it (tests/unit/test_layers.py holds this).
"""
