"""Review: the synchronous phase (``postlocalsgd``'s and DiLoCo's ``switch``)
is DDP's step, on 2 gloo workers against a float64 reference the test
computes itself: with ``nonfinite=skip`` a step in which one rank's
gradient is NaN leaves the parameters and the optimizer's momentum
untouched on every rank (the exchange engine zeroes the gradients of a
skipped step; SGD with momentum would still move on them)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from distributed import run_workers
from test_algorithms import LR, loss_of, make_model

import gradpress.algorithms as algorithms

NAN_STEP = 1  # the step at which rank 1's loss (and so its gradient) is NaN


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _skip_worker(rank: int, spec: str) -> dict:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    algo = algorithms.create(spec, model, opt, nonfinite="skip")
    for step in range(4):
        opt.zero_grad()
        loss = loss_of(model, rank, step)
        if rank == 1 and step == NAN_STEP:
            loss = loss * math.nan
        loss.backward()
        algo.step()
    algo.close()
    return {"params": flat(model), "steps": algo.stats["steps"]}


def _worker(rank: int, world: int) -> dict:
    return {
        "skip_postlocal": _skip_worker(rank, "postlocalsgd:period=2,switch=4"),
        "skip_diloco": _skip_worker(rank, "diloco:period=2,switch=4"),
    }


def ref_ddp_momentum_skipping(steps: int, skipped: int, mu: float = 0.9) -> torch.Tensor:
    """DDP with SGD momentum, float64, by the definition: the gradient is the
    mean of the two ranks'; the step in which a rank's gradient is NaN is
    skipped on every rank (parameters and momentum untouched)."""
    models = [make_model() for _ in range(2)]
    params = list(models[0].parameters())
    bufs: list[torch.Tensor | None] = [None] * len(params)
    for step in range(steps):
        grads = []
        for rank, m in enumerate(models):
            m.zero_grad()
            loss_of(m, rank, step).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        if step == skipped:
            continue
        with torch.no_grad():
            for i, p in enumerate(params):
                g = (grads[0][i] + grads[1][i]) / 2
                bufs[i] = g.clone() if bufs[i] is None else mu * bufs[i] + g
                p -= LR * bufs[i]
            for p, q in zip(models[1].parameters(), params):
                p.copy_(q)
    return flat(models[0])


def test_synchronous_phase_skips_the_optimizer_step_of_a_skipped_exchange() -> None:
    want = ref_ddp_momentum_skipping(4, NAN_STEP)
    r0, r1 = run_workers(_worker, 2)
    for key in ("skip_postlocal", "skip_diloco"):
        assert r0[key]["steps"] == 4
        assert torch.equal(r0[key]["params"], r1[key]["params"]), key
        err = (r0[key]["params"] - want).abs().max()
        assert torch.allclose(r0[key]["params"], want, rtol=0, atol=1e-12), (key, err)
