"""The usable cores: the least of the affinity and the cgroup CPU quota, read from fixture file trees
laid out as /proc/self and /sys/fs/cgroup are (cgroup v2, v1, hybrid, containers, missing files)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rpcps.cpu_limits import cgroup_quota, quota_cores, usable_cores

V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
V1_CPU_MOUNT = "35 25 0:30 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:10 - cgroup cgroup rw,cpu,cpuacct\n"
V1_MEMORY_MOUNT = "36 25 0:31 / /sys/fs/cgroup/memory rw,nosuid shared:11 - cgroup cgroup rw,memory\n"


def tree(tmp_path: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    (tmp_path / "proc/self/mountinfo").write_text(mountinfo)
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    return tmp_path


def test_v2_quota(tmp_path: Path) -> None:
    root = tree(tmp_path, "0::/kubepods/pod1\n", V2_MOUNT, {"sys/fs/cgroup/kubepods/pod1/cpu.max": "200000 100000\n"})
    quota, source = cgroup_quota(root)
    assert quota == 2.0 and "cgroup v2 cpu.max 200000/100000" in source
    assert usable_cores(root, affinity=64).cores == 2


def test_v2_max_is_no_limit(tmp_path: Path) -> None:
    root = tree(tmp_path, "0::/user.slice\n", V2_MOUNT, {"sys/fs/cgroup/user.slice/cpu.max": "max 100000\n"})
    assert cgroup_quota(root) == (None, "no cgroup CPU quota")
    assert usable_cores(root, affinity=8).cores == 8


def test_v2_a_parents_smaller_quota_binds(tmp_path: Path) -> None:
    root = tree(tmp_path, "0::/job/step\n", V2_MOUNT, {
        "sys/fs/cgroup/job/cpu.max": "150000 100000\n",
        "sys/fs/cgroup/job/step/cpu.max": "max 100000\n",
    })
    assert cgroup_quota(root)[0] == 1.5
    assert usable_cores(root, affinity=4).cores == 1  # 1.5 CPUs: one thread that is never throttled


def test_v2_in_a_container_whose_path_names_the_hosts_cgroup(tmp_path: Path) -> None:
    # Inside a container the cgroup mount is the container's own cgroup, while /proc/self/cgroup may
    # still name the host's path: the mount point itself is read.
    root = tree(tmp_path, "0::/../../kubepods/podX\n", V2_MOUNT, {"sys/fs/cgroup/cpu.max": "50000 100000\n"})
    assert cgroup_quota(root)[0] == 0.5
    assert usable_cores(root, affinity=16).cores == 1  # never below one


def test_v1_quota(tmp_path: Path) -> None:
    root = tree(tmp_path, "5:memory:/slurm/job1\n4:cpu,cpuacct:/slurm/job1\n", V1_CPU_MOUNT + V1_MEMORY_MOUNT, {
        "sys/fs/cgroup/cpu,cpuacct/slurm/job1/cpu.cfs_quota_us": "300000\n",
        "sys/fs/cgroup/cpu,cpuacct/slurm/job1/cpu.cfs_period_us": "100000\n",
    })
    quota, source = cgroup_quota(root)
    assert quota == 3.0 and "cgroup v1 cpu.cfs_quota_us 300000/100000" in source
    assert usable_cores(root, affinity=2).cores == 2  # the affinity binds here


def test_v1_minus_one_is_no_limit(tmp_path: Path) -> None:
    root = tree(tmp_path, "4:cpu,cpuacct:/\n", V1_CPU_MOUNT, {
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })
    assert cgroup_quota(root)[0] is None


def test_hybrid_v1_cpu_controller_with_an_empty_v2_hierarchy(tmp_path: Path) -> None:
    root = tree(tmp_path, "4:cpu,cpuacct:/a\n0::/a\n", V1_CPU_MOUNT + V2_MOUNT.replace("/sys/fs/cgroup ", "/sys/fs/cgroup/unified "), {
        "sys/fs/cgroup/cpu,cpuacct/a/cpu.cfs_quota_us": "100000\n",
        "sys/fs/cgroup/cpu,cpuacct/a/cpu.cfs_period_us": "100000\n",
        "sys/fs/cgroup/unified/a/cgroup.procs": "",
    })
    assert cgroup_quota(root)[0] == 1.0


@pytest.mark.parametrize("files", [{}, {"sys/fs/cgroup/a/cpu.max": ""}, {"sys/fs/cgroup/a/cpu.max": "garbage 100000"}])
def test_missing_or_unreadable_files_mean_no_limit(tmp_path: Path, files: dict[str, str]) -> None:
    root = tree(tmp_path, "0::/a\n", V2_MOUNT, files)
    assert cgroup_quota(root)[0] is None


def test_no_proc_files_at_all(tmp_path: Path) -> None:
    quota, source = cgroup_quota(tmp_path)
    assert quota is None and source.startswith("cgroups unreadable")
    assert usable_cores(tmp_path, affinity=3).cores == 3


@pytest.mark.parametrize(("quota", "cores"), [(0.2, 1), (0.999, 1), (1.0, 1), (1.5, 1), (1.995, 2), (2.0, 2), (63.9, 63)])
def test_rounding(quota: float, cores: int) -> None:
    assert quota_cores(quota) == cores


def test_this_machine_reads_without_error() -> None:
    usable = usable_cores()
    assert 1 <= usable.cores <= usable.affinity
    assert "usable cores" in usable.describe()


def test_the_pool_names_the_cgroup_whose_quota_binds_or_else_the_cpus(tmp_path: Path) -> None:
    pod1 = tree(tmp_path / "a", "0::/kubepods/pod1\n", V2_MOUNT, {"sys/fs/cgroup/kubepods/pod1/cpu.max": "200000 100000\n"})
    pod2 = tree(tmp_path / "b", "0::/kubepods/pod2\n", V2_MOUNT, {"sys/fs/cgroup/kubepods/pod2/cpu.max": "200000 100000\n"})
    binding = (pod1 / "sys/fs/cgroup/kubepods/pod1").stat()
    assert usable_cores(pod1, affinity=64).pool == f"cgroup {binding.st_dev}:{binding.st_ino}"
    assert usable_cores(pod1, affinity=64).pool == usable_cores(pod1, affinity=8).pool, "a quota is its own pool, whatever the CPUs"
    assert usable_cores(pod1, affinity=64).pool != usable_cores(pod2, affinity=64).pool, "two pods' limits are two pools"
    unlimited = tree(tmp_path / "c", "0::/user.slice\n", V2_MOUNT, {"sys/fs/cgroup/user.slice/cpu.max": "max 100000\n"})
    assert usable_cores(unlimited, affinity=8).pool.startswith("cpus ")
    assert usable_cores(unlimited, affinity=8).pool == usable_cores(unlimited, affinity=8).pool
    assert usable_cores(unlimited, affinity=8).pool != usable_cores(unlimited, affinity=4).pool, "other CPUs, another pool"
