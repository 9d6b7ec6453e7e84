"""LGC with one top-k over the whole model (``per_tensor=false``) and a parameter no rank has a gradient for
(DDP's rule, :mod:`gradpress.algorithms.presence`: it is not stepped and keeps its state, so it takes no part in
the step): the leader's selection, and ``variant=ps``'s innovation top-k, are made among the parameters some
rank has. Before, such a parameter's kept residual competed for the k slots: with a large residual it took
most of them every step it stayed unused, its values were sent and dropped, and the other parameters got
what was left.

2 gloo workers, one spawn. ``head`` is used by both ranks at step 0 with a large loss weight (its residual
grows large: the global top-k keeps only a few of its entries), by no rank at steps 1, 2 and 4 and by rank 1
alone at step 3 (present: it competes, with zeros from rank 0). References in float64 from each step's
recorded inputs (each rank's accumulator ``g + residual``)."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import run_workers
from references import topk_indices

import gradpress.algorithms as algorithms

WORLD = 2
STEPS = 5
RATIO = 0.05
HEAD_USED = {0: (0, 1), 3: (1,)}  # step -> ranks whose loss uses head


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        self.head = torch.nn.Linear(8, 16)


def _loss(model: Model, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 8, generator=g, dtype=torch.float64)
    loss = torch.nn.functional.mse_loss(model.body(x), torch.sin(x[:, :4]))
    if rank in HEAD_USED.get(step, ()):
        loss = loss + 100.0 * model.head(x).pow(2).mean()
    return loss


def _run_one(rank: int, spec: str) -> dict:
    model = Model().double()  # float64: the references are exact
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    algo = algorithms.create(spec, model, opt)
    out: dict = {"acc": [], "residual": [], "grad": [], "mine": [], "phase": []}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        _loss(model, rank, step).backward()
        params = list(model.parameters())
        out["mine"].append([p.grad is not None for p in params])
        out["phase"].append(algo.phase)
        raw = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        out["acc"].append(raw + algo.residual)
        algo.step()
        out["grad"].append([None if p.grad is None else p.grad.detach().reshape(-1).clone() for p in params])
        out["residual"].append(algo.residual.clone())
    out["k"], out["k_inn"] = algo.k, algo.k_inn
    out["sizes"] = [p.numel() for p in model.parameters()]
    algo.close()
    return out


SPECS = {
    "phase2": f"lgc:dense_steps=0,ae_steps={STEPS},ratio={RATIO},per_tensor=false",
    "ps": f"lgc:dense_steps=0,ae_steps=1,ratio={RATIO},per_tensor=false,variant=ps,innovation=0.02",
}


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {name: _run_one(rank, spec) for name, spec in SPECS.items()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


def _present_mask(runs: list[dict], step: int) -> tuple[torch.Tensor, list[bool]]:
    """Per flat entry, whether some rank has its parameter's gradient at ``step``; and per parameter."""
    sizes = runs[0]["sizes"]
    present = [any(r["mine"][step][i] for r in runs) for i in range(len(sizes))]
    return torch.cat([torch.full((n,), some) for n, some in zip(sizes, present)]), present


def _reference_indices(acc: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest |acc| among the entries of parameters some rank has (the leader's selection)."""
    candidates = torch.nonzero(mask).reshape(-1)
    assert candidates.numel() >= k
    return candidates[topk_indices(acc[candidates], k)]


def test_head_is_absent_where_the_test_says(results: list[dict]) -> None:
    runs = [r["phase2"] for r in results]
    for step in range(STEPS):
        _, present = _present_mask(runs, step)
        assert present == [True] * 4 + [step in HEAD_USED] * 2, (step, present)
    assert runs[0]["phase"] == [2] * STEPS


def test_global_topk_selects_among_the_parameters_some_rank_has(results: list[dict]) -> None:
    """Phase 2, every step: the average is the mean over ranks of their accumulators at the leader's k
    largest |acc| among present parameters, zero elsewhere; each rank's residual is its accumulator with those
    entries taken out; a parameter no rank has keeps its residual exactly (and its ``.grad`` None)."""
    runs = [r["phase2"] for r in results]
    k, sizes = runs[0]["k"], runs[0]["sizes"]
    assert k == math.ceil(RATIO * sum(sizes))
    for step in range(STEPS):
        mask, present = _present_mask(runs, step)
        accs = [r["acc"][step] for r in runs]
        idx = _reference_indices(accs[step % WORLD], mask, k)
        expected = torch.zeros_like(accs[0])
        expected[idx] = (accs[0][idx] + accs[1][idx]) / WORLD
        for r, acc in zip(runs, accs):
            got = torch.cat([g if g is not None else torch.zeros(n, dtype=torch.float64)
                             for g, n in zip(r["grad"][step], sizes)])
            assert torch.allclose(got, expected, rtol=1e-12, atol=1e-15), (step, (got - expected).abs().max())
            assert [g is not None for g in r["grad"][step]] == present, step
            kept = acc.clone()
            kept[idx] = 0
            assert torch.equal(r["residual"][step], kept), (step, (r["residual"][step] - kept).abs().max())


def test_ps_selection_and_innovation_leave_an_absent_parameter_alone(results: list[dict]) -> None:
    """Phase 3 of ``variant=ps`` (steps 1-4): the master's indices are the reference selection among present
    parameters (the average lives on them and on the innovations); each rank's innovation takes k_inn entries
    of present parameters out of its residual (set to zero), none of a parameter no rank has, whose residual
    stays exactly as it was."""
    runs = [r["ps"] for r in results]
    k, k_inn, sizes = runs[0]["k"], runs[0]["k_inn"], runs[0]["sizes"]
    assert k_inn >= 2
    head = slice(sum(sizes[:4]), sum(sizes))
    assert runs[0]["phase"] == [2] + [3] * (STEPS - 1)
    for step in range(1, STEPS):
        mask, present = _present_mask(runs, step)
        accs = [r["acc"][step] for r in runs]
        idx = _reference_indices(accs[step % WORLD], mask, k)
        support = torch.zeros_like(mask)
        support[idx] = True
        for r, acc in zip(runs, accs):
            residual = r["residual"][step]
            zeroed = (residual == 0) & mask & (acc != 0)
            assert int(zeroed.sum()) == k_inn, (step, int(zeroed.sum()))  # all its innovation on present entries
            support |= zeroed
            if not present[4]:
                assert torch.equal(residual[head], acc[head]), step  # the previous residual, as it was
        for r in runs:
            got = torch.cat([g if g is not None else torch.zeros(n, dtype=torch.float64)
                             for g, n in zip(r["grad"][step], sizes)])
            assert torch.count_nonzero(got[~support]) == 0, step
            assert torch.count_nonzero(got[idx]) > 0, step
