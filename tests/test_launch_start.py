"""How the launcher starts its workers: never forked from the launcher
itself (by then the elastic agent runs threads, and a child forked while
one of them held glibc's resolver lock hung in ``getnameinfo`` for the whole
``--timeout``, about one start in a hundred), but from a fork server on
Linux CPU runs (spawn elsewhere); a worker sees the launcher's environment
as it is at each launch, not as it was when the fork server started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradpress.train import launch
from gradpress.train.config import make_config


def test_workers_are_never_forked_from_the_launcher() -> None:
    from torch.distributed.launcher.api import LaunchConfig

    method = launch.launch_config(make_config(None, nproc=2), LaunchConfig).start_method
    assert method in ("forkserver", "spawn"), method
    if sys.platform.startswith("linux"):
        assert launch._start_method("cpu") == "forkserver"
    assert launch._start_method("cuda") == "spawn"


def test_a_worker_gets_the_launchers_environment_of_this_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork server started with ``base``; since then the launcher changed
    A, added C and removed B (``now``); the agent added RANK and set
    OMP_NUM_THREADS for this worker. The worker ends with ``now`` plus the
    agent's variables."""
    base = {"A": "1", "B": "2", "PATH": "/bin"}
    now = {"A": "9", "C": "3", "PATH": "/bin", "OMP_NUM_THREADS": "1"}
    worker = {**base, "RANK": "1", "OMP_NUM_THREADS": "1"}
    monkeypatch.setattr(os, "environ", dict(worker))
    launch._launcher_environ(base, now)
    assert os.environ == {"A": "9", "C": "3", "PATH": "/bin", "OMP_NUM_THREADS": "1", "RANK": "1"}


def test_a_second_launch_in_one_process_sees_the_changed_environment(tmp_path: Path) -> None:
    """Two runs through ``gradpress.train.run`` in one process (one fork
    server, started by the first): ``GRADPRESS_COMPILE`` set to a bad value
    between them reaches the second run's workers, whose first kit call
    refuses it (the launcher itself never reads it)."""
    script = f"""
import os
from gradpress.train import launch

launch.run(None, nproc=2, steps=2, compressor="qsgd", out={str(tmp_path)!r} + "/first", progress=False)
print("first ran")
os.environ["GRADPRESS_COMPILE"] = "bogus"
try:
    launch.run(None, nproc=2, steps=2, compressor="qsgd", out={str(tmp_path)!r} + "/second", progress=False)
    print("second ran")
except ValueError as exc:  # a worker's ValueError comes back as one
    print("second failed:", exc)
"""
    env = {k: v for k, v in os.environ.items() if k != "GRADPRESS_COMPILE"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert "first ran" in lines, proc.stdout
    assert any(ln.startswith("second failed:") and "GRADPRESS_COMPILE got 'bogus'" in ln for ln in lines), proc.stdout
