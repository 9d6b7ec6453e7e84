"""The one training loop, and its building blocks: the data order, one
step, the loop over steps. ``gradpress train`` (:mod:`gradpress.train.session`)
and the end-to-end benchmark (``gradpress.bench.e2e_worker``) both run it.

Data (``--split iid``, the default): every epoch is a permutation of the
training set drawn from (seed, epoch) alone; rank r trains on slice r of it
(equal-sized, disjoint shards; the remainder of N // world is dropped). With
a non-IID split (:mod:`gradpress.train.splits`) rank r keeps one fixed shard
for the whole run and walks it in an order drawn from (seed, epoch, rank).
Either way the position in the data is fully described by (epoch, batch)
(and the reshards inside that epoch: :func:`gradpress.train.reshard.epoch_rows`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from gradpress.train.optim import set_lr
from gradpress.train.precision import Precision
from gradpress.train.splits import shard_order

__all__ = ["epoch_order", "steps_per_epoch", "shard_batches", "train_step", "Tick", "run_steps"]


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation of ``n`` training samples for ``epoch`` (its own generator:
    the global RNG is not touched)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch * 7919 + 17) % (2**63 - 1))
    return torch.randperm(n, generator=g)


def steps_per_epoch(n: int, world: int, batch_size: int, workload: str = "the workload",
                    shard: int | None = None, split: str = "iid") -> int:
    """Full batches in a worker's shard: ``n // world`` samples (iid), or ``shard`` (a non-IID split's shard
    size, the same on every worker)."""
    per_rank = n // world if shard is None else shard
    per_epoch = per_rank // batch_size
    if per_epoch < 1:
        if shard is not None:
            raise ValueError(f"batch_size {batch_size} exceeds the {shard} samples of each worker's shard under "
                             f"split {split!r} ({n} training samples of {workload!r}, {world} workers); use a "
                             f"smaller --batch-size")
        raise ValueError(f"batch_size {batch_size} x {world} workers exceeds the {n} training samples "
                         f"of {workload!r}; use a smaller --batch-size")
    return per_epoch


def shard_batches(x: torch.Tensor, y: torch.Tensor, *, seed: int, rank: int, world: int, batch_size: int,
                  epochs: int, start: tuple[int, int] = (0, 0), count: int | None = None,
                  shard: torch.Tensor | None = None,
                  resumed: tuple[torch.Tensor, int] | None = None) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """This rank's batches ``(epoch, batch, x, y)`` from position ``start``
    = (epoch, batch) on, at most ``count`` of them, until ``epochs`` ends.
    ``shard``: this rank's fixed sample indices under a non-IID split
    (:func:`gradpress.train.splits.assign`; None: iid). ``resumed``: this
    rank's sample indices of epoch ``start[0]`` and the number of their first
    batch, when a reshard inside that epoch dealt its rest anew
    (:func:`gradpress.train.reshard.epoch_rows`)."""
    n = len(y)
    per_rank = n // world
    per_epoch = steps_per_epoch(n, world, batch_size, shard=None if shard is None else len(shard))
    done = 0
    for epoch in range(start[0], epochs):
        first = 0
        if resumed is not None and epoch == start[0]:
            order, first = resumed[0].to(x.device), resumed[1]
        elif shard is None:
            order = epoch_order(n, seed, epoch)[rank * per_rank:(rank + 1) * per_rank].to(x.device)
        else:
            order = shard_order(shard, seed, epoch, rank).to(x.device)
        for b in range(start[1] if epoch == start[0] else 0, per_epoch):
            if count is not None and done >= count:
                return
            idx = order[(b - first) * batch_size:(b - first + 1) * batch_size]
            done += 1
            yield epoch, b, x[idx], y[idx]


def train_step(algo: Any, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
               x: torch.Tensor, y: torch.Tensor, precision: Precision | None = None) -> torch.Tensor:
    """zero_grad, forward and backward through ``algo.model``, then
    ``algo.step()`` (the optimizer step and the algorithm's exchange).
    ``precision`` (:mod:`gradpress.train.precision`; None: fp32): the forward
    and the loss under its autocast, the backward through its loss scaler
    (which ``algo`` was given, and which unscales, steps and updates in
    ``algo.step()``). The loss returned is unscaled."""
    optimizer.zero_grad(set_to_none=True)
    if precision is None:
        loss = loss_fn(algo.model(x), y)
        loss.backward()
    else:
        with precision.autocast():
            loss = loss_fn(algo.model(x), y)
        precision.backward(loss)
    algo.step()
    return loss


@dataclasses.dataclass
class Tick:
    """One finished step: ``step`` counts every step so far (this one included)."""

    step: int
    epoch: int
    batch: int
    loss: torch.Tensor
    seconds: float


def run_steps(algo: Any, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
              batches: Iterable[tuple[int, int, torch.Tensor, torch.Tensor]], *, lr: float, schedule: str,
              horizon: int, step: int = 0, device: torch.device | None = None,
              after: Callable[[Tick], bool | None] | None = None, schedule_shift: int = 0,
              precision: Precision | None = None) -> int:
    """The training loop: for each batch, set the scheduled learning rate, run
    :func:`train_step`, time it (on CUDA after a device synchronization),
    then call ``after(tick)`` outside the timed region; it returns True to
    stop. ``step``: steps already done (the schedule's position, plus
    ``schedule_shift`` after a change of world size: :mod:`gradpress.train.reshard`).
    ``precision``: :func:`train_step`'s. Returns the number of steps done."""
    for epoch, b, x, y in batches:
        t0 = time.perf_counter()
        set_lr(optimizer, lr, schedule, step + schedule_shift, horizon)
        # fp32 calls train_step as before mixed precision existed (a wrapper of it with that signature keeps working)
        loss = train_step(algo, optimizer, loss_fn, x, y) if precision is None else \
            train_step(algo, optimizer, loss_fn, x, y, precision=precision)
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        step += 1
        if after is not None and after(Tick(step, epoch, b, loss, dt)):
            break
    return step
