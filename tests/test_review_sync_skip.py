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


def _train_with_a_nan(algo, model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int, nan_at: int) -> None:
    """``steps`` steps of the algorithm; rank 1's loss (so its gradient) is NaN at step ``nan_at``."""
    for step in range(steps):
        opt.zero_grad()
        loss = loss_of(model, rank, step)
        if rank == 1 and step == nan_at:
            loss = loss * math.nan
        loss.backward()
        algo.step()
    algo.close()


def _skip_worker(rank: int, spec: str) -> dict:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    algo = algorithms.create(spec, model, opt, nonfinite="skip")
    _train_with_a_nan(algo, model, opt, rank, 4, NAN_STEP)
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


OUTER_LR, OUTER_MU, PERIOD = 0.7, 0.9, 2


def _diloco_skip_worker(rank: int, world: int) -> dict:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    algo = algorithms.create(f"diloco:period={PERIOD},outer_lr={OUTER_LR},outer_momentum={OUTER_MU}", model, opt,
                             nonfinite="skip")
    _train_with_a_nan(algo, model, opt, rank, 3 * PERIOD, PERIOD)  # rank 1 diverges in the second period
    return {"params": flat(model), "theta": torch.cat([a.reshape(-1) for a in algo.anchor])}


def ref_diloco_skipping(periods: int, skipped: int) -> torch.Tensor:
    """DiLoCo by its definition, float64: each period the workers take plain
    SGD steps from theta, Delta = mean_i(theta - x_i), v <- mu v + Delta
    (v <- Delta at the first step), theta <- theta - lr (Delta + mu v); the
    period ``skipped`` (a rank's outer gradient is NaN) leaves theta and v
    untouched and every worker restarts from theta."""
    theta = [p.detach().clone() for p in make_model().parameters()]
    v: list[torch.Tensor] | None = None
    for period in range(periods):
        deltas = []
        for rank in range(2):
            m = make_model()
            with torch.no_grad():
                for p, t in zip(m.parameters(), theta):
                    p.copy_(t)
            for step in range(period * PERIOD, (period + 1) * PERIOD):
                m.zero_grad()
                loss_of(m, rank, step).backward()
                with torch.no_grad():
                    for p in m.parameters():
                        p -= LR * p.grad
            deltas.append([t - p.detach() for t, p in zip(theta, m.parameters())])
        if period == skipped:
            continue
        mean = [(a + b) / 2 for a, b in zip(*deltas)]
        v = [d.clone() for d in mean] if v is None else [OUTER_MU * b + d for b, d in zip(v, mean)]
        theta = [t - OUTER_LR * (d + OUTER_MU * b) for t, d, b in zip(theta, mean, v)]
    return torch.cat([t.reshape(-1) for t in theta])


def test_diloco_outer_step_of_a_skipped_exchange_leaves_theta_and_momentum_alone() -> None:
    want = ref_diloco_skipping(3, skipped=1)
    r0, r1 = run_workers(_diloco_skip_worker, 2)
    for r in (r0, r1):
        assert torch.equal(r["params"], r0["params"]) and torch.equal(r["theta"], r0["theta"])
        err = (r["theta"] - want).abs().max()
        assert torch.allclose(r["theta"], want, rtol=0, atol=1e-12), err
        assert torch.equal(r["params"], r["theta"])


def _streaming_skip_worker(rank: int, world: int) -> dict:
    """F = 1, T = 0, alpha = 0: DiLoCo, merged through Streaming DiLoCo's path."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    spec = (f"streaming-diloco:period={PERIOD},fragments=1,overlap=0,alpha=0,outer_lr={OUTER_LR},"
            f"outer_momentum={OUTER_MU}")
    algo = algorithms.create(spec, model, opt, nonfinite="skip")
    _train_with_a_nan(algo, model, opt, rank, 3 * PERIOD, PERIOD)
    return {"params": flat(model), "theta": torch.cat([a.reshape(-1) for a in algo.anchor])}


def test_streaming_merge_of_a_skipped_exchange_leaves_theta_alone_and_alpha_zero_copies_it() -> None:
    want = ref_diloco_skipping(3, skipped=1)
    r0, r1 = run_workers(_streaming_skip_worker, 2)
    for r in (r0, r1):
        err = (r["theta"] - want).abs().max()
        assert torch.allclose(r["theta"], want, rtol=0, atol=1e-12), err
        assert torch.equal(r["params"], r["theta"]), torch.isnan(r["params"]).sum()  # alpha = 0: theta exactly
