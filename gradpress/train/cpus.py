"""How many cores this process may use: its affinity mask, narrowed by a cgroup CPU quota.

A container sees the host's CPUs in ``os.cpu_count()``. Docker's ``--cpus=2`` and a Kubernetes CPU limit
leave the affinity mask at the host's CPUs too, and cap the time instead: a CFS bandwidth quota of
``quota / period`` CPUs (cgroup v2: ``cpu.max``, "QUOTA PERIOD" or "max PERIOD"; v1: ``cpu.cfs_quota_us``,
-1 for none, and ``cpu.cfs_period_us``). Counting the host's cores there gives every worker dozens of OpenMP
threads that the quota then throttles. The limit that binds is the smallest on the process's cgroup and its
ancestors, rounded up to whole CPUs (1.5 CPUs can keep 2 threads busy three quarters of the time).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["usable_cpus", "cgroup_cpu_limit"]

CGROUP_ROOT = "/sys/fs/cgroup"
SELF_CGROUP = "/proc/self/cgroup"


def _ratio(quota: str, period: str) -> float | None:
    """CPUs granted by ``quota`` over ``period`` (as the files spell them); None for no limit or nonsense."""
    if quota in ("max", "-1"):
        return None
    q, p = int(quota), int(period)
    return q / p if q > 0 and p > 0 else None


def _limit_in(directory: Path, version: int) -> float | None:
    try:
        if version == 2:
            quota, period = (directory / "cpu.max").read_text().split()[:2]
        else:
            quota = (directory / "cpu.cfs_quota_us").read_text().strip()
            period = (directory / "cpu.cfs_period_us").read_text().strip()
        return _ratio(quota, period)
    except (OSError, ValueError):
        return None


def _directories(root: Path, path: str) -> list[Path]:
    """``root/path`` and each ancestor up to ``root``: where a limit on this process's cgroup can be set. In a
    container with its own cgroup namespace ``path`` is "/", and ``root`` is the container's own cgroup. A path
    with ".." lies outside the namespace's root, so not under ``root``: only ``root`` itself is read."""
    parts = [p for p in path.split("/") if p and p != "."]
    if ".." in parts:
        return [root]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_cpu_limit(root: str = CGROUP_ROOT, self_cgroup: str = SELF_CGROUP) -> int | None:
    """The CPUs a cgroup CPU quota grants this process (the tightest on its cgroups and their ancestors, v1
    and v2 both read, rounded up, at least 1), or None where there is no quota or nothing can be read."""
    try:
        lines = Path(self_cgroup).read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    base = Path(root)
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        hierarchy, controllers, path = fields
        if hierarchy == "0" and controllers == "":
            places = [(base, 2)]
        elif "cpu" in controllers.split(","):
            places = [(base / name, 1) for name in (controllers, "cpu", "cpu,cpuacct")]
        else:
            continue
        for mount, version in places:
            for directory in _directories(mount, path):
                limit = _limit_in(directory, version)
                if limit is not None:
                    limits.append(limit)
    return max(1, math.ceil(min(limits))) if limits else None


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (``os.sched_getaffinity(0)``, which a container's
    cpuset or ``taskset`` narrows), else ``os.cpu_count()`` (the host's, where there is no affinity), narrowed
    by a cgroup CPU quota (:func:`cgroup_cpu_limit`), at least 1. Every count of "this machine's cores" in
    gradpress (the ``--nproc`` cap, workers' ``OMP_NUM_THREADS``, the benchmarks' ``--threads`` bound and
    default) is this one."""
    count = 0
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is not None:
        try:
            count = len(getaffinity(0))
        except OSError:
            pass
    count = max(1, count or os.cpu_count() or 1)
    limit = cgroup_cpu_limit()
    return count if limit is None else min(count, limit)
