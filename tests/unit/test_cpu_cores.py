"""shoal.cpu_cores: the cgroup holding a process's CPU quota (v1 and v2, from /proc text), the
quota read along its path, and the cores a process may use."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shoal import cpu_cores
from shoal.cpu_cores import CpuCgroup, cpu_cgroups, cpu_quota_cores, read_quota

V1_CGROUP = "12:pids:/\n4:cpu,cpuacct:/kubepods/pod1/ctr\n1:name=systemd:/\n0::/\n"
V1_MOUNTINFO = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
    "33 31 0:30 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset\n")
V2_CGROUP = "0::/kubepods.slice/ctr.scope\n"
V2_MOUNTINFO = "30 22 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def test_v1_finds_the_cpu_controllers_cgroup_under_its_mount() -> None:
    assert cpu_cgroups(V1_CGROUP, V1_MOUNTINFO) == [CpuCgroup(
        Path("/sys/fs/cgroup/cpu,cpuacct/kubepods/pod1/ctr"), Path("/sys/fs/cgroup/cpu,cpuacct"),
        1)]


def test_v2_finds_the_unified_cgroup() -> None:
    assert cpu_cgroups(V2_CGROUP, V2_MOUNTINFO) == [CpuCgroup(
        Path("/sys/fs/cgroup/kubepods.slice/ctr.scope"), Path("/sys/fs/cgroup"), 2)]


def test_a_namespaced_mount_root_is_the_process_cgroup() -> None:
    """In a container with its own cgroup namespace the mount's root is the cgroup itself."""
    mountinfo = "30 22 0:26 /kubepods.slice/ctr.scope /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    assert cpu_cgroups(V2_CGROUP, mountinfo) == [
        CpuCgroup(Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup"), 2)]


def test_no_cpu_cgroup_without_the_controller_mounted() -> None:
    mountinfo = "33 31 0:30 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset\n"
    assert cpu_cgroups(V1_CGROUP, mountinfo) == []


def _v1(directory: Path, quota_us: int, period_us: int = 100_000) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
    (directory / "cpu.cfs_period_us").write_text(f"{period_us}\n")


def test_quotas_in_both_formats(tmp_path: Path) -> None:
    _v1(tmp_path / "v1", 150_000)
    _v1(tmp_path / "v1-none", -1)
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "cpu.max").write_text("250000 100000\n")
    (tmp_path / "v2-none").mkdir()
    (tmp_path / "v2-none" / "cpu.max").write_text("max 100000\n")
    assert read_quota(tmp_path / "v1", 1) == 1.5
    assert read_quota(tmp_path / "v2", 2) == 2.5
    assert read_quota(tmp_path / "v1-none", 1) is None
    assert read_quota(tmp_path / "v2-none", 2) is None
    assert read_quota(tmp_path / "missing", 2) is None


def test_the_smallest_quota_along_the_path_binds(tmp_path: Path) -> None:
    mount = tmp_path / "cpu"
    _v1(mount, -1)
    _v1(mount / "pod", 100_000)          # the pod: 1 core
    _v1(mount / "pod" / "ctr", 300_000)  # the container asks for more than its pod has
    assert cpu_quota_cores([CpuCgroup(mount / "pod" / "ctr", mount, 1)]) == 1.0
    assert cpu_quota_cores([CpuCgroup(mount, mount, 1)]) is None


@pytest.mark.parametrize(("quota", "expected"), [(None, 2), (1.5, 1), (0.5, 1), (8.0, 2)])
def test_usable_cores_is_the_affinity_cut_to_the_quota(monkeypatch: pytest.MonkeyPatch,
                                                      quota: float | None, expected: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(cpu_cores, "cpu_quota_cores", lambda cgroups: quota)
    assert cpu_cores.usable_cores() == expected
