"""LGC with a compressor in phase 1 (``--compressor`` applies to phase 1
only): what that compressor dropped into the engine's error-feedback
residual must not be abandoned when phase 2 starts. Reference: the
error-feedback identity in float64, computed here from the raw gradients:
sum over steps of the applied average = mean over ranks of (sum of the
rank's raw gradients - its residual), the residual being LGC's one flat
residual per rank (the engine must hold nothing more by then)."""

from __future__ import annotations

import torch
from distributed import run_workers

import gradpress.algorithms as algorithms

DENSE, AE, STEPS = 2, 2, 4  # phases 1 and 2 (the ring variant's phase 3 decodes the mean latent)


def _run(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    algo = algorithms.create(f"lgc:dense_steps={DENSE},ae_steps={AE},ratio=0.1", model, opt,
                             compressor="topk:ratio=0.1", min_numel=0)
    raw_sum = applied_sum = None
    for step in range(STEPS):
        opt.zero_grad()
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(16, 8, generator=g, dtype=torch.float64)
        torch.nn.functional.mse_loss(model(x), torch.sin(x[:, :4])).backward()
        raw = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
        algo.step()
        applied = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
        raw_sum = raw if raw_sum is None else raw_sum + raw
        applied_sum = applied if applied_sum is None else applied_sum + applied
    held = sum(float(v.abs().sum()) for v in algo.engine.feedback.residuals.values())
    return {"raw_sum": raw_sum, "applied_sum": applied_sum, "residual": algo.residual.clone(), "engine_held": held}


def test_phase1_residual_is_carried_into_lgc_residual() -> None:
    results = run_workers(_run, 2)
    expected = sum(r["raw_sum"] - r["residual"] for r in results) / len(results)
    for r in results:
        torch.testing.assert_close(r["applied_sum"], expected, rtol=1e-9, atol=1e-12)
        assert r["engine_held"] == 0.0, "the phase-1 residual still sits, unused, in the engine"
