"""``train.cpus.cgroup_cpu_limit`` reads a cgroup CPU quota as the kernel states it, on a fake ``/sys/fs/cgroup``
and ``/proc/self/cgroup`` built per test: cgroup v2's ``cpu.max`` ("QUOTA PERIOD" / "max PERIOD") and v1's
``cpu.cfs_quota_us`` (-1: none) over ``cpu.cfs_period_us``, on the process's cgroup and every ancestor; the
tightest binds, rounded up to whole CPUs. The expected counts are computed here as ceil(quota / period)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from gradpress.train.cpus import cgroup_cpu_limit


def tree(tmp_path: Path, self_cgroup: str, files: dict[str, str]) -> tuple[str, str]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    root.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "self_cgroup"
    proc.write_text(self_cgroup)
    return str(root), str(proc)


@pytest.mark.parametrize("quota, period", [(200000, 100000), (150000, 100000), (50000, 100000), (1, 100000),
                                           (350000, 50000), (10**9, 10**5)])
def test_v2_quota_over_period_rounded_up(tmp_path, quota, period):
    root, proc = tree(tmp_path, "0::/\n", {"cpu.max": f"{quota} {period}\n"})
    assert cgroup_cpu_limit(root, proc) == max(1, math.ceil(quota / period))


def test_v2_no_quota_no_file_or_garbage_is_no_limit(tmp_path):
    root, proc = tree(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(root, proc) is None
    root, proc = tree(tmp_path / "a", "0::/\n", {})
    assert cgroup_cpu_limit(root, proc) is None
    root, proc = tree(tmp_path / "b", "0::/\n", {"cpu.max": "lots\n"})
    assert cgroup_cpu_limit(root, proc) is None
    root, proc = tree(tmp_path / "c", "0::/\n", {"cpu.max": "0 100000\n"})  # not a quota the kernel accepts
    assert cgroup_cpu_limit(root, proc) is None
    assert cgroup_cpu_limit(root, str(tmp_path / "missing")) is None


def test_v2_the_tightest_of_the_cgroup_and_its_ancestors_binds(tmp_path):
    files = {"kubepods/cpu.max": "400000 100000\n", "kubepods/pod1/cpu.max": "max 100000\n",
             "kubepods/pod1/ctr/cpu.max": "250000 100000\n", "other/cpu.max": "100000 100000\n"}
    root, proc = tree(tmp_path, "0::/kubepods/pod1/ctr\n", files)
    assert cgroup_cpu_limit(root, proc) == 3  # ceil(2.5); "other" is not an ancestor
    files["kubepods/cpu.max"] = "150000 100000\n"
    root, proc = tree(tmp_path / "2", "0::/kubepods/pod1/ctr\n", files)
    assert cgroup_cpu_limit(root, proc) == 2  # the parent's 1.5 binds


def test_v1_cfs_quota_and_the_hybrid_layout(tmp_path):
    lines = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n"
    files = {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n",
             "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"}
    root, proc = tree(tmp_path, lines, files)
    assert cgroup_cpu_limit(root, proc) == 3
    files["cpu,cpuacct/docker/abc/cpu.cfs_quota_us"] = "-1\n"
    root, proc = tree(tmp_path / "none", lines, files)
    assert cgroup_cpu_limit(root, proc) is None
    files["cpu.max"] = "100000 100000\n"  # a v2 limit as well (hybrid): the tighter of both
    root, proc = tree(tmp_path / "hybrid", lines, files)
    assert cgroup_cpu_limit(root, proc) == 1


def test_a_path_cannot_climb_out_of_the_root(tmp_path):
    (tmp_path / "cpu.max").write_text("100000 100000\n")  # outside the fake root: must not be read
    root, proc = tree(tmp_path, "0::/../..\n", {})
    assert cgroup_cpu_limit(root, proc) is None
    # a cgroup outside the namespace's root ("/../x"): not the sibling "x" under the root, only the root's own
    root, proc = tree(tmp_path / "ns", "0::/../x\n", {"x/cpu.max": "100000 100000\n", "cpu.max": "300000 100000\n"})
    assert cgroup_cpu_limit(root, proc) == 3
