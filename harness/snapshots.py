"""Checks a checkpoint directory the way a resume would (for tests and the chaos harness)."""

from __future__ import annotations

from pathlib import Path

from ps.checkpoints.snapshot_files import InvalidSnapshot, list_snapshots, read_manifest


def verify_all(directory: Path) -> dict[Path, str | None]:
    """Every committed snapshot and why it is invalid (None when valid)."""
    result: dict[Path, str | None] = {}
    for path in list_snapshots(directory):
        try:
            read_manifest(path)
            result[path] = None
        except InvalidSnapshot as e:
            result[path] = str(e)
    return result
