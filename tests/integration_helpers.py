"""Shared pieces of the framework-integration tests: run a 2-process command
with a hard timeout (the whole process group is killed, so a hang fails the
test instead of freezing CI), the bytes a step must hand to collectives
(from the compressor's own packets), and the scalars of TensorBoard event
files (read back with TensorBoard's ``EventAccumulator``)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import torch
from distributed import free_port

from gradpress.compress import create

ROOT = Path(__file__).resolve().parents[1]


def run_command(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    """Run ``cmd`` in its own session with MASTER_ADDR/MASTER_PORT set (a free
    port) and one thread per process; kill its process group after
    ``timeout`` seconds. Fails (AssertionError, with the output's tail) on a
    non-zero exit or a timeout; returns the output."""
    full_env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
                **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout} s:\n{out[-4000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-6000:]}"
    return out


def expected_step_bytes(model: torch.nn.Module, spec: str, min_numel: int) -> tuple[int, int]:
    """(bytes one step hands to collectives, bytes of plain DDP) for
    ``model`` with the strategy ``collective``: the compressor's packet for
    every 2-D-or-more tensor of at least ``min_numel`` elements, 4 bytes per
    element for the rest (one fused fp32 allreduce), which also carries one
    fp32 NaN/Inf flag per tensor (the model fits in one DDP bucket)."""
    comp = create(spec)
    sent = dense = 0
    for p in model.parameters():
        sent += 4  # its NaN/Inf flag
        dense += p.numel() * 4
        if p.dim() > 1 and p.numel() >= min_numel:
            sent += comp.encode(torch.randn(p.shape)).nbytes
        else:
            sent += p.numel() * 4
    return sent, dense


def scalar_events(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the event files under ``logdir`` and its (step, value) pairs in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(Path(logdir).rglob("events.out.tfevents.*"))
    assert files, f"no TensorBoard event file under {logdir}"
    out: dict[str, list[tuple[int, float]]] = {}
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in sorted(acc.Scalars(tag), key=lambda e: e.step))
    return out


def scalar_tags(logdir: Path) -> dict[str, list[float]]:
    """Every scalar tag of the event files under ``logdir`` and its values in step order."""
    return {tag: [value for _, value in events] for tag, events in scalar_events(logdir).items()}


def leave() -> None:
    """End a launched worker once its results are written: torch sometimes
    aborts at interpreter teardown ("terminate called without an active
    exception"), which would fail a finished run; leave at once, as the
    other test workers do (tests/distributed.py)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
