"""Random engine configurations on 3 and 4 gloo workers (a seeded fuzz).

Each case draws a registered compressor (its small test spec), a strategy
that accepts it (flat ones, ``hierarchical`` with 1 or 2 ranks per host and
with or without pipelining, ``union``, ``cyclic``, ``auto``), 1-4 tensors
of mixed shapes and dtypes, a kind of values (normal, near the dtype's
maximum / 16, near its smallest normal, zeros, mixed scales, one non-zero),
error feedback on/off/default, ``min_numel`` and the NaN/Inf mode; in 30%
of the cases the last rank's first tensor holds a NaN at the second of
three steps. Checked against what the test states by definition:

* every rank ends each step with the same tensors (NaN where NaN, equal
  elsewhere), of the input's shape and dtype;
* finite inputs give finite averages (a codec never turns a finite
  gradient into NaN/Inf);
* ``none`` gives the float64 mean of the ranks' inputs within a few ulps;
* a NaN step under ``propagate`` leaves the bad tensor non-finite on every
  rank; under ``skip`` every tensor of the call is zero on every rank;
  either way the next step's averages are finite again (residuals kept).

The suite runs 2 x 48 seeded cases; ``-m long`` runs 600 more.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from fuzzing import check_cases, draw_pair, raised, run_cases, same

from gradpress.exchange.engine import Synchronizer

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
STRATEGIES = ["collective", "allreduce", "allgather", "ring", "ps", "hierarchical:workers_per_host=1",
              "hierarchical:workers_per_host=2,chunk=64", "hierarchical:workers_per_host=2,chunk=0",
              "union", "cyclic", "auto"]
SHAPES = [(3,), (40, 30), (17, 65), (128, 9), (5, 4, 3), (2000,), (33, 33)]
KINDS = ["normal", "huge", "tiny", "zeros", "mixed", "single"]
STEPS = 3


def values(kind: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    base = torch.randn(n, generator=gen, dtype=torch.float64)
    finfo = torch.finfo(dtype)
    if kind == "huge":
        x = base / (base.abs().max() + 1e-30) * (finfo.max / 16)
    elif kind == "tiny":
        x = base * finfo.tiny * 4
    elif kind == "zeros":
        x = torch.zeros(n, dtype=torch.float64)
    elif kind == "mixed":
        x = base * torch.logspace(-3, 3, n, dtype=torch.float64)
    elif kind == "single":
        x = torch.zeros(n, dtype=torch.float64)
        x[n // 3] = 2.5
    else:
        x = base
    return x.to(dtype).reshape(shape)


def draw_case(seed: int, world: int) -> dict | None:
    """The configuration of case ``seed`` (the same on every rank), or None
    when the drawn strategy refuses the drawn compressor."""
    rnd = random.Random(seed)
    pair = draw_pair(rnd, STRATEGIES, lambda s: "hierarchical:workers_per_host=1" if "=2" in s and world % 2 else s)
    if pair is None:
        return None
    spec, strategy = pair
    tensors = [(rnd.choice(SHAPES), rnd.choice(DTYPES) if rnd.random() < 0.5 else torch.float32)
               for _ in range(rnd.randint(1, 4))]
    return {"seed": seed, "spec": spec, "strategy": strategy, "tensors": tensors, "kind": rnd.choice(KINDS),
            "ef": rnd.choice([None, True, False]), "nonfinite": rnd.choice(["propagate", "skip"]),
            "min_numel": rnd.choice([0, 16, 1024]), "nan": rnd.random() < 0.3}


def _worker(rank: int, world: int, seeds: list[int]) -> list[dict]:
    def run(case: dict, res: dict) -> None:
        res["steps"] = []
        params = [(f"t{i}", shape, dtype) for i, (shape, dtype) in enumerate(case["tensors"])]
        engine = Synchronizer(case["spec"], params=params, strategy=case["strategy"], error_feedback=case["ef"],
                              nonfinite=case["nonfinite"], min_numel=case["min_numel"], seed=7)
        for step in range(STEPS):
            ts = [values(case["kind"], shape, dtype, 1000 * case["seed"] + 10 * step + 101 * rank + i)
                  for i, (shape, dtype) in enumerate(case["tensors"])]
            if case["nan"] and step == 1 and rank == world - 1:
                ts[0].view(-1)[0] = float("nan")
            inputs = [t.clone() for t in ts]
            engine.sync([k for k, _, _ in params], ts, step=step)
            res["steps"].append((inputs, ts))

    return run_cases(seeds, lambda seed: draw_case(seed, world), run)


def problems(per_rank: list[dict]) -> list[str]:
    """What is wrong with one case's results on every rank (empty: nothing)."""
    case = per_rank[0]["case"]
    if raised(per_rank):
        return raised(per_rank)
    found = []
    for step in range(STEPS):
        outs = [r["steps"][step][1] for r in per_rank]
        ins = [r["steps"][step][0] for r in per_rank]
        for i, (shape, dtype) in enumerate(case["tensors"]):
            avg = outs[0][i]
            where = f"step {step} tensor {i}"
            if not all(same(o[i], avg) for o in outs):
                found.append(f"{where}: replicas differ")
            if tuple(avg.shape) != tuple(shape) or avg.dtype != dtype:
                found.append(f"{where}: {tuple(avg.shape)} {avg.dtype}, input {tuple(shape)} {dtype}")
            bad_step = case["nan"] and step == 1
            if bad_step and case["nonfinite"] == "skip":
                if not all(torch.equal(o[i], torch.zeros_like(o[i])) for o in outs):
                    found.append(f"{where}: skipped step not zero")
                continue
            if bad_step and i == 0:
                if torch.isfinite(avg).all():
                    found.append(f"{where}: the NaN was lost")
                continue
            if all(torch.isfinite(x[i]).all() for x in ins) and not torch.isfinite(avg).all():
                found.append(f"{where}: finite inputs, non-finite average")
            if case["spec"] == "none" and all(torch.isfinite(x[i]).all() for x in ins):
                ref = torch.stack([x[i].double() for x in ins]).mean(0)
                finfo = torch.finfo(dtype)
                tol = 4 * finfo.eps * ref.abs().max().item() + 4 * finfo.tiny
                err = (avg.double() - ref).abs().max().item()
                if err > tol:
                    found.append(f"{where}: none differs from the float64 mean by {err:.3g} > {tol:.3g}")
    return found


def _check(world: int, seeds: list[int]) -> None:
    check_cases(_worker, problems, world, seeds, least=len(seeds) // 2)


@pytest.mark.parametrize("world,seeds", [(3, range(0, 48)), (4, range(1000, 1048))])
def test_random_engine_configurations(world: int, seeds: range) -> None:
    _check(world, list(seeds))


@pytest.mark.long
@pytest.mark.parametrize("world,seeds", [(2, range(2000, 2200)), (3, range(3000, 3200)), (4, range(4000, 4200))])
def test_random_engine_configurations_long(world: int, seeds: range) -> None:
    _check(world, list(seeds))
