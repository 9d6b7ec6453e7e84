"""What a user sees of a warning in ``gradpress train``: one line in the
CLI's own form, once for the run (not once per worker), without the source
line Python prints under a warning."""

from __future__ import annotations

import subprocess
import sys
import warnings

from gradpress.train.launch import one_line_warnings


def test_a_one_host_hierarchical_run_warns_once_in_one_line(tmp_path) -> None:  # noqa: ANN001
    cmd = [sys.executable, "-m", "gradpress", "train", "--nproc", "2", "--workload", "digits-mlp", "--samples", "128",
           "--steps", "3", "--no-progress", "--strategy", "hierarchical", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if "one host" in ln]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("gradpress train: warning: strategy 'hierarchical': all 2 ranks are on one host")
    assert "strategy_class" not in done.stderr and "UserWarning" not in done.stderr, done.stderr


def test_the_one_line_form() -> None:
    saved = warnings.formatwarning
    try:
        one_line_warnings()
        plain = warnings.formatwarning("plain", UserWarning, "x.py", 3, "source()")
        old = warnings.formatwarning("old", DeprecationWarning, "x.py", 3, "source()")
    finally:
        warnings.formatwarning = saved
    assert (plain, old) == ("gradpress train: warning: plain\n", "gradpress train: warning: DeprecationWarning: old\n")
