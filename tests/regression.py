"""The tiny regression task the multi-process DDP tests train on, and the
training loop they share: ``y = tanh(x w)`` with x drawn per rank (a seed of
its own) and w shared, squared-error loss."""

from __future__ import annotations

from collections.abc import Callable

import torch


def regression_data(rank: int, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """128 samples of 24 features for ``rank``; 3 targets from the shared weights."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(128, 24, generator=gen)
    w = torch.randn(24, 3, generator=torch.Generator().manual_seed(7))
    return x.to(device), torch.tanh(x @ w).to(device)


def fit(net: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, steps: int,
        step: Callable[[], None] | None = None) -> list[float]:
    """``steps`` steps of squared-error regression; ``step`` replaces
    ``opt.step`` (an algorithm's step). Returns the losses."""
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((net(x) - y) ** 2).mean()
        loss.backward()
        (step or opt.step)()
        losses.append(loss.item())
    return losses


def train_hook_and_diloco(rank: int, strategy: str) -> dict:
    """24 steps of the regression through the DDP hook (top-k 10%) and
    through DiLoCo (period 4, top-k 20% outer gradient), both on
    ``strategy``: each run's losses, flat parameters and stats."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradpress
    from gradpress import algorithms

    out = {}
    for how in ("hook", "diloco"):
        torch.manual_seed(1234)
        model = nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 3))
        x, y = regression_data(rank)
        if how == "hook":
            net: nn.Module = DDP(model)
            hook = gradpress.ddp.register(net, "topk:ratio=0.1", strategy=strategy, min_numel=64)
            opt = torch.optim.SGD(net.parameters(), lr=0.05)
            step = opt.step
        else:
            net = model
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            hook = algorithms.create("diloco:period=4,outer_momentum=0.5", model, opt, compressor="topk:ratio=0.2",
                                     strategy=strategy, min_numel=64)
            step = hook.step
        losses = fit(net, opt, x, y, 24, step)
        out[how] = {"losses": losses, "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                    "stats": dict(hook.stats)}
        if how == "hook":
            hook.close()
    return out
