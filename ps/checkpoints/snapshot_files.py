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

Reading trusts nothing the directory says: a manifest may name only plain file names (no ``/``, no
``..``), and every file is opened without following links and must be a regular file, so a
planted manifest or link cannot make resume read another file, or hang on a device or a FIFO. A
manifest may carry an HMAC (``sign``/``verify``, keyed by the job secret) so that a snapshot written
by someone without the secret is told apart from this job's own.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import torch

from rpcps.model_file import fsync_dir

logger = logging.getLogger(__name__)

FORMAT = "rpcps-snapshot-v1"
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
FINISHED_FILE = "finished.json"
"""Beside the snapshots: the worker slots that finished and their step counts (outlives any one snapshot)."""
PREFIX = "step-"
TMP_PREFIX = ".tmp-"
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
"""A manifest is a few KB; a bigger one is not ours (and is not read into memory)."""
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")

Signer = Callable[[dict[str, Any]], str]
"""Computes a manifest's HMAC (``rpcps.jobsecret.JobSecret.manifest_signature``)."""


class InvalidSnapshot(ValueError):
    """A snapshot directory that must be treated as absent (the message says why)."""


class UnsignedSnapshot(InvalidSnapshot):
    """A valid snapshot without a signature, read by a server that requires signed ones.

    Not treated as damaged: it may well be this job's own, written before signing was turned on.
    """


def is_plain_name(name: object) -> bool:
    """A file name inside the snapshot directory: no path separator, no '..', no leading dot."""
    return isinstance(name, str) and _PLAIN_NAME.fullmatch(name) is not None


@contextmanager
def open_regular(path: Path) -> Iterator[IO[bytes]]:
    """Opens ``path`` for reading only if it is a regular file and not a symbolic link.

    Raises InvalidSnapshot otherwise (a link, a directory, a device, a FIFO: opening a FIFO without
    O_NONBLOCK would wait for a writer forever) or when it cannot be opened.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidSnapshot(f"{path} is missing") from None
    except OSError as e:
        raise InvalidSnapshot(f"{path} cannot be opened as a regular file: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidSnapshot(f"{path} is not a regular file")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


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
    sign: Signer | None = None,
    extra_files: dict[str, Any] | None = None,
) -> SnapshotInfo:
    """Writes and commits one snapshot; returns where it landed. Raises OSError on any I/O failure
    (the temporary directory is removed, committed snapshots are never touched).

    ``before_commit`` runs once everything is durable under the temporary name, just before the
    rename that commits it. ``sign`` adds the manifest's HMAC (field ``hmac``). ``extra_files``:
    more files (plain name -> object, ``torch.save``d) listed and checksummed like ``state.pt``.
    """
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist (was it removed or unmounted?)")
    final = directory / snapshot_name(version)
    tmp = _tmp_path(final)
    replaced: Path | None = None
    try:
        tmp.mkdir()
        files = {}
        for name, obj in {STATE_FILE: state, **(extra_files or {})}.items():
            if not is_plain_name(name):
                raise ValueError(f"snapshot file name {name!r} is not a plain file name")
            files[name] = _save(tmp / name, obj)
        created = time.time()
        manifest = {"format": FORMAT, "version": version, "created_unix": created, "files": files, **meta}
        if sign is not None:
            manifest["hmac"] = sign(manifest)
        with open(tmp / MANIFEST_FILE, "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if before_commit is not None:
            before_commit()
        if final.exists():  # same version written again (e.g. on demand right after a periodic one)
            # Renamed aside, deleted only once the new copy is in place: a reader, a crash or a failed
            # rename between the two renames finds the old copy whole or no step-V at all (so the
            # snapshot before it), never one half-deleted (deleting it in place did: CI run 34).
            # A crash in the microseconds between the two renames still loses version V (resumed from
            # the one before; docs/FAULT_TOLERANCE.md, "Crash consistency").
            replaced = _tmp_path(final)
            os.rename(final, replaced)
        try:
            os.rename(tmp, final)
        except BaseException:
            if replaced is not None:
                _put_back(replaced, final)
            raise
        try:
            fsync_dir(directory)
        finally:  # committed: the old copy goes even when the fsync fails (else each failure kept one more)
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once committed
        raise
    return SnapshotInfo(final, version, created, sum(f["size"] for f in files.values()))


def _put_back(replaced: Path, final: Path) -> None:
    """Renames a version's old copy back after its replacement failed to commit. If even that fails,
    says where it is and lets the commit's own error through: the purge of a later process would
    take the copy for a dead writer's leftover."""
    try:
        os.rename(replaced, final)
    except OSError as e:
        logger.error("could not rename the old snapshot %s back to %s (%s): rename it by hand before the server "
                     "restarts, or this version is lost", replaced, final, e)


def _tmp_path(final: Path) -> Path:
    """A unique temporary name beside ``final``, holding this process's pid (the purge leaves a live
    writer's alone)."""
    return final.parent / f"{TMP_PREFIX}{final.name}-{os.getpid()}-{time.monotonic_ns()}"


def _save(path: Path, obj: Any) -> dict[str, Any]:
    """Writes ``obj`` durably to ``path``; returns its manifest entry (size and SHA-256)."""
    h = hashlib.sha256()
    with open(path, "wb") as f:
        torch.save(obj, cast(IO[bytes], _Hashing(f, h)))  # write and flush are all torch.save uses
        f.flush()
        os.fsync(f.fileno())
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


class _Hashing:
    """A write-only file that hashes what passes through it: the checksum costs no second read of
    the file (for a sparse full of hundreds of MB, that re-read was a third of the write's time)."""

    def __init__(self, f: IO[bytes], h: Any) -> None:
        self._f, self._h = f, h

    def write(self, data: bytes) -> int:
        self._h.update(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def write_json_durably(path: Path, data: Any) -> None:
    """Replaces ``path`` with ``data`` as JSON so that a crash leaves the old file or the new, never half."""
    tmp = path.with_name(f".{path.name}.tmp")  # one writer at a time (the caller holds a lock)
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def peek_manifest(path: Path) -> dict[str, Any]:
    """The manifest of snapshot ``path`` without checking its files (cheap; for bookkeeping such as
    which snapshots a chain needs, never for loading). Raises InvalidSnapshot."""
    manifest_path = path / MANIFEST_FILE
    try:
        with open_regular(manifest_path) as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except InvalidSnapshot as e:
        if not manifest_path.exists() and not manifest_path.is_symlink():
            raise InvalidSnapshot(f"{path} has no {MANIFEST_FILE} (incomplete write)") from None
        raise InvalidSnapshot(f"{manifest_path} is unreadable: {e}") from None
    except OSError as e:
        raise InvalidSnapshot(f"{manifest_path} is unreadable: {e}") from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise InvalidSnapshot(f"{manifest_path} is larger than {MAX_MANIFEST_BYTES} bytes: not an rpcps manifest")
    try:
        manifest = json.loads(raw)
    except ValueError as e:
        raise InvalidSnapshot(f"{manifest_path} is unreadable: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files", {}), dict):
        raise InvalidSnapshot(f"{manifest_path} is not an {FORMAT} manifest")
    return manifest


def read_manifest(path: Path, verify: Signer | None = None) -> dict[str, Any]:
    """Returns the manifest after checking every file against it; raises InvalidSnapshot.

    With ``verify``, the manifest must carry the HMAC ``verify`` computes: UnsignedSnapshot when it
    has none, InvalidSnapshot when it does not match.
    """
    manifest = peek_manifest(path)
    manifest_path = path / MANIFEST_FILE
    if verify is not None:
        if "hmac" not in manifest:
            raise UnsignedSnapshot(f"{manifest_path} is not signed")
        if not isinstance(manifest["hmac"], str) or not hmac.compare_digest(verify(manifest), manifest["hmac"]):
            raise InvalidSnapshot(f"{manifest_path} is not signed with this job's secret (written elsewhere, or altered)")
    for name, expected in manifest.get("files", {}).items():
        if not is_plain_name(name) or not isinstance(expected, dict):
            raise InvalidSnapshot(f"{manifest_path} names {name!r}, which is not a plain file name in the snapshot")
        file = path / name
        with open_regular(file) as f:
            size = os.fstat(f.fileno()).st_size
            if size != expected.get("size"):
                raise InvalidSnapshot(f"{file} is {size} bytes, manifest says {expected.get('size')} (truncated?)")
            if _sha256(f) != expected.get("sha256"):
                raise InvalidSnapshot(f"{file} fails its SHA-256 checksum (corrupted)")
    return manifest


def load_snapshot(path: Path, verify: Signer | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, state) of a verified snapshot; never executes code from the file."""
    manifest = read_manifest(path, verify)
    if STATE_FILE not in manifest.get("files", {}):
        raise InvalidSnapshot(f"{path / MANIFEST_FILE} does not list {STATE_FILE}")
    return manifest, load_file(path / STATE_FILE)


def load_file(path: Path, mmap: bool = False) -> Any:
    """One file of a snapshot, loaded with ``weights_only=True`` (no code runs); raises InvalidSnapshot.
    Check it against its manifest first (``read_manifest``). ``mmap``: its tensors are mapped from the
    file, read-only, instead of read into memory (pages load as they are touched)."""
    try:
        with open_regular(path) as f:
            if mmap:  # torch maps by path; open_regular has checked it is a regular file, not a link
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            return torch.load(f, map_location="cpu", weights_only=True)
    except InvalidSnapshot:
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is unusable
        raise InvalidSnapshot(f"{path} cannot be loaded: {e}") from None


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


def _sha256(source: Path | IO[bytes]) -> str:
    if isinstance(source, Path):
        with open(source, "rb") as f:
            return _sha256(f)
    h = hashlib.sha256()
    while block := source.read(1 << 22):
        h.update(block)
    return h.hexdigest()


