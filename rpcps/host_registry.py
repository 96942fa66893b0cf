"""The rpcps processes alive on this host: one small file per process in a per-user directory.

Every rpcps process (any job, any role, however started: ``local``, torchrun, by hand, systemd,
Slurm) writes ``<dir>/<pid>-<random>.json`` holding its pid, role, start time, CPU use, threads and
the pool of cores it draws on,
and holds an exclusive ``flock`` on that file for as long as it lives. The kernel drops the lock when
the process ends, however it ends (SIGKILL and OOM included), so a file whose lock can be taken
belongs to a dead process: readers skip it and delete it. A lock rather than a pid check, because
pids are reused and are not comparable across pid namespaces (containers that share the directory
through a volume still share the kernel's locks).

A file is created under a dot-name, locked, filled and only then renamed into place, so a reader
never sees a live process's file unlocked. Updates rewrite the locked file in place with one
``pwrite`` of a fixed size; a reader that catches half of one skips that entry for that round.

The directory: ``--host-dir`` (``RPCPS_HOST_DIR``) when set (a volume shared by the containers of one
host, as the Compose recipe does), else ``$XDG_RUNTIME_DIR/rpcps`` when that exists, else ``/tmp/rpcps-<uid>``; created
mode 0700. Processes of other users are not seen (their files are not ours to read).

What must not live here: what the entries are used for (rpcps.threads divides the cores).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

RECORD_BYTES = 512
"""Every entry is written padded to this size, in one pwrite."""


@dataclass(frozen=True)
class Entry:
    """What one process says about itself."""

    pid: int
    role: str
    """server, worker, store, evaluator (a worker on a GPU is ``worker`` with ``kind`` light)."""
    kind: str
    """compute (its intra-op threads do the heavy work), light (it mostly waits or feeds a device), or
    pinned (its threads were set by --threads or OMP_NUM_THREADS and do not follow the host)."""
    started: float
    """Unix time the process started."""
    use: float
    """Cores the process kept busy lately (all its threads, a moving average)."""
    threads: int
    """Its intra-op threads now."""
    pool: str = ""
    """Which cores it draws on (rpcps.cpu_limits ``UsableCores.pool``): only processes of one pool divide
    them. "" (a process that does not say) is counted by everyone."""

    def to_bytes(self) -> bytes:
        data = json.dumps(asdict(self), separators=(",", ":")).encode()
        if len(data) > RECORD_BYTES:
            raise ValueError(f"registry entry of {len(data)} bytes exceeds {RECORD_BYTES}")
        return data.ljust(RECORD_BYTES)

    @classmethod
    def from_bytes(cls, data: bytes) -> Entry:
        raw = json.loads(data.decode().strip())
        return cls(
            pid=int(raw["pid"]), role=str(raw["role"]), kind=str(raw["kind"]), started=float(raw["started"]),
            use=float(raw["use"]), threads=int(raw["threads"]), pool=str(raw.get("pool", "")),
        )


def default_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The directory when ``--host-dir`` (``RPCPS_HOST_DIR``) does not name one."""
    environ = os.environ if environ is None else environ
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "rpcps"
    return Path(f"/tmp/rpcps-{os.getuid()}")


class HostRegistry:
    """This process's entry in the host's registry, and a view of everyone else's."""

    def __init__(self, directory: Path, entry: Entry) -> None:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory = directory
        name = f"{entry.pid}-{secrets.token_hex(4)}"
        tmp = directory / f".{name}.tmp"
        self.path = directory / f"{name}.json"
        self._fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            os.pwrite(self._fd, entry.to_bytes(), 0)
            os.rename(tmp, self.path)
        except BaseException:
            os.close(self._fd)
            tmp.unlink(missing_ok=True)
            raise
        self.entry = entry

    def publish(self, entry: Entry) -> None:
        """Replaces this process's entry (one write of a fixed size: a reader sees the old or the new one, or skips it)."""
        os.pwrite(self._fd, entry.to_bytes(), 0)
        self.entry = entry

    def entries(self) -> dict[str, Entry]:
        """Every live process's entry by file name, this one's included; removes the files of dead ones."""
        return read_live(self.directory, own=self.path.name, own_entry=self.entry)

    def close(self) -> None:
        """Leaves the registry (a process that dies without calling this is dropped by its lock)."""
        if self._fd >= 0:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = -1


def read_live(directory: Path, own: str | None = None, own_entry: Entry | None = None) -> dict[str, Entry]:
    """The live entries of ``directory`` (``own`` is answered from memory: its lock is ours).

    Raises:
        OSError: the directory cannot be listed (the caller says so and counts it: rpcps.threads).
    """
    out: dict[str, Entry] = {}
    names = os.listdir(directory)
    for name in names:
        if not name.endswith(".json"):
            if name.startswith(".") and name.endswith(".tmp"):
                _remove_abandoned(directory / name)
            continue
        if name == own and own_entry is not None:
            out[name] = own_entry
            continue
        entry = _read_if_live(directory / name)
        if entry is not None:
            out[name] = entry
    return out


def _read_if_live(path: Path) -> Entry | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None  # removed since the listing
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held: its process is alive
            try:
                return Entry.from_bytes(os.pread(fd, RECORD_BYTES, 0))
            except (ValueError, KeyError, TypeError, UnicodeDecodeError):
                return None  # caught mid-write, or not ours: next round
        path.unlink(missing_ok=True)  # nobody holds it: its process is gone
        return None
    finally:
        os.close(fd)


def _remove_abandoned(path: Path) -> None:
    """A dot-file left by a process that died between creating and renaming it (older than a minute)."""
    try:
        if time.time() - path.stat().st_mtime > 60:
            fd = os.open(path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                path.unlink(missing_ok=True)
            except BlockingIOError:
                pass
            finally:
                os.close(fd)
    except OSError:
        pass
