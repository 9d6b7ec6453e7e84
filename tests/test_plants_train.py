"""What ``gradpress train`` promises across ranks that its one-process tests
cannot see (the ``plants3`` session planted these bugs in train/session.py
and the ``train`` group's tests did not notice them): 2 gloo workers, one
launch, a stand-in algorithm (registered through
``gradpress.train.algorithm._registry`` in each worker), about 5 s.

* Every logged loss is the mean over the ranks of each rank's window mean
  (session.py's invariant "all ranks agree on every logged number: losses
  ... are all-reduced"): with an algorithm that never changes the model,
  each rank's loss at each step is computed here in float64 from the
  initial model and that rank's batch (``shard_batches``), and the metric
  is the workload's metric over the whole test set. Logging the sum over
  the ranks (not divided by the world size) went unnoticed.
* Resume restores each rank's own RNG state (the checkpoint holds "every
  rank's ... RNG states"): a stand-in that draws ``rank + 1`` numbers per
  step from torch, numpy and Python's generators draws, after a stop at
  step 3 and a resume, exactly what the uninterrupted run drew on every
  rank. Restoring rank 0's state on every rank went unnoticed.
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from stub_algorithm import CountingAlgorithm

from gradpress import train, workloads
from gradpress.train import algorithm
from gradpress.train.loop import shard_batches

WORLD = 2
#: 128 training samples: 64 per rank, 4 batches of 16 per epoch, 8 steps
COMMON = {"workload": "digits-mlp", "hidden": 8, "samples": 128, "batch_size": 16, "epochs": 2, "optimizer": "sgd",
          "lr": 0.1, "progress": False, "log_every": 1, "seed": 3}

#: what the ``draw`` stand-in drew, per step: (torch values, numpy values, Python values)
DRAWS: list[tuple[list[float], list[float], list[float]]] = []


class _Stub(CountingAlgorithm):
    """``stub:draw=0``: no optimizer step (the model stays as built);
    ``stub:draw=1``: each step draws ``rank + 1`` numbers from each global
    generator (recorded in :data:`DRAWS`) and takes the optimizer step."""

    name = "stub"
    default_compressor = "none"
    PARAMS = (type("P", (), {"name": "draw", "default": 0})(),)

    def __init__(self, spec, model, optimizer, draw=0):  # noqa: ANN001
        self.spec, self.model, self.optimizer, self.draw, self.counter = spec, model, optimizer, draw, 0

    def step(self) -> None:
        self.counter += 1
        if self.draw:
            k = dist.get_rank() + 1
            DRAWS.append((torch.rand(k).tolist(), np.random.rand(k).tolist(), [random.random() for _ in range(k)]))
            self.optimizer.step()

    def describe(self) -> dict:
        return {"algorithm": self.spec, "compressor": "none", "strategy": "allreduce", "error_feedback": False}


class _Registry:
    @staticmethod
    def names() -> list[str]:
        return ["stub"]

    @staticmethod
    def parse(spec: str):  # noqa: ANN205
        _, _, params = spec.partition(":")
        return _Stub, ({"draw": int(params.partition("=")[2])} if params else {})

    @staticmethod
    def create(spec, model, optimizer, compressor=None, **options):  # noqa: ANN001, ANN205
        return _Stub(spec, model, optimizer, **_Registry.parse(spec)[1])


def _worker(rank: int, world: int, root: str) -> dict:
    algorithm._registry = lambda: _Registry
    frozen = train.run({**COMMON, "algorithm": "stub:draw=0", "out": f"{root}/frozen"})
    drawing = {**COMMON, "algorithm": "stub:draw=1"}
    train.run({**drawing, "out": f"{root}/full"})
    full = list(DRAWS)
    DRAWS.clear()
    train.run({**drawing, "out": f"{root}/part", "steps": 3})
    train.run({**drawing, "out": f"{root}/part", "resume": True})
    return {"frozen": frozen, "full": full, "part": list(DRAWS)}


def _rows(path) -> list[dict]:  # noqa: ANN001
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_logged_losses_are_the_mean_over_ranks_and_resume_restores_each_ranks_rng(tmp_path) -> None:  # noqa: ANN001
    results = run_workers(_worker, WORLD, str(tmp_path))
    # the reference: the model as train builds it (same seed, same order of draws), never stepped
    torch.manual_seed(COMMON["seed"])
    np.random.seed(COMMON["seed"])
    random.seed(COMMON["seed"])
    wl = workloads.build(COMMON["workload"], hidden=COMMON["hidden"], samples=COMMON["samples"])
    model = wl.model.eval()
    x, y = wl.train
    per_rank = []
    with torch.no_grad():
        for r in range(WORLD):
            batches = shard_batches(x, y, seed=COMMON["seed"], rank=r, world=WORLD, batch_size=COMMON["batch_size"],
                                    epochs=COMMON["epochs"])
            per_rank.append([float(wl.loss(model(xb), yb).double()) for _, _, xb, yb in batches])
        xt, yt = wl.test
        s, n = wl.score(model(xt), yt)
        metric = float(s) / float(n)
    rows = _rows(tmp_path / "frozen")
    assert [r["step"] for r in rows] == list(range(1, 9))
    for row in rows:
        want = math.fsum(losses[row["step"] - 1] for losses in per_rank) / WORLD
        assert row["loss"] == pytest.approx(want, rel=1e-6, abs=0), f"step {row['step']}: logged {row['loss']}, mean over ranks {want}"
    evaluated = [r for r in rows if "metric" in r]
    assert [r["step"] for r in evaluated] == [4, 8]
    for row in evaluated:
        assert row["metric"] == pytest.approx(metric, rel=1e-12, abs=0), f"step {row['step']}: {row['metric']} != {metric}"
    assert results[0]["frozen"]["final_metric"] == results[1]["frozen"]["final_metric"] == pytest.approx(metric, rel=1e-12, abs=0)
    # each rank resumed with its own generators' states
    for rank, res in enumerate(results):
        assert len(res["full"]) == len(res["part"]) == 8
        assert all(len(v) == rank + 1 for step in res["full"] for v in step)
        for step, (want, got) in enumerate(zip(res["full"], res["part"]), start=1):
            assert got == want, f"rank {rank} step {step}: drew {got} after the resume, {want} uninterrupted"

