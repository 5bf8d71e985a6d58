"""A container's CPU limit, applied as the real kubelet applies it: each run in a cgroup of its
own whose CFS quota is `resources.limits.cpu` (v1 `cpu.cfs_quota_us`, v2 `cpu.max`), a child of
this kubelet's own cgroup (on v2 only where that one passes `cpu` to its children), removed
when the run has ended. Containers without a CPU limit run where the kubelet runs."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from shoal.cpu_cores import PROC_CGROUP, PROC_MOUNTINFO, cpu_cgroups
from tests.support.kube.kubelet.environment import ContainerConfigError

logger = logging.getLogger("kubelet.cpu_limit")

PERIOD_US = 100_000  # the kubelet's CFS period
RUN_CGROUP_PREFIX = "shoal-test-run-"
REMOVE_WAIT_S = 5.0  # a run's last processes leave its cgroup a moment after PID 1 has died


def cpu_limit_cores(container: dict[str, Any]) -> float | None:
    """`resources.limits.cpu` in cores ("2", "1.5", "500m"); None when the container has none."""
    quantity = str(((container.get("resources") or {}).get("limits") or {}).get("cpu", ""))
    if not quantity:
        return None
    try:
        cores = int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)
    except ValueError:
        raise ContainerConfigError(
            f"resources.limits.cpu {quantity!r} is not a CPU quantity") from None
    if cores <= 0:
        raise ContainerConfigError(f"resources.limits.cpu {quantity!r} is not positive")
    return cores


def create_cgroup(cores: float) -> Path:
    """A new cgroup with a quota of `cores` CPUs; its `cgroup.procs` takes the run's first
    process."""
    for cgroup in cpu_cgroups(PROC_CGROUP.read_text(), PROC_MOUNTINFO.read_text()):
        if cgroup.version == 2 and "cpu" not in _controllers(cgroup.directory):
            continue
        directory = cgroup.directory / f"{RUN_CGROUP_PREFIX}{uuid.uuid4().hex[:12]}"
        try:
            directory.mkdir()
            quota = round(cores * PERIOD_US)
            if cgroup.version == 2:
                (directory / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            else:
                (directory / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (directory / "cpu.cfs_quota_us").write_text(str(quota))
        except OSError as e:
            remove_cgroup(directory)
            raise ContainerConfigError(f"a CPU limit needs a writable cpu cgroup: {e}") from e
        return directory
    raise ContainerConfigError("a CPU limit needs the cpu cgroup controller, and this host "
                               "has no cgroup with it")


def _controllers(directory: Path) -> list[str]:
    with contextlib.suppress(OSError):
        return (directory / "cgroup.subtree_control").read_text().split()
    return []


def remove_cgroup(directory: Path) -> None:
    """Remove the run's cgroup once its processes have left; a warning when it cannot."""
    deadline = time.monotonic() + REMOVE_WAIT_S
    while True:
        try:
            os.rmdir(directory)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() >= deadline:
                logger.warning("cgroup %s left behind: %s", directory, e)
                return
            time.sleep(0.05)
