"""SCAFFOLD with ``torch.optim.SGD(weight_decay=wd)`` on 2 gloo workers with
non-IID data, against float64 references this test computes by the paper's
formulas for the L2-regularized objective ``f_i(y) + wd / 2 |y|^2`` (what
torch's SGD descends: ``d = grad + wd * y``):

* plain SGD: option II (``control=displacement``) and ``control=gradients``
  give the same x, c and c_i, the documented equality ("equal to option II
  for plain SGD"); ``gradients`` left the L2 term out of ``c_i+`` (the
  displacement has it), so the two differed by ``wd * y`` (0.18 here);
* momentum SGD (``auto``: ``gradients``): ``c_i+`` is the lr-weighted mean
  of the period's gradients of that objective, ``g_k + wd * y_k``.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers
from test_scaffold import batch, grads_at, make_model

import gradpress.algorithms as algorithms

WORLD = 2
LR = 0.1
WD = 0.5
PERIOD = 3
STEPS = 9


def reference(momentum: float) -> list[dict]:
    """Option II (``momentum`` 0) or the gradients' mean (heavy-ball
    ``momentum``), the gradient being ``g + WD * y``; one entry per
    synchronization: x, c and each worker's c_i."""
    x = [p.detach().clone() for p in make_model().parameters()]
    c = [torch.zeros_like(t) for t in x]
    ci = [[torch.zeros_like(t) for t in x] for _ in range(WORLD)]
    bufs: list[list[torch.Tensor] | None] = [None] * WORLD
    out = []
    for start in range(0, STEPS, PERIOD):
        ys = [[t.clone() for t in x] for _ in range(WORLD)]
        gsum = [[torch.zeros_like(t) for t in x] for _ in range(WORLD)]
        for k in range(PERIOD):
            for r in range(WORLD):
                g = [gi + WD * y for gi, y in zip(grads_at(ys[r], r, start + k), ys[r])]
                gsum[r] = [a + b for a, b in zip(gsum[r], g)]
                d = [gi - cr + cc for gi, cr, cc in zip(g, ci[r], c)]
                if momentum:
                    bufs[r] = d if bufs[r] is None else [momentum * b + e for b, e in zip(bufs[r], d)]
                    d = bufs[r]
                ys[r] = [y - LR * e for y, e in zip(ys[r], d)]
        if momentum:
            new_ci = [[gs / PERIOD for gs in gsum[r]] for r in range(WORLD)]
        else:
            new_ci = [[cr - cc + (xx - y) / (PERIOD * LR) for cr, cc, xx, y in zip(ci[r], c, x, ys[r])]
                      for r in range(WORLD)]
        x = [xx + sum(ys[r][i] - xx for r in range(WORLD)) / WORLD for i, xx in enumerate(x)]
        c = [cc + sum(new_ci[r][i] - ci[r][i] for r in range(WORLD)) / WORLD for i, cc in enumerate(c)]
        ci = new_ci
        out.append({"x": x, "c": c, "ci": ci})
    return out


def _worker(rank: int, world: int) -> dict:
    out = {}
    for name, spec, momentum in (("displacement", "scaffold:period=3,control=displacement", 0.0),
                                 ("gradients", "scaffold:period=3,control=gradients", 0.0),
                                 ("momentum", "scaffold:period=3", 0.9)):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum, weight_decay=WD)
        algo = algorithms.create(spec, model, opt)
        synced = []
        for step in range(STEPS):
            opt.zero_grad()
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            algo.step()
            if algo.since == 0:
                synced.append({"x": [p.detach().clone() for p in model.parameters()],
                               "c": [t.clone() for t in algo.c], "ci": [t.clone() for t in algo.c_local]})
        out[name] = synced
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


@pytest.mark.parametrize("case,momentum", [("displacement", 0.0), ("gradients", 0.0), ("momentum", 0.9)])
def test_weight_decay_is_part_of_the_control_variates(results: list[dict], case: str, momentum: float) -> None:
    want = reference(momentum)
    for rank, res in enumerate(results):
        got = res[case]
        assert len(got) == len(want) == STEPS // PERIOD
        for n, (g, w) in enumerate(zip(got, want)):
            for key, ref in (("x", w["x"]), ("c", w["c"]), ("ci", w["ci"][rank])):
                for i, (u, v) in enumerate(zip(g[key], ref)):
                    assert torch.allclose(u, v, rtol=0, atol=1e-10), \
                        f"{case} rank {rank} sync {n} {key}[{i}]: max diff {(u - v).abs().max().item():.3g}"
