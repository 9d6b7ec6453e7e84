"""Comprex with ``nonfinite='skip'``: a step some rank's gradient made
non-finite is dropped on every rank, and the Comprex optimizer's state (the
local momentum buffer) must stay as it was on every rank, as DDP's loop
leaves its optimizer's momentum alone. Reference: heavy ball in float64 by
the formula, with the skipped step left out."""

from __future__ import annotations

import torch
from distributed import run_workers

import gradpress.algorithms as algorithms

LR, MU, STEPS, BAD_STEP, BAD_RANK = 0.1, 0.9, 4, 1, 1


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(31 * step + rank)
    return [torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)]


def _run(rank: int, world: int, staleness: int) -> dict:
    torch.set_num_threads(1)
    model = torch.nn.Linear(3, 5).double()
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    algo = algorithms.create(f"comprex:staleness={staleness},clip=0,momentum={MU},lookahead=off", model, opt,
                             compressor="none", nonfinite="skip")
    for step in range(STEPS):
        for p, g in zip(model.parameters(), _grads(rank, step)):
            p.grad = g.clone()
            if step == BAD_STEP and rank == BAD_RANK:
                p.grad[0] = float("nan")
        algo.step()
    algo.close()
    return {"x": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "m": torch.cat([m.reshape(-1) for m in algo.momentum_state.buffers])}


def _reference(world: int, staleness: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    m = [torch.zeros(20, dtype=torch.float64) for _ in range(world)]
    updates = []
    for step in range(STEPS):
        if step == BAD_STEP:  # skipped on every rank: no momentum moves, nothing applied
            updates.append(None)
            continue
        for r in range(world):
            m[r] = MU * m[r] + LR * torch.cat([g.reshape(-1) for g in _grads(r, step)])
        updates.append(sum(m) / world)
    x = torch.zeros(20, dtype=torch.float64)
    for step in range(STEPS - staleness):  # the last `staleness` exchanges are never applied
        if updates[step] is not None:
            x = x - updates[step]
    return x, m


def test_skipped_step_leaves_the_comprex_momentum_alone() -> None:
    staleness = 0
    results = run_workers(_run, 2, staleness)
    x_ref, m_ref = _reference(2, staleness)
    for r, res in enumerate(results):
        torch.testing.assert_close(res["m"], m_ref[r], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(res["x"], x_ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(results[0]["x"], results[1]["x"])


def _refused(rank: int, world: int) -> str:
    model = torch.nn.Linear(3, 5).double()
    try:
        algorithms.create("comprex:staleness=1", model, torch.optim.SGD(model.parameters(), lr=LR),
                          compressor="none", nonfinite="skip")
    except ValueError as exc:
        return str(exc)
    return ""


def test_skip_with_stale_comprex_momentum_is_refused_naming_the_fields() -> None:
    """With staleness >= 1 the next steps' momentum is formed before a
    step's verdict arrives, so a skipped step cannot leave it alone."""
    for msg in run_workers(_refused, 2):
        for word in ("nonfinite='skip'", "update='comprex'", "staleness=1", "allowed", "staleness=0"):
            assert word in msg, msg
