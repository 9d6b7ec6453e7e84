"""SCAFFOLD's ``nonfinite='skip'`` copy across a resume, and ``eval_model``
(2 gloo workers, non-IID data of tests/test_scaffold.py).

* Resumed mid-period from a checkpoint (``torch.load(weights_only=True)``),
  a synchronization dropped after the resume (an Inf gradient on rank 1)
  must put back the optimizer state and buffers of the last agreed point,
  as in the run that was never interrupted: bit for bit. tests/test_scaffold.py
  resumed with ``skip`` but dropped nothing afterwards, so a checkpoint
  without the copy (a fresh build's, taken before the first step) passed.
* ``eval_model()`` between synchronizations is the replicas' average (the
  mean over ranks of each rank's parameters, float64, computed here), right
  after one the model itself; nothing tested it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import checkpoint, restore, run_workers
from test_scaffold import batch, make_model

import gradpress.algorithms as algorithms

WORLD = 2
SPEC = "scaffold:period=3"
BAD_STEP = 4  # rank 1's Inf gradient: the second period (steps 3-5) is dropped


def _build() -> tuple[torch.nn.Module, torch.optim.Optimizer, algorithms.Algorithm]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, algorithms.create(SPEC, model, opt, nonfinite="skip")


def _momentum(opt: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor | None:
    buf = opt.state.get(p, {}).get("momentum_buffer")
    return None if buf is None else buf.clone()


def _train(rank: int, model, opt, algo, start: int, stop: int) -> list[dict]:  # noqa: ANN001
    synced = []
    for step in range(start, stop):
        opt.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if rank == 1 and step == BAD_STEP:
            next(model.parameters()).grad[0, 0] = float("inf")
        algo.step()
        if algo.since == 0:
            synced.append({"x": [p.detach().clone() for p in model.parameters()],
                           "c": [t.clone() for t in algo.c], "ci": [t.clone() for t in algo.c_local],
                           "momentum": [_momentum(opt, p) for p in model.parameters()]})
    return synced


def _worker(rank: int, world: int) -> dict:
    out: dict = {}
    model, opt, algo = _build()
    _train(rank, model, opt, algo, 0, 4)  # synchronized at step 2; step 3 is local (since = 1)
    own = [p.detach().clone() for p in model.parameters()]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, own)
    out["replicas"] = everyone
    out["eval"] = [p.detach().clone() for p in algo.eval_model().parameters()]
    out["eval_is_model_between"] = algo.eval_model() is model
    saved = checkpoint(algo=algo, model=model, opt=opt)
    out["straight"] = _train(rank, model, opt, algo, 4, 9)
    out["skipped"] = algo.stats["skipped_steps"]
    out["eval_is_model_after_sync"] = algo.eval_model() is model
    model, opt, algo = _build()
    restore(saved, model=model, opt=opt, algo=algo)
    out["resumed"] = _train(rank, model, opt, algo, 4, 9)
    out["resumed_skipped"] = algo.stats["skipped_steps"]
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


def test_a_synchronization_dropped_after_a_resume_restores_as_the_straight_run(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        assert res["skipped"] == res["resumed_skipped"] == 1, rank
        assert len(res["straight"]) == len(res["resumed"]) == 2, rank  # steps 5 (dropped) and 8
        for n, (a, b) in enumerate(zip(res["straight"], res["resumed"])):
            for key in ("x", "c", "ci", "momentum"):
                assert all(u is v is None or (u is not None and v is not None and torch.equal(u, v))
                           for u, v in zip(a[key], b[key])), \
                    f"rank {rank} sync {n} {key}: the resumed run differs from the straight one"
            assert all(t is not None and torch.isfinite(t).all() for t in a["momentum"]), (rank, n)


def test_eval_model_is_the_replicas_average_between_synchronizations(results: list[dict]) -> None:
    replicas = results[0]["replicas"]
    assert not torch.equal(replicas[0][0], replicas[1][0])  # non-IID local steps: the replicas differ
    want = [sum(r[i].double() for r in replicas) / WORLD for i in range(len(replicas[0]))]
    for rank, res in enumerate(results):
        assert not res["eval_is_model_between"], rank
        for i, (got, w) in enumerate(zip(res["eval"], want)):
            assert torch.allclose(got.double(), w, rtol=0, atol=1e-12), f"rank {rank} eval_model()[{i}]"
        assert res["eval_is_model_after_sync"], rank
