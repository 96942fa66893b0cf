"""The cores this process may use: the least of its CPU affinity and its cgroup's CPU quota.

A container's CPU limit is a quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` over
``cpu.cfs_period_us``), not an affinity: a pod limited to 2 CPUs on a 64-core node still sees 64
cores in ``os.sched_getaffinity``, and a process that starts 64 compute threads there is throttled
for most of every period (Go's automaxprocs and the JVM's container support read the same files for
the same reason). The quota that binds is the smallest one on the path from this process's cgroup up
to the root of its hierarchy, so every level is read.

The cores are also named, as a **pool**: the processes that draw on the same cores have the same
pool, and only they divide them (rpcps.threads). A quota is its own pool, named by the cgroup that
sets it (its directory's device and inode, the same seen from any mount namespace): two containers
with CPU limits each have theirs, however many processes each runs, and a neighbour in another
container takes nothing from it. Without a quota the pool is the set of CPUs of the affinity: the
processes of a host (or of containers without limits that share the registry) on the same CPUs
divide them, and Slurm steps bound to disjoint cores do not count each other.

A fractional quota is rounded down (1.5 CPUs: 1 thread that is never throttled rather than 2 that are
for a third of every period), but never below 1.

What must not live here: who else shares the cores (rpcps.host_registry) or how they are divided
(rpcps.threads).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

UNREADABLE = "cgroups unreadable"
"""How ``quota_source`` begins when /proc/self/cgroup or mountinfo could not be read."""
QUOTA_SLACK = 0.01
"""A quota within this of a whole number of cores counts as that number (999m is meant as 1 CPU)."""


@dataclass(frozen=True)
class UsableCores:
    """How many cores this process may keep busy, and what limits it (for the log and ``ctl status``)."""

    cores: int
    affinity: int
    quota: float | None
    """The binding cgroup CPU quota in cores; None when no level of the hierarchy sets one."""
    quota_source: str
    """Where ``quota`` came from (``cgroup v2 cpu.max at /sys/fs/cgroup/...``), or why there is none."""
    pool: str = ""
    """Which cores these are (see the module docstring): ``cgroup DEV:INO`` or ``cpus HASH``; "" when unknown."""

    @property
    def unreadable(self) -> bool:
        """Whether the cgroup files could not be read (the cores then count the affinity only)."""
        return self.quota_source.startswith(UNREADABLE)

    def describe(self) -> str:
        quota = "no cgroup CPU quota" if self.quota is None else f"cgroup CPU quota {self.quota:g} cores"
        return f"{self.cores} usable cores (affinity {self.affinity}, {quota})"


def affinity_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity, which taskset, cpusets and Slurm narrow)."""
    try:
        return frozenset(os.sched_getaffinity(0)) or frozenset({0})
    except (AttributeError, OSError):  # not Linux
        return frozenset(range(max(1, os.cpu_count() or 1)))


def affinity_cores() -> int:
    """Cores this process may run on (its CPU affinity)."""
    return len(affinity_cpus())


def usable_cores(root: Path = Path("/"), affinity: int | None = None) -> UsableCores:
    """The least of the affinity and the cgroup quota (``root`` and ``affinity`` (CPUs 0..N-1) let tests
    point at fixture files)."""
    cpus = affinity_cpus() if affinity is None else frozenset(range(affinity))
    quota, source, directory = _binding_quota(root)
    cores = len(cpus) if quota is None else max(1, min(len(cpus), quota_cores(quota)))
    return UsableCores(cores, len(cpus), quota, source, _pool(cpus, directory))


def _pool(cpus: frozenset[int], quota_dir: Path | None) -> str:
    if quota_dir is not None:
        try:
            st = os.stat(quota_dir)
        except OSError:
            pass
        else:
            return f"cgroup {st.st_dev}:{st.st_ino}"
    # A hash keeps the registry entry small on a host of hundreds of CPUs.
    return "cpus " + hashlib.sha256(",".join(map(str, sorted(cpus))).encode()).hexdigest()[:16]


def quota_cores(quota: float) -> int:
    """Whole cores for a quota of ``quota`` CPUs: rounded down (see the module docstring), at least 1."""
    return max(1, math.floor(quota + QUOTA_SLACK))


def cgroup_quota(root: Path = Path("/")) -> tuple[float | None, str]:
    """(the binding CPU quota in cores or None, where it came from or why there is none).

    cgroup v2 is read first (``0::/path`` in /proc/self/cgroup); a v1 ``cpu`` controller is read when
    v2 sets no quota (hybrid hosts mount both; the quota lives in whichever has the cpu controller).
    """
    return _binding_quota(root)[:2]


def _binding_quota(root: Path) -> tuple[float | None, str, Path | None]:
    """``cgroup_quota`` and the directory of the cgroup whose quota binds (None without one)."""
    try:
        memberships = _memberships((root / "proc/self/cgroup").read_text())
        mounts = _mounts((root / "proc/self/mountinfo").read_text())
    except OSError as e:
        return None, f"{UNREADABLE} ({e.strerror or e})", None
    found: list[tuple[float, str, Path]] = []
    for version, controllers, path in memberships:
        for fstype, mount_root, mount_point, options in mounts:
            if version == 2 and fstype == "cgroup2":
                quota = _walk(root, mount_root, mount_point, path, _read_v2)
            elif version == 1 and fstype == "cgroup" and "cpu" in controllers and "cpu" in options:
                quota = _walk(root, mount_root, mount_point, path, _read_v1)
            else:
                continue
            if quota is not None:
                found.append(quota)
    if not found:
        return None, "no cgroup CPU quota", None
    return min(found, key=lambda q: q[0])


def _memberships(text: str) -> list[tuple[int, set[str], str]]:
    """(version, controllers, path) per line of /proc/self/cgroup (``0::/p`` is v2; ``4:cpu,cpuacct:/p`` v1)."""
    out = []
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        version = 2 if hid == "0" and controllers == "" else 1
        out.append((version, set(controllers.split(",")) if controllers else set(), path))
    return out


def _mounts(text: str) -> list[tuple[str, str, str, set[str]]]:
    """(fstype, root within the hierarchy, mount point, super options) of the cgroup mounts in mountinfo."""
    out = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if len(fields) < sep + 4 or sep < 5:
            continue
        fstype = fields[sep + 1]
        if fstype in ("cgroup", "cgroup2"):
            out.append((fstype, _unescape(fields[3]), _unescape(fields[4]), set(fields[sep + 3].split(","))))
    return out


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline and backslash in a path as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _walk(
    root: Path, mount_root: str, mount_point: str, path: str, read: Callable[[Path], tuple[float, str] | None]
) -> tuple[float, str, Path] | None:
    """The smallest quota from this process's cgroup up to the mount's root, with its directory, or None.

    In a container the mount's root is the container's own cgroup (``/`` inside), and the path in
    /proc/self/cgroup may name the host's full path; when it is not under the mount's root, the mount
    point itself is the process's cgroup (what a container runtime mounts).
    """
    base = root / mount_point.lstrip("/")
    rel = os.path.relpath(path, mount_root) if path.startswith(mount_root) else "."
    if rel.startswith(".."):
        rel = "."
    directory = Path(os.path.normpath(base / rel))
    if not directory.is_dir():
        directory = base
    best: tuple[float, str, Path] | None = None
    while True:
        quota = read(directory)
        if quota is not None and (best is None or quota[0] < best[0]):
            best = (*quota, directory)
        if directory == base or base not in directory.parents:
            return best
        directory = directory.parent


def _read_v2(directory: Path) -> tuple[float, str] | None:
    """``cpu.max`` is "QUOTA PERIOD" in microseconds, or "max PERIOD" for no limit."""
    try:
        fields = (directory / "cpu.max").read_text().split()
    except OSError:
        return None
    if not fields or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1]) if len(fields) > 1 else 100_000
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period, f"cgroup v2 cpu.max {quota}/{period} at {directory}"


def _read_v1(directory: Path) -> tuple[float, str] | None:
    """``cpu.cfs_quota_us`` is -1 for no limit; ``cpu.cfs_period_us`` the period it is measured over."""
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text().strip())
        period = int((directory / "cpu.cfs_period_us").read_text().strip())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period, f"cgroup v1 cpu.cfs_quota_us {quota}/{period} at {directory}"
