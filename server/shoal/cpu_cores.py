"""How many CPU cores this process may use: the CPUs it may run on (its affinity, a cpuset), cut
to its cgroup's CPU quota where one is set (a container's CPU limit: Kubernetes'
`resources.limits.cpu`, `docker run --cpus`). `os.cpu_count()` counts the host's cores, and
threads sized to those beside a quota of fewer cores are throttled at every barrier.

cgroup v2 keeps the quota in `cpu.max` ("QUOTA PERIOD" or "max PERIOD"), v1 in
`cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1: none); a cgroup's limit also binds its
descendants, so the smallest along the path from the process's cgroup to its mount's root holds.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
PROC_MOUNTINFO = Path("/proc/self/mountinfo")


@dataclass(frozen=True)
class CpuCgroup:
    directory: Path   # the process's cgroup under the mount
    mount_point: Path
    version: int      # 1 or 2


def usable_cores() -> int:
    """Cores this process may keep busy at once: at least one."""
    cores = len(os.sched_getaffinity(0))
    quota = cpu_quota_cores(cpu_cgroups(PROC_CGROUP.read_text(), PROC_MOUNTINFO.read_text()))
    return max(1, min(cores, math.floor(quota))) if quota is not None else cores


def cpu_quota_cores(cgroups: list[CpuCgroup]) -> float | None:
    """The smallest CPU quota, in cores, along the paths of `cgroups`; None where none is set."""
    quotas = []
    for cgroup in cgroups:
        directory = cgroup.directory
        while True:
            quota = read_quota(directory, cgroup.version)
            if quota is not None:
                quotas.append(quota)
            if directory == cgroup.mount_point or directory == directory.parent:
                break
            directory = directory.parent
    return min(quotas, default=None)


def read_quota(directory: Path, version: int) -> float | None:
    """The quota set on one cgroup directory, in cores; None: none, or not readable."""
    try:
        if version == 2:
            quota, period = (directory / "cpu.max").read_text().split()
            return None if quota == "max" else int(quota) / int(period)
        quota_us = int((directory / "cpu.cfs_quota_us").read_text())
        period_us = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 else quota_us / period_us


def cpu_cgroups(proc_cgroup: str, mountinfo: str) -> list[CpuCgroup]:
    """The process's cgroups that can hold a CPU quota (v1's `cpu` controller, v2's unified
    hierarchy), from the text of /proc/self/cgroup and /proc/self/mountinfo."""
    paths: dict[str, str] = {}  # "cpu" (v1) or "" (v2) -> the cgroup path
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "" or "cpu" in controllers.split(","):
            paths["cpu" if controllers else ""] = path
    found = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        root, mount_point, fstype = fields[3], Path(fields[4]), fields[dash + 1]
        if fstype == "cgroup2" and "" in paths:
            version, path = 2, paths[""]
        elif fstype == "cgroup" and "cpu" in fields[dash + 3].split(",") and "cpu" in paths:
            version, path = 1, paths["cpu"]
        else:
            continue
        relative = os.path.relpath(path, root) if path.startswith(root) else "."
        found.append(CpuCgroup(mount_point / relative, mount_point, version))
    return found
