"""The host's registry of live rpcps processes: a killed process drops out by its lock, whatever killed it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rpcps.host_registry import RECORD_BYTES, Entry, HostRegistry, default_dir, read_live

REPO = Path(__file__).resolve().parents[3]
CHILD = """
import os, sys, time
from pathlib import Path
from rpcps.host_registry import Entry, HostRegistry
HostRegistry(Path(sys.argv[1]), Entry(pid=os.getpid(), role="worker", kind="compute", started=time.time(), use=1.0, threads=1))
print("registered", flush=True)
time.sleep(120)
"""


def entry(role: str = "server") -> Entry:
    return Entry(pid=os.getpid(), role=role, kind="light", started=time.time(), use=0.1, threads=1)


@pytest.mark.timeout(60)
def test_a_killed_process_drops_out_and_its_file_is_removed(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "registered"
        assert [e.pid for e in read_live(tmp_path).values()] == [child.pid]
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        assert read_live(tmp_path) == {}
        assert os.listdir(tmp_path) == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)


def test_entries_are_seen_updated_and_left(tmp_path: Path) -> None:
    mine = HostRegistry(tmp_path, entry("server"))
    other = HostRegistry(tmp_path, entry("store"))
    try:
        assert sorted(e.role for e in mine.entries().values()) == ["server", "store"]
        other.publish(Entry(**{**other.entry.__dict__, "use": 0.7}))
        assert read_live(tmp_path)[other.path.name].use == 0.7
    finally:
        other.close()
    assert [e.role for e in mine.entries().values()] == ["server"]
    mine.close()
    assert os.listdir(tmp_path) == []


def test_a_torn_or_foreign_file_is_skipped_not_fatal(tmp_path: Path) -> None:
    mine = HostRegistry(tmp_path, entry())
    try:
        os.pwrite(mine._fd, b'{"pid": 1, "ro'.ljust(RECORD_BYTES), 0)  # what a reader may catch mid-write
        assert read_live(tmp_path) == {}
        assert mine.path.exists()  # still locked by us: alive, just unreadable this round
    finally:
        mine.close()


def test_an_entry_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        Entry(pid=1, role="x" * RECORD_BYTES, kind="light", started=0.0, use=0.0, threads=1).to_bytes()


def test_the_directory(tmp_path: Path) -> None:
    assert default_dir({"XDG_RUNTIME_DIR": str(tmp_path)}) == tmp_path / "rpcps"
    assert default_dir({"XDG_RUNTIME_DIR": str(tmp_path / "missing")}) == Path(f"/tmp/rpcps-{os.getuid()}")
    HostRegistry(tmp_path / "new", entry()).close()
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o700
