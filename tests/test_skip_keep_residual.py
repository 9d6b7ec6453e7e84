"""DiLoCo's ``keep_residual=true`` with ``nonfinite='skip'`` (2 gloo workers,
one spawn, about 5 s): a dropped synchronization undoes the period
(gradpress/algorithms/restart.py), so every worker restarts from theta minus
its own residual of the last agreed point, and that residual stays. Before,
the residuals of the outer keys were dropped before the exchange (with
``keep_residual`` nothing is fed back) and not put back when the exchange was
dropped: every worker restarted from theta itself and its unsent change was
lost for good. The reference is written here in float64 from the definitions
(its own top-k; plain SGD inside, so no optimizer state to restore)."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import run_workers
from references import topk
from test_algorithms import WORLD, loss_of
from test_algorithms_outer import Workers, build, flat

STEPS, PERIOD, LR, MU = 9, 3, 0.7, 0.5
RATIO, MIN_NUMEL = 0.1, 64
#: rank 0's gradient holds one Inf at this step (its second period: the synchronization after it is dropped)
BAD = 4
SPECS = {"tensor": f"diloco:period={PERIOD},outer_lr={LR},outer_momentum={MU},keep_residual=true",
         "model": f"diloco:period={PERIOD},outer_lr={LR},outer_momentum={MU},keep_residual=true,select=model"}


def _worker(rank: int, world: int) -> dict:
    out = {}
    for name, spec in SPECS.items():
        model, opt, algo = build(rank, spec, compressor=f"topk:ratio={RATIO}", min_numel=MIN_NUMEL,
                                 nonfinite="skip")
        steps = []
        for step in range(STEPS):
            opt.zero_grad()
            loss_of(model, rank, step).backward()
            if rank == 0 and step == BAD:
                with torch.no_grad():
                    next(model.parameters()).grad[0, 0] = math.inf
            algo.step()
            steps.append(flat(model))
        out[name] = {"steps": steps, "skipped": algo.stats["skipped_steps"]}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


def reference(select: str) -> list[list[torch.Tensor]]:
    """Per step, per rank, the flat parameters. Every H steps worker i sends C(theta - x_i) (no residual fed back:
    it is in x_i already), keeps e_i = (theta - x_i) - C(theta - x_i), theta takes the Nesterov outer step with
    the mean of what was sent, and worker i restarts from theta - e_i. ``select=tensor``: a top-k per 2-D tensor
    of at least MIN_NUMEL entries, the rest plain; ``model``: one top-k over the whole model. A synchronization
    some worker's outer gradient is not finite in is dropped: theta, the outer momentum and every e_i stay, and
    every worker restarts from theta - e_i."""
    w = Workers("sgd")
    theta = [p.detach().clone() for p in w.models[0].parameters()]
    buf: list[torch.Tensor | None] = [None] * len(theta)
    resid = [[torch.zeros_like(t) for t in theta] for _ in range(WORLD)]
    out = []
    for s in range(STEPS):
        w.grads(s)
        if s == BAD:
            next(w.models[0].parameters()).grad[0, 0] = math.inf
        for o in w.opts:
            o.step()
        params = w.params()
        if (s + 1) % PERIOD == 0:
            _outer_step(theta, buf, resid, params, select)
        out.append(w.flats())
    return out


@torch.no_grad()
def _outer_step(theta: list[torch.Tensor], buf: list[torch.Tensor | None], resid: list[list[torch.Tensor]],
                params: list[list[torch.Tensor]], select: str) -> None:
    """The reference's synchronization (see :func:`reference`), in place."""
    deltas = [[theta[i] - params[i][r].detach() for i in range(len(theta))] for r in range(WORLD)]
    if all(bool(torch.isfinite(d).all()) for ds in deltas for d in ds):
        sent = []
        for r in range(WORLD):
            if select == "model":
                whole = topk(torch.cat([d.reshape(-1) for d in deltas[r]]), RATIO)
                mine = [v.view_as(d) for v, d in zip(whole.split([d.numel() for d in deltas[r]]), deltas[r])]
            else:
                mine = [topk(d, RATIO) if d.dim() > 1 and d.numel() >= MIN_NUMEL else d for d in deltas[r]]
            resid[r] = [d - m for d, m in zip(deltas[r], mine)]
            sent.append(mine)
        for i in range(len(theta)):
            d = sum(sent[r][i] for r in range(WORLD)) / WORLD
            buf[i] = d.clone() if buf[i] is None else MU * buf[i] + d
            theta[i] = theta[i] - LR * (d + MU * buf[i])
    for i in range(len(theta)):
        for r in range(WORLD):
            params[i][r].copy_(theta[i] - resid[r][i])


@pytest.mark.parametrize("select", SPECS)
def test_a_dropped_synchronization_keeps_each_workers_residual(results: list[dict], select: str) -> None:
    want = reference(select)
    for rank in range(WORLD):
        run = results[rank][select]
        assert run["skipped"] == 1, f"{select} rank {rank}: {run['skipped']} synchronizations dropped"
        for step, (got, ref) in enumerate(zip(run["steps"], want)):
            ok = torch.isfinite(ref[rank])
            assert torch.equal(torch.isfinite(got), ok), f"{select} rank {rank} step {step}: finite where"
            err = (got[ok] - ref[rank][ok]).abs().max().item()
            assert err <= 1e-10, f"{select} rank {rank} step {step}: {err} from the reference"
    # right after the dropped synchronization each worker is back where the last agreed point left it
    drop = (BAD // PERIOD + 1) * PERIOD - 1
    for rank in range(WORLD):
        assert torch.equal(results[rank][select]["steps"][drop], results[rank][select]["steps"][drop - PERIOD])
