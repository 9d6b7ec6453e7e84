"""The one evaluation function of training and of the benchmarks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradpress import workloads

__all__ = ["evaluate"]


def evaluate(wl: workloads.Workload, model: torch.nn.Module, device: torch.device | None = None, rank: int = 0,
             world: int = 1, chunk: int = 1024) -> float:
    """The workload's metric over its test set: each rank scores a strided
    shard (``rank::world``) in chunks of ``chunk`` samples; the (sum, count)
    pair is all-reduced (when a process group is up), so every rank gets the
    same value; a rank past the end of a test set smaller than the world
    scores nothing and contributes (0, 0). The model is left in training mode."""
    device = device if device is not None else torch.device("cpu")
    x, y = wl.test
    idx = torch.arange(len(y))[rank::world]  # empty past the end (arange(rank, n, world) raised there)
    total = torch.zeros(2, dtype=torch.float64, device=device)
    model.eval()
    with torch.no_grad():
        for part in idx.split(chunk) if len(idx) else ():  # an empty shard runs no forward
            s, n = wl.score(model(x[part].to(device)), y[part].to(device))
            total[0] += s
            total[1] += n
    model.train()
    if dist.is_initialized():
        dist.all_reduce(total)
    return float(total[0] / total[1].clamp_min(1))
