"""Measure the live group and fit the cost model (:mod:`gradpress.exchange.costs`).

The primitives are timed on the group (every rank takes part), the
compressor on rank 0 only; rank 0 fits and broadcasts the fit, so every rank
builds the identical plan from identical numbers. A second or so on
loopback.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from gradpress.compress.base import Compressor, Context
from gradpress.exchange.costs import FIELDS, CostModel, Fit
from gradpress.exchange.recompress import densified
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
    reps: int = 3,
) -> CostModel:
    """Time the primitives on ``group`` (every rank takes part) and the
    compressor (rank 0 only), fit on rank 0 and broadcast the fit: every rank
    returns the identical :class:`CostModel`. A second or so on loopback."""
    device = torch.device(device)
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    pts: dict[str, tuple[list[float], list[float]]] = {f: ([], []) for f in FIELDS}
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
            t = _timed(fn, reps)
            pts[name][0].append(float(size))
            pts[name][1].append(t)
    params = torch.zeros(3 * len(FIELDS), dtype=torch.float64)
    if rank == 0:
        # probe a copy: stateful compressors keep per-key state sized by the first call
        compressor = copy.deepcopy(compressor)
        root = densified(compressor, n)
        for size in compute_sizes:
            x = torch.randn(size, device=device)
            ctx = Context(key=f"__gradpress_plan__{size}", step=0, rank=0, world_size=n)
            pk = compressor.encode(x, ctx)
            pts["encode"][0].append(float(size))
            pts["encode"][1].append(_timed(lambda x=x, ctx=ctx: (compressor.encode(x, ctx), _sync(device)), reps))
            pts["decode"][0].append(float(size))
            pts["decode"][1].append(_timed(lambda pk=pk: (compressor.decode(pk), _sync(device)), reps))
            pts["wire"][0].append(float(size))
            pts["wire"][1].append(float(pk.nbytes))
            pts["root_wire"][0].append(float(size))
            pts["root_wire"][1].append(float(root.encode(x, ctx).nbytes))
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


def _linear(xs: list[float], ys: list[float]) -> Fit:
    """Ordinary least squares ``a + b x`` (sizes are exact, no weighting)."""
    k = len(xs)
    mx, my = sum(xs) / k, sum(ys) / k
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    b = max(b, 0.0)
    return Fit(0.0, my - b * mx, b)
