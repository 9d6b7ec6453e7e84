"""Streaming DiLoCo's floating buffers (BatchNorm statistics) on 2 gloo
workers: they travel with the fragment launched at offset 0 of each period
and are averaged plain; at that fragment's merge every worker's buffers are
the mean, computed here in float64, of the workers' buffers at its launch
(the documented rule: what the overlapped step's forward pass added since
the launch is discarded on every rank); at the other fragments' merges they
stay each worker's own."""

from __future__ import annotations

import torch
import torch.nn as nn
from distributed import run_workers

import gradpress.algorithms as algorithms

SPEC = "streaming-diloco:period=4,fragments=2,overlap=1,outer_momentum=0.5"
STEPS = 9


def _model() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3)).double()


def _worker(rank: int, world: int) -> dict:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algo = algorithms.create(SPEC, model, opt)
    buffers, steps = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(16, 6, generator=g, dtype=torch.float64) * (1 + rank)  # the ranks' statistics differ
        opt.zero_grad()
        loss = ((model(x) - torch.sin(x[:, :3])) ** 2).mean()
        loss.backward()
        algo.step()
        buffers.append([b.detach().clone() for b in model.buffers() if b.is_floating_point()])
        steps.append(algo._steps)
    return {"buffers": buffers, "steps": steps, "launch_at": dict(algo.launch_at)}


def test_buffers_travel_with_the_offset_zero_fragment_and_are_averaged() -> None:
    r0, r1 = run_workers(_worker, 2)
    period, overlap = 4, 1
    carrier = r0["launch_at"][0]  # the fragment launched when steps % period == 0
    assert r0["launch_at"] == r1["launch_at"] and carrier is not None
    merges = [i for i, s in enumerate(r0["steps"]) if s >= period and (s - overlap) % period == 0]
    others = [i for i, s in enumerate(r0["steps"]) if s > overlap and (s - overlap) % period != 0]
    assert merges and others
    for i in merges:  # merged at step i: launched at step i - overlap (same list index offset)
        for b0, b1, l0, l1 in zip(r0["buffers"][i], r1["buffers"][i], r0["buffers"][i - overlap],
                                  r1["buffers"][i - overlap]):
            want = (l0.double() + l1.double()) / 2
            assert torch.equal(b0, b1), i
            assert torch.allclose(b0, want, rtol=0, atol=1e-12), (i, (b0 - want).abs().max())
    for i in others:  # no buffers in these merges: each worker keeps its own statistics
        assert any(not torch.equal(b0, b1) for b0, b1 in zip(r0["buffers"][i], r1["buffers"][i])), i
