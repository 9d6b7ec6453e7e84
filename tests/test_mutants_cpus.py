"""``train.cpus.cgroup_cpu_limit``: written for survivors of ``make mutants``
(``config`` group, train/cpus.py). A fake ``/sys/fs/cgroup`` and
``/proc/self/cgroup`` per test (as tests/test_cgroup_cpus.py builds them);
the expected counts are ceil(quota / period) of the limit that must bind,
computed here.

* every ancestor of the process's cgroup is read, not every other one: a
  cgroup four levels deep with the binding limit on each level in turn;
* a line of ``/proc/self/cgroup`` that is not "ID:CONTROLLERS:PATH" is
  skipped, not the end of the file: the v2 line after it is still read.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_cgroup_cpus import tree

from gradpress.train.cpus import cgroup_cpu_limit

pytestmark = pytest.mark.mutants

LEVELS = ("kubepods", "burstable", "pod1", "ctr")


@pytest.mark.parametrize("depth", range(len(LEVELS) + 1))
def test_the_limit_on_any_ancestor_binds(tmp_path: Path, depth: int) -> None:
    """A 1.5-CPU quota on the ancestor ``depth`` levels below the root (0: the root itself), 8 CPUs on every
    other level: the 1.5 binds, wherever it is."""
    dirs = ["/".join(LEVELS[:i]) for i in range(len(LEVELS) + 1)]
    files = {f"{d}/cpu.max".lstrip("/"): ("150000 100000\n" if i == depth else "800000 100000\n")
             for i, d in enumerate(dirs)}
    root, proc = tree(tmp_path, "0::/" + "/".join(LEVELS) + "\n", files)
    assert cgroup_cpu_limit(root, proc) == math.ceil(150000 / 100000) == 2


def test_a_malformed_line_is_skipped_not_the_end_of_the_file(tmp_path: Path) -> None:
    root, proc = tree(tmp_path, "garbage\n0::/a\n", {"a/cpu.max": "300000 100000\n"})
    assert cgroup_cpu_limit(root, proc) == math.ceil(300000 / 100000)
