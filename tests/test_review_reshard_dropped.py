"""Features merged apart, tested together: a ``--nonfinite skip`` run whose step 2 is dropped (a NaN loss on
one rank), checkpointed after one epoch on 4 gloo workers, resumed with ``--reshard`` on 2, to the end of
epoch 2. The whole training session runs in each worker (``gradpress.train.session.train``), the NaN put in
by wrapping ``gradpress.train.loop.train_step`` on rank 1 at step 2.

Checked against what the test computes itself:

* every encode's ``Context.step`` (recorded by a ``randomk`` probe) is the caller's step less the steps
  dropped before it, on both sides of the reshard: the count (``dropped_steps``, 1 on every saved rank) is
  folded into the new ranks, so epoch 2 on 2 workers draws at 3, 4, ... 10 for steps 4 ... 11;
* each new rank starts with the float64 mean of the 4 saved residuals, and the residual of the dropped step
  is the one before it (the fold of a skip run averages what the ranks kept);
* the summary: 12 steps, the reshard recorded, the first non-finite step (2) kept through the reshard,
  ``settings`` the resumed run's, and the history's ``seconds`` (the training clock) never going back: the
  2-worker run starts its clock at the 4-worker run's sum of step times.

About 25 s on the shared 2-core machine (one 4-worker and one 2-worker session).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from distributed import run_workers

PROBE = "test-reshard-probe"
BAD = 2  # the 0-based step whose loss is NaN on rank 1 (the run's third step)
OPTIONS = {"workload": "mnist1d-cnn", "hidden": 8, "samples": 256, "batch_size": 16, "min_numel": 64,
           "compressor": f"{PROBE}:ratio=0.05", "error_feedback": "on", "nonfinite": "skip",
           "allow_divergence": True, "log_every": 1, "eval_every": 1, "progress": False, "schedule": "cosine"}


def _register_probe(seen: list[tuple[str, int]]) -> None:
    from gradpress.compress import registry
    from gradpress.compress.randomk import RandomK

    class _Probe(RandomK):
        """randomk recording (key, Context.step) of every encode."""

        name = PROBE

        def _encode(self, x: torch.Tensor, ctx: Any) -> Any:
            if not ctx.key.startswith("__"):  # not gradpress's own probes (wire size, meta)
                seen.append((ctx.key, ctx.step))
            return super()._encode(x, ctx)

    registry.register(_Probe)


def _session(rank: int, world: int, out: str, extra: dict[str, Any]) -> dict[str, Any]:
    """One worker of ``gradpress train`` (the session's own code), with a NaN loss on rank 1 at :data:`BAD`."""
    import gradpress.train.loop as loop
    from gradpress.train import session
    from gradpress.train.config import make_config

    seen: list[tuple[str, int]] = []
    _register_probe(seen)
    real = loop.train_step
    calls = {"n": extra.pop("first_step", 0)}

    def poisoned(algo, optimizer, loss_fn, x, y):  # noqa: ANN001,ANN202
        step, calls["n"] = calls["n"], calls["n"] + 1
        if rank == 1 and step == BAD:
            return real(algo, optimizer, lambda out, tgt: loss_fn(out, tgt) * math.nan, x, y)
        return real(algo, optimizer, loss_fn, x, y)

    loop.train_step = poisoned
    starts: dict[str, Any] = {}
    setup = session._Run.setup

    def recording_setup(self):  # noqa: ANN001,ANN202
        state = setup(self)
        hook = self.algo.state_dict()  # the DDP hook's state
        starts["residuals"] = {k: v.clone() for k, v in hook["feedback"]["residuals"].items()}
        starts["dropped"] = self.algo.hook.engine.guard.dropped
        return state

    session._Run.setup = recording_setup
    cfg = make_config({**OPTIONS, "out": out, **extra})
    summary = session.train(cfg)
    return {"seen": seen, "summary": summary, "starts": starts}


def _mean64(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros(tensors[0].shape, dtype=torch.float64)
    for t in tensors:
        total = total + t.double()
    return total / len(tensors)


def _drawn(steps: range) -> list[int]:
    """The Context step of each caller's step: less the dropped ones before it (the dropped one itself draws
    at its place, and so does the step after it)."""
    return [s - (1 if s > BAD else 0) for s in steps]


def test_a_skip_run_with_a_dropped_step_resharded_4_to_2_counts_and_folds(tmp_path: Path) -> None:
    out = str(tmp_path / "run")
    four = run_workers(_session, 4, out, {"epochs": 1})
    saved = torch.load(Path(out) / "checkpoint.pt", weights_only=True)
    assert (saved["epoch"], saved["batch"], saved["step"]) == (1, 0, 4)
    hooks = [r["algorithm"] for r in saved["ranks"]]
    assert [h["dropped_steps"] for h in hooks] == [1, 1, 1, 1]
    assert saved["diverged_at_step"] == BAD + 1  # steps are counted from 1 in the history and the summary
    for got in four:
        keys = sorted({k for k, _ in got["seen"]})
        for key in keys:
            assert [s for k, s in got["seen"] if k == key] == _drawn(range(4)), key

    two = run_workers(_session, 2, out, {"epochs": 2, "resume": True, "reshard": True, "first_step": 4})
    res = [h["feedback"]["residuals"] for h in hooks]
    for rank, got in enumerate(two):
        assert got["starts"]["dropped"] == 1, rank  # the count survived the fold
        for key in res[0]:
            want = _mean64([r[key] for r in res]).to(res[0][key].dtype)
            assert torch.equal(got["starts"]["residuals"][key], want), (rank, key)
        for key in sorted({k for k, _ in got["seen"]}):
            assert [s for k, s in got["seen"] if k == key] == _drawn(range(4, 12)), (rank, key)

    summary = json.loads((Path(out) / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["world_size"] == 2
    assert summary["reshards"] == [{"from": 4, "to": 2, "step": 4, "epoch": 1}]
    assert summary["diverged_at_step"] == BAD + 1
    assert summary["settings"]["nonfinite"] == "skip" and summary["settings"]["epochs"] == 2
    history = summary["history"]
    assert [h["step"] for h in history][:4] == [1, 2, 3, 4] and history[-1]["step"] == 12
    seconds = [h["seconds"] for h in history]
    assert all(b >= a for a, b in zip(seconds, seconds[1:])), seconds
    after = torch.load(Path(out) / "checkpoint.pt", weights_only=True)
    assert [r["algorithm"]["dropped_steps"] for r in after["ranks"]] == [1, 1]
    # the clock went on from the 4-worker run's: its last entry is that run's sum of step times plus the new ones
    assert math.isclose(history[-1]["seconds"], sum(after["step_times"]), rel_tol=1e-9)
