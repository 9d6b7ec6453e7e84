"""Review of Leader SGD's edge cases on 2 gloo workers, each against what
the docs promise, checked on the workers' own values: a worker whose
parameters went NaN (NaN loss) is pulled with ``c = 1`` onto the (finite)
leader bit for bit, plain and ``average=true`` ("c = 1 leaves every worker
bit-identical to the leader"); a NaN loss never leads, not even against a
worker whose loss is +inf; ``eval_model()`` is the same model (buffers
included) on every rank: the leader's."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from distributed import run_workers
from test_algorithms import LR, loss_of, make_model

import gradpress.algorithms as algorithms

NAN_STEP = 0  # the step at which rank 1's loss (and so its gradient) is NaN; tau=2 elects after the next


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _lsgd_nan_worker(rank: int, spec: str) -> list[torch.Tensor]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    algo = algorithms.create(spec, model, opt)
    out = []
    for step in range(4):
        opt.zero_grad()
        loss = loss_of(model, rank, step)
        if rank == 1 and step == NAN_STEP:
            loss = loss * math.nan
        loss.backward()
        algo.step(loss.detach())
        out.append(flat(model))
    algo.close()
    return out


def _lsgd_inf_worker(rank: int) -> list[int]:
    """Rank 0 reports a NaN loss, rank 1 +inf: rank 1 must lead."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    algo = algorithms.create("lsgd:tau=1,c=0.5", model, opt)
    opt.zero_grad()
    loss_of(model, rank, 0).backward()
    algo.step(torch.tensor(math.nan if rank == 0 else math.inf, dtype=torch.float64))
    algo.close()
    return [algo.leaders["global"]]


def _bn_model() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3)).double()


def _lsgd_eval_worker(rank: int) -> dict:
    model = _bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algo = algorithms.create("lsgd:tau=2,c=0.5", model, opt)
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(16, 6, generator=g, dtype=torch.float64) * (1 + 3 * rank)  # the ranks' statistics differ
        opt.zero_grad()
        loss = ((model(x) - torch.sin(x[:, :3])) ** 2).mean()
        loss.backward()
        algo.step(loss.detach())
    own = {k: v.clone() for k, v in model.state_dict().items()}
    ev = {k: v.clone() for k, v in algo.eval_model().state_dict().items()}
    algo.close()
    return {"own": own, "eval": ev, "leader": algo.leaders["global"]}


def _worker(rank: int, world: int) -> dict:
    return {
        "nan_plain": _lsgd_nan_worker(rank, "lsgd:tau=2,c=1"),
        "nan_average": _lsgd_nan_worker(rank, "lsgd:tau=2,c=1,average=true"),
        "inf": _lsgd_inf_worker(rank),
        "eval": _lsgd_eval_worker(rank),
    }


_RESULTS: list[dict] = []


def results() -> list[dict]:
    if not _RESULTS:
        _RESULTS.extend(run_workers(_worker, 2))
    return _RESULTS


def test_lsgd_c_one_pulls_a_nan_worker_onto_the_leader_bit_for_bit() -> None:
    r0, r1 = results()
    for key in ("nan_plain", "nan_average"):
        assert torch.isnan(r1[key][NAN_STEP]).any(), key  # rank 1 diverged at the NaN step
        assert torch.isfinite(r0[key][NAN_STEP]).all(), key
        # the election after the second step: rank 0 (finite loss) leads; c = 1 copies it on every rank
        assert torch.equal(r0[key][1], r1[key][1]), (key, torch.isnan(r1[key][1]).sum())
        assert torch.isfinite(r1[key][3]).all() and torch.equal(r0[key][3], r1[key][3]), key


def test_lsgd_a_nan_loss_never_leads_against_an_infinite_loss() -> None:
    r0, r1 = results()
    assert r0["inf"] == r1["inf"] == [1]


def test_lsgd_eval_model_is_the_leaders_model_on_every_rank_buffers_included() -> None:
    r0, r1 = results()
    leader = (r0, r1)[r0["eval"]["leader"]]["eval"]["own"]
    assert r0["eval"]["leader"] == r1["eval"]["leader"]
    assert not torch.equal(r0["eval"]["own"]["1.running_mean"], r1["eval"]["own"]["1.running_mean"])
    for r in (r0, r1):
        for k, v in leader.items():
            assert torch.equal(r["eval"]["eval"][k], v), k
