"""The hook keys its state by parameter name: two parameters must never share
a key. A model whose submodule is called ``module`` has ``module.weight``
beside its own ``weight``; the hook used to strip ``module.`` from the names
(a DDP prefix that ``bind`` has already removed by unwrapping), so both were
keyed ``weight`` and shared one error-feedback residual. Reference: top-k
with error feedback computed here per parameter in float64."""

from __future__ import annotations

import torch
import torch.nn as nn
from distributed import run_workers
from references import topk_dense
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress

K = 16  # topk:ratio=0.25 of 64 entries


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.module = nn.Linear(8, 8, bias=False)
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.module(x)) @ self.weight


def _worker(rank: int, world: int) -> dict:
    xs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(s)) for s in range(3)]  # same data on every rank
    model = Wrapper()
    ddp = DDP(model)
    hook = gradpress.ddp.register(ddp, "topk:ratio=0.25", min_numel=1, strategy="collective", error_feedback=True)
    got = []
    for x in xs:
        ddp.zero_grad()
        ddp(x).square().sum().backward()
        got.append({n: p.grad.detach().double().clone() for n, p in model.named_parameters()})
    keys = sorted(hook.state_dict()["feedback"]["residuals"])
    hook.close()
    # the reference: the plain gradients, top-k with a residual per parameter (every rank has the same ones)
    ref_model = Wrapper()
    residual = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in ref_model.named_parameters()}
    want = []
    for x in xs:
        ref_model.zero_grad()
        ref_model(x).square().sum().backward()
        step = {}
        for n, p in ref_model.named_parameters():
            acc = p.grad.double() + residual[n]
            step[n] = topk_dense(acc, K)
            residual[n] = acc - step[n]
        want.append(step)
    return {"got": got, "want": want, "keys": keys}


def test_a_submodule_named_module_keeps_its_own_residual() -> None:
    for r in run_workers(_worker, 2):
        assert len(r["keys"]) == 2, r["keys"]
        for got, want in zip(r["got"], r["want"]):
            for name in want:
                assert torch.allclose(got[name], want[name], atol=1e-5), name
