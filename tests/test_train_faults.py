"""A worker that dies mid-training stops the whole run with a non-zero exit
and a one-line report naming it and its signal, and the last checkpoint is
intact and resumable. A checkpoint whose rank-1 entry alone is refused at
load exits 2 naming the refusal within seconds.

The run that dies is a ``python -m gradpress.train`` subprocess (its launcher's
exit code and report are what is checked); the resume runs in the test's
process through ``gradpress.train.cli.main``, the function that entry point
calls (suitespeed session: one interpreter, its fork server and its workers'
imports fewer)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from distributed import worker_pids

from gradpress.train.cli import main as train_main


def _train_args(out: Path, epochs: int, *extra: str) -> list[str]:
    return ["--nproc", "2", "--workload", "digits-mlp", "--epochs", str(epochs), "--out", str(out), "--no-progress",
            "--strategy", "collective", "--compressor", "topk:ratio=0.1", *extra]


def test_dead_worker_stops_run_and_checkpoint_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "gradpress.train", *_train_args(out, 400)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (out / "checkpoint.pt").exists():
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.2)
        workers = worker_pids(proc.pid)
        assert len(workers) >= 2, f"expected 2 worker processes, found {workers}"
        os.kill(workers[-1], signal.SIGKILL)
        killed = time.monotonic()
        rc = proc.wait(timeout=120)
        waited = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc != 0, "a run whose worker died must not exit 0"
    assert waited < 60, f"the run took {waited:.0f}s to stop after a worker died"
    output = proc.stdout.read() if proc.stdout else ""
    # issue 15: the worker that died first is named, with its signal, in one line and no traceback
    assert "gradpress train: error: worker rank 1 was killed by SIGKILL" in output, output
    assert "Traceback" not in output, output
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["epoch"] >= 1 and len(ckpt["ranks"]) == 2
    assert train_main(_train_args(out, ckpt["epoch"] + 1, "--resume")) == 0, capsys.readouterr()
    assert "accuracy" in capsys.readouterr().out


def test_one_ranks_refused_checkpoint_entry_fails_at_once_naming_it(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint whose rank-1 entry alone is refused (a residual under a key no parameter has, as
    docs/guarantees.md's load refusals name it): the resume exits 2 with that refusal, long before
    --timeout. Before, rank 1 returned its ValueError and waited for the launcher while rank 0 trained
    into a collective rank 1 never joined: the run failed after --timeout with "worker rank 0 timed out
    ... waiting for rank 1", and the refusal was never shown."""
    out = tmp_path / "run"
    args = [*_train_args(out, 2), "--error-feedback", "on", "--min-numel", "64", "--timeout", "40"]
    assert train_main([*args, "--steps", "2"]) == 0, capsys.readouterr()
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    residuals = ckpt["ranks"][1]["algorithm"]["feedback"]["residuals"]
    name = next(iter(residuals))
    residuals[name + "_typo"] = residuals.pop(name)
    torch.save(ckpt, out / "checkpoint.pt")
    capsys.readouterr()
    start = time.monotonic()
    assert train_main([*args, "--resume"]) == 2
    took = time.monotonic() - start
    err = capsys.readouterr().err
    assert f"{name}_typo" in err and "nothing was loaded" in err and "timed out" not in err, err
    assert took < 35, f"the refusal took {took:.0f}s (the other rank waited for its --timeout)"
