"""On-disk format of one snapshot, and the commit protocol that makes it crash-consistent.

A snapshot is a directory ``step-<version>`` holding ``state.pt`` and, written last, ``manifest.json``
with the size and SHA-256 of every file. It is built under a temporary name, every file and the
directory are fsynced, and only then is it renamed into place (and the parent fsynced). So a crash
at any moment leaves either no ``step-*`` directory or a complete one; a ``step-*`` directory whose
manifest is missing or whose checksums fail (truncation, bit rot) is treated as absent.

Why ``torch.save`` and not ``torch.distributed.checkpoint``: every server (and, when sharded, every
shard) owns a disjoint set of whole flat chunks plus its own optimizer state and writes them alone,
with no process group to coordinate a DCP save; one file per shard plus a manifest is all that
needs. Loading uses ``weights_only=True``, so a snapshot file can never execute code.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FORMAT = "rpcps-snapshot-v1"
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
PREFIX = "step-"
TMP_PREFIX = ".tmp-"


class InvalidSnapshot(ValueError):
    """A snapshot directory that must be treated as absent (the message says why)."""


@dataclass(frozen=True)
class SnapshotInfo:
    path: Path
    version: int
    created_unix: float
    size_bytes: int


def snapshot_name(version: int) -> str:
    return f"{PREFIX}{version:012d}"


def write_snapshot(
    directory: Path,
    version: int,
    state: dict[str, Any],
    meta: dict[str, Any],
    before_commit: Callable[[], None] | None = None,
) -> SnapshotInfo:
    """Writes and commits one snapshot; returns where it landed. Raises OSError on any I/O failure
    (the temporary directory is removed, committed snapshots are never touched).

    ``before_commit`` runs once everything is durable under the temporary name, just before the
    rename that commits it.
    """
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist (was it removed or unmounted?)")
    final = directory / snapshot_name(version)
    tmp = directory / f"{TMP_PREFIX}{final.name}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        tmp.mkdir()
        state_path = tmp / STATE_FILE
        with open(state_path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        created = time.time()
        manifest = {
            "format": FORMAT,
            "version": version,
            "created_unix": created,
            "files": {STATE_FILE: {"size": state_path.stat().st_size, "sha256": _sha256(state_path)}},
            **meta,
        }
        with open(tmp / MANIFEST_FILE, "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if before_commit is not None:
            before_commit()
        if final.exists():  # same version written again (e.g. on-demand right after periodic)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return SnapshotInfo(final, version, created, manifest["files"][STATE_FILE]["size"])


def write_json_durably(path: Path, data: Any) -> None:
    """Replaces ``path`` with ``data`` as JSON so that a crash leaves the old file or the new, never half."""
    tmp = path.with_name(f".{path.name}.tmp")  # one writer at a time (the caller holds a lock)
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_manifest(path: Path) -> dict[str, Any]:
    """Returns the manifest after checking every file against it; raises InvalidSnapshot."""
    manifest_path = path / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise InvalidSnapshot(f"{path} has no {MANIFEST_FILE} (incomplete write)") from None
    except (OSError, ValueError) as e:
        raise InvalidSnapshot(f"{manifest_path} is unreadable: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise InvalidSnapshot(f"{manifest_path} is not an {FORMAT} manifest")
    for name, expected in manifest.get("files", {}).items():
        file = path / name
        try:
            size = file.stat().st_size
        except OSError:
            raise InvalidSnapshot(f"{file} is missing") from None
        if size != expected["size"]:
            raise InvalidSnapshot(f"{file} is {size} bytes, manifest says {expected['size']} (truncated?)")
        if _sha256(file) != expected["sha256"]:
            raise InvalidSnapshot(f"{file} fails its SHA-256 checksum (corrupted)")
    return manifest


def load_snapshot(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, state) of a verified snapshot; never executes code from the file."""
    manifest = read_manifest(path)
    try:
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is unusable
        raise InvalidSnapshot(f"{path / STATE_FILE} cannot be loaded: {e}") from None
    return manifest, state


def list_snapshots(directory: Path) -> list[Path]:
    """Committed-looking snapshot directories, newest version first (validity not checked)."""
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit():
            found.append((int(p.name[len(PREFIX) :]), p))
    return [p for _, p in sorted(found, reverse=True)]


def leftover_tmp_dirs(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return [p for p in directory.iterdir() if p.name.startswith(TMP_PREFIX)]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
