"""The small records exchanged between workers and the server (tensors travel beside them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Registration:
    incarnation: str
    """Identifies this registration of the slot; a later registration of the same slot replaces it."""
    next_step: int
    """The slot's first step the server has not processed: where the worker resumes its data."""
    version: int
    server_id: str
    chunk_bytes: int
    """The server's wire chunk limit; the worker builds the same layout from it."""
    chunk_numels: tuple[int, ...]
    mode: str = "async"
    shard_index: int = 0
    shard_count: int = 1
    partition_digest: str = ""
    wire_dtype: str = "fp32"


@dataclass(frozen=True)
class PushReply:
    status: str
    """'applied', 'duplicate' (already processed, not applied again), 'skipped' (non-finite, dropped)
    or 'stale' (refused by a staleness bound; recompute on fresh parameters)."""
    version: int
    staleness: int


@dataclass(frozen=True)
class PullReply:
    version: int
    chunks: list[torch.Tensor] | None
    """None when the worker already holds ``version``."""
    paused: bool = False
    stop: bool = False
    """The server is shutting down for good: finish in-flight pushes, leave and exit cleanly."""


@dataclass(frozen=True)
class ErrorReply:
    kind: str
    message: str
