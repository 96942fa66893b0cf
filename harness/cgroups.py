"""CPU-quota cgroups made on the spot, for tests and benchmarks that run a process under a CPU limit.

Needs root and a writable CPU hierarchy: cgroup v2 with the ``cpu`` controller enabled for children,
or a v1 ``cpu`` hierarchy (this development machine has v1). ``cpu_quota_cgroup`` raises
``CgroupUnavailable`` elsewhere, for the caller to skip. A process enters the group by running under
``enter_argv`` (a shell that writes its own pid into the group, then execs the command), so the
limit holds from its first instruction.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


class CgroupUnavailable(Exception):
    """No CPU cgroup can be made here (not root, no writable CPU hierarchy); says why."""


def _parent() -> tuple[Path, str]:
    if os.geteuid() != 0:
        raise CgroupUnavailable("making a cgroup needs root")
    v2 = Path("/sys/fs/cgroup")
    try:
        if (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.subtree_control").read_text().split():
            return v2, "v2"
    except OSError:
        pass
    for v1 in (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpu,cpuacct")):
        if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK):
            return v1, "v1"
    raise CgroupUnavailable("no writable CPU cgroup hierarchy (v2 with the cpu controller, or v1 cpu)")


@contextmanager
def cpu_quota_cgroup(cores: float, empty_timeout_s: float = 30.0) -> Iterator[Path]:
    """A fresh cgroup limited to ``cores`` CPUs (period 100 ms), removed on exit once its processes are gone.

    Raises:
        CgroupUnavailable: when it cannot be made here.
    """
    parent, version = _parent()
    group = parent / f"rpcps-{uuid.uuid4().hex[:8]}"
    quota = max(1000, int(cores * 100_000))
    try:
        group.mkdir()
        if version == "v2":
            (group / "cpu.max").write_text(f"{quota} 100000\n")
        else:
            (group / "cpu.cfs_period_us").write_text("100000\n")
            (group / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    except OSError as e:
        if group.exists():
            group.rmdir()
        raise CgroupUnavailable(f"cannot make a CPU cgroup under {parent}: {e}") from e
    try:
        yield group
    finally:
        # The caller ends its processes first; a group can be removed only once it is empty.
        deadline = time.monotonic() + empty_timeout_s
        while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)
        group.rmdir()


def enter_argv(group: Path, argv: Sequence[str]) -> list[str]:
    """``argv`` run inside ``group`` (from its first instruction on)."""
    return ["sh", "-c", 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"', "sh", str(group), *argv]
