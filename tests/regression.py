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
