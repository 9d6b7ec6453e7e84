"""Measure the live group and fit the cost model (:mod:`gradpress.exchange.costs`).

Every rank times the primitives on the group and the compressor; the
per-point maximum over ranks is fitted on rank 0, which broadcasts the fit,
so every rank builds the identical plan from identical numbers. Repeated
timings and their median keep one noisy sample from deciding; the planner's
minimum gain (:class:`~gradpress.exchange.planner.Planner`) keeps a near tie
from flipping a decision between runs. For plans that are identical from run
to run, fit once (``gradpress bench plan --out costs.json``) and pass the
file as ``plan_costs``. A second or so on loopback.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gradpress.compress.base import Compressor, Context
from gradpress.exchange.costs import FIELDS, CostModel, Fit
from gradpress.exchange.strategies.recompress import densified
from gradpress.transport.p2p import exchange_bytes, global_rank

__all__ = ["measure"]


def _timed(fn: Any, reps: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    group: dist.ProcessGroup | None,
    compressor: Compressor,
    *,
    device: torch.device | str = "cpu",
    comm_sizes: tuple[int, ...] = (1 << 10, 1 << 15, 1 << 18, 1 << 20),
    compute_sizes: tuple[int, ...] = (1 << 10, 1 << 14, 1 << 17, 1 << 19),
    reps: int = 5,
    timer: Callable[[Callable[[], Any], int], float] | None = None,
) -> CostModel:
    """Time the primitives and the compressor on every rank of ``group``.

    Every point is the median of ``reps`` repetitions after a warm-up; the
    per-point maximum over ranks (the slowest rank bounds a synchronous
    step) is fitted on rank 0 and the fit broadcast: every rank returns the
    identical :class:`CostModel`, so ranks can never build different plans.
    The compressor is probed on a copy (its state stays as it was) with a
    private generator (the caller's random streams are untouched).
    ``timer(fn, reps)`` replaces the clock (tests). About a second on
    loopback."""
    timer = timer or _timed
    device = torch.device(device)
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    points: list[tuple[str, float]] = []  # (field, x) in a fixed order on every rank
    times: list[float] = []
    for size in comm_sizes:
        x = torch.zeros(size // 4, dtype=torch.float32, device=device)
        out = [torch.empty_like(x) for _ in range(n)]
        byte_buf = torch.zeros(size, dtype=torch.uint8, device=device)
        prims = {
            "allreduce": lambda x=x: (dist.all_reduce(x, group=group), _sync(device)),
            "allgather": lambda x=x, out=out: (dist.all_gather(out, x, group=group), _sync(device)),
            "broadcast": lambda x=x: (dist.broadcast(x, global_rank(group, 0), group=group), _sync(device)),
            "p2p": lambda b=byte_buf, size=size: (
                exchange_bytes({(rank + 1) % n: b}, {(rank - 1) % n: size}, group, False, device), _sync(device)
            ),
        }
        for name, fn in prims.items():
            if n == 1 and name == "p2p":
                continue
            points.append((name, float(size)))
            times.append(timer(fn, reps))
    probe = copy.deepcopy(compressor)  # stateful compressors keep per-key state sized by the first call
    root = densified(probe, n)
    gen = torch.Generator(device=device).manual_seed(0)
    for size in compute_sizes:
        x = torch.randn(size, device=device, generator=gen)
        ctx = Context(key=f"__gradpress_plan__{size}", step=0, rank=rank, world_size=n)
        pk = probe.encode(x, ctx)
        points += [("encode", float(size)), ("decode", float(size)), ("wire", float(size)), ("root_wire", float(size))]
        times += [
            timer(lambda x=x, ctx=ctx: (probe.encode(x, ctx), _sync(device)), reps),
            timer(lambda pk=pk: (probe.decode(pk), _sync(device)), reps),
            float(pk.nbytes),
            float(root.encode(x, ctx).nbytes),
        ]
    worst = torch.tensor(times, dtype=torch.float64)
    if n > 1:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    params = torch.zeros(3 * len(FIELDS), dtype=torch.float64)
    if rank == 0:
        pts: dict[str, tuple[list[float], list[float]]] = {f: ([], []) for f in FIELDS}
        for (field, x), t in zip(points, worst.tolist()):
            pts[field][0].append(x)
            pts[field][1].append(t)
        fits = {}
        for f in FIELDS:
            xs, ts = pts[f]
            if not xs:  # single worker: no point-to-point
                fits[f] = Fit(0.0, 0.0, 0.0)
            elif f in ("wire", "root_wire"):
                fits[f] = _linear(xs, ts)
            else:
                fits[f] = Fit.least_squares(xs, ts)
        params = CostModel(**fits).to_tensor()
    if n > 1:
        dist.broadcast(params, global_rank(group, 0), group=group)
    return CostModel.from_tensor(params)


def _linear(xs: list[float], ys: list[float]) -> Fit:
    """Ordinary least squares ``a + b x`` (sizes are exact, no weighting)."""
    k = len(xs)
    mx, my = sum(xs) / k, sum(ys) / k
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    b = max(b, 0.0)
    return Fit(0.0, my - b * mx, b)
