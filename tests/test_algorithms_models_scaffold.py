"""SCAFFOLD with the models users bring (tests/test_algorithms_models.py's
``Zoo``: BatchNorm, a tied weight, a frozen layer, a never-used layer, a
layer rank 1 uses at even steps only), one spawn of 2 gloo workers: option II
under plain SGD (``auto``), ``control=gradients`` under momentum SGD with
weight decay and ``global_lr=0.5`` (``auto``), option II under momentum
(``control=displacement``, period 3), the period's ``warmup``, bfloat16 and
float32 with bfloat16 layers.

The reference is SCAFFOLD's Algorithm 1 (Karimireddy et al. 2020, full
participation), written here in float64 from each worker's recorded
gradients (after ``backward()``, before the correction) and its parameters
right after each inner step (a step post-hook):

* local step: torch's SGD on the corrected gradient ``g_i - c_i + c`` from
  the parameter the code held before the step (a None gradient: not stepped);
* option II: ``c_i+ = c_i - c + (x - y_i) / (K_i lr)``; ``gradients``: ``c_i+
  = mean_k(g_k + wd y_k)`` over the period's K_i steps (constant lr); K_i
  counts the steps that stepped the parameter (0: ``c_i+ = c_i``);
* server: ``x <- x + global_lr mean_i(y_i - x)``, ``c <- c + mean_i(c_i+ -
  c_i)``, every replica restarts from ``x``; floating buffers averaged.

Frozen and never-used parameters never move, ``num_batches_tracked`` stays
int64, dtypes are kept, resume through ``weights_only=True`` is
bit-identical (``_check_common``); each synchronization sends the trainable
parameters twice (model change and control change) and the floating buffers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_workers
from test_algorithms_models import (
    BF16,
    F64,
    FLOAT_BUFFERS,
    LR,
    MU,
    TRAINABLE,
    WD,
    WORLD,
    _check_common,
    _close,
    _equal_ranks,
    _mean,
    _scenario,
    _trainable_bytes,
)

SCENARIOS: dict[str, dict[str, Any]] = {
    "scaffold": {"spec": "scaffold:period=2", "steps": 6, "resume_at": 3},
    "scaffold_momentum": {"spec": "scaffold:period=2,global_lr=0.5", "kind": "momentum", "steps": 6,
                          "resume_at": 3},
    "scaffold_displacement": {"spec": "scaffold:period=3,control=displacement", "kind": "momentum", "steps": 6,
                              "resume_at": 4},
    "scaffold_warmup": {"spec": "scaffold:period=3,warmup=4", "steps": 7, "resume_at": 4},
    "scaffold_bf16": {"spec": "scaffold:period=2", "dtype": BF16, "steps": 4},
    "scaffold_mixed": {"spec": "scaffold:period=2,control=gradients", "dtype": torch.float32, "head": BF16,
                       "steps": 4},
}
#: per scenario: (K, global_lr, warmup, momentum and weight decay, c_i+ from the gradients)
SETTINGS = {"scaffold": (2, 1.0, 0, False, False), "scaffold_momentum": (2, 0.5, 0, True, True),
            "scaffold_displacement": (3, 1.0, 0, True, False), "scaffold_warmup": (3, 1.0, 4, False, False),
            "scaffold_bf16": (2, 1.0, 0, False, False), "scaffold_mixed": (2, 1.0, 0, False, True)}


def _worker(rank: int, world: int) -> dict:
    return {name: _scenario(rank, **cfg) for name, cfg in SCENARIOS.items()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


def _period(k: int, warmup: int, s: int) -> int:
    """The period in force after the s-th local step: 1 + floor((K - 1) min(s, W) / W) (W = 0: K)."""
    return k if not warmup else 1 + (k - 1) * min(s, warmup) // warmup


def _sync_steps(k: int, warmup: int, steps: int) -> list[int]:
    """The 0-based steps after which the replicas are averaged."""
    out, since = [], 0
    for t in range(steps):
        since += 1
        if since >= _period(k, warmup, t + 1):
            out.append(t)
            since = 0
    return out


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_frozen_unused_tied_buffers_dtypes_and_resume(results: list[dict], name: str) -> None:
    _check_common(results, name, SCENARIOS[name]["steps"])


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scaffold_by_the_papers_formulas(results: list[dict], name: str) -> None:
    k, glr, warmup, momentum, from_grads = SETTINGS[name]
    runs = [r[name]["steps"] for r in results]
    x = {n: results[0][name]["init"][n].double() for n in TRAINABLE}  # the server model
    c = {n: torch.zeros_like(x[n]) for n in TRAINABLE}
    ci = [{n: torch.zeros_like(x[n]) for n in TRAINABLE} for _ in range(WORLD)]
    buf: list[dict[str, torch.Tensor | None]] = [dict.fromkeys(TRAINABLE) for _ in range(WORLD)]
    prev = [dict(x) for _ in range(WORLD)]  # each replica's parameters before the step (the code's)
    stepped = [dict.fromkeys(TRAINABLE, 0) for _ in range(WORLD)]  # K_i per parameter this period
    gsum = [{n: torch.zeros_like(x[n]) for n in TRAINABLE} for _ in range(WORLD)]
    syncs = _sync_steps(k, warmup, len(runs[0]))
    wd = WD if momentum else 0.0
    for t in range(len(runs[0])):
        at = [run[t] for run in runs]
        for i, st in enumerate(at):
            for n in TRAINABLE:
                g, y = st["grads"][n], prev[i][n]
                local = st["local"][n]
                if g is None:  # not stepped: no correction, no momentum, no weight decay
                    assert torch.equal(local.double(), y), (name, t, i, n)
                    continue
                d = g.double() - ci[i][n] + c[n] + wd * y  # torch's SGD descends the corrected gradient + wd y
                if momentum:
                    buf[i][n] = d if buf[i][n] is None else MU * buf[i][n] + d
                    d = buf[i][n]
                _close(local, y - LR * d, (name, t, i, n, "local step"), ulps=8)
                stepped[i][n] += 1
                gsum[i][n] = gsum[i][n] + g.double() + wd * y
        if t not in syncs:
            for i, st in enumerate(at):
                _equal_ranks(st["after"], st["local"], TRAINABLE, (name, t, i))
                prev[i] = {n: st["after"][n].double() for n in TRAINABLE}
            continue
        _equal_ranks(at[0]["after"], at[1]["after"], TRAINABLE, (name, t))
        _equal_ranks(at[0]["buffers"], at[1]["buffers"], FLOAT_BUFFERS, (name, t))
        for n in TRAINABLE:
            y = [st["local"][n].double() for st in at]
            new = []
            for i in range(WORLD):
                if not stepped[i][n]:
                    new.append(ci[i][n])
                elif from_grads:
                    new.append(gsum[i][n] / stepped[i][n])
                else:  # option II
                    new.append(ci[i][n] - c[n] + (x[n] - y[i]) / (stepped[i][n] * LR))
            want = x[n] + glr * _mean([yi - x[n] for yi in y])
            low = at[0]["after"][n].dtype
            spread = max(float((yi - x[n]).abs().max()) for yi in y)
            _close(at[0]["after"][n], want, (name, t, n, "server step"), ulps=8,
                   extra=0.0 if low == F64 else 4 * torch.finfo(low).eps * spread)
            c[n] = c[n] + _mean([new[i] - ci[i][n] for i in range(WORLD)])
            for i in range(WORLD):
                ci[i][n] = new[i]
            x[n] = at[0]["after"][n].double()  # step-wise: the next period starts from the code's x
        for n in FLOAT_BUFFERS:
            _close(at[0]["buffers"][n], _mean([st["local_buffers"][n] for st in at]), (name, t, n))
        nbytes = 2 * _trainable_bytes(results[0][name]["init"]) + sum(
            at[0]["buffers"][n].numel() * at[0]["buffers"][n].element_size() for n in FLOAT_BUFFERS)
        assert at[0]["bytes"] == nbytes, (name, t, at[0]["bytes"], nbytes)
        for i, st in enumerate(at):
            prev[i] = {n: st["after"][n].double() for n in TRAINABLE}
            stepped[i] = dict.fromkeys(TRAINABLE, 0)
            gsum[i] = {n: torch.zeros_like(x[n]) for n in TRAINABLE}
    assert syncs and syncs[-1] >= k - 1, (name, syncs)
    # every control variate above moved: rank 1 trained "extra" at even steps, rank 0 never
    assert any(float(ci[1][n].abs().max()) > 0 for n in TRAINABLE), name
    assert float(ci[0]["extra.weight"].abs().max()) == 0.0, name
