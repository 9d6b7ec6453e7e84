"""The local optimizers and learning-rate schedules training may use."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["OPTIMIZERS", "SCHEDULES", "make_optimizer", "optimizer_class", "set_lr"]

OPTIMIZERS = ("sgd", "momentum", "adam")
SCHEDULES = ("constant", "cosine")


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The torch class behind ``name`` (what an algorithm is handed)."""
    return torch.optim.Adam if name == "adam" else torch.optim.SGD


def make_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """``sgd``, ``momentum`` (SGD, momentum 0.9) or ``adam``."""
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return optimizer_class(name)(params, lr=lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float, schedule: str, step: int, horizon: int) -> None:
    """Before step ``step`` (0-based) of ``horizon``: ``cosine`` sets
    ``lr * (1 + cos(pi * step / horizon)) / 2``; ``constant`` leaves the
    groups' learning rate as it is."""
    if schedule == "cosine":
        for group in optimizer.param_groups:
            group["lr"] = lr * 0.5 * (1.0 + math.cos(math.pi * step / horizon))
