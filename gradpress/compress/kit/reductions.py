"""The kit's reductions: ``reduce`` per chunk (``norm``, ``absmax``,
``minmax``, ``sum``), range-safe (:mod:`gradpress.compress.numerics`), and
over the whole tensor :func:`extremes` and :func:`std`. Split from
:mod:`gradpress.compress.kit.primitives`, which re-exports them.

Invariants: no ``.item()`` and no Python loop over elements; a chunk loop
is over at most two views (the whole chunks and the short last one); a
finite input never gives a non-finite statistic unless the true value
exceeds the dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from gradpress.compress.kit import compiler
from gradpress.compress.numerics import centered_std, chunks, host_reads, row_norms

__all__ = ["reduce", "extremes", "std"]


@compiler.cpu_reduction
def _row_extremes(rows: torch.Tensor) -> torch.Tensor:
    return torch.stack([rows.amin(dim=1), rows.amax(dim=1)])


def _row_minmax(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.aminmax(rows, dim=1)``, bit for bit. On CPU ATen's row-wise
    aminmax ran 7x slower than ``amin`` and ``amax`` (57 ms against 8 ms for
    25M entries in rows of 1024, one thread), and those two compiled into one
    pass read the rows once instead of twice (:func:`_row_extremes`). They
    give aminmax's values except which zero a row with both signed zeros at
    its extreme returns and which NaN a row with a NaN returns: on CPU those
    rows (an extreme equal to 0, all-zero chunks being common, or NaN) are
    taken again from aminmax, which decides row by row alike."""
    if rows.device.type != "cpu":
        return torch.aminmax(rows, dim=1)
    if compiler.will_compile(_row_extremes, rows.numel(), rows.device.type):
        lo, hi = compiler.run(_row_extremes, rows.numel(), rows).unbind(0)
    else:
        lo, hi = rows.amin(dim=1), rows.amax(dim=1)
    tie = torch.nonzero((lo == 0) | (hi == 0) | torch.isnan(lo) | torch.isnan(hi)).reshape(-1)
    if tie.numel():
        t_lo, t_hi = torch.aminmax(rows.index_select(0, tie), dim=1)
        lo.index_copy_(0, tie, t_lo)
        hi.index_copy_(0, tie, t_hi)
    return lo, hi


@compiler.cpu_reduction
def _row_sums64(rows: torch.Tensor) -> torch.Tensor:
    return rows.sum(dim=1, dtype=torch.float64)


def _row_sums(rows: torch.Tensor) -> torch.Tensor:
    """Row sums in ``rows``' dtype, inf only where the true sum exceeds it. fp16, bf16 and fp32 accumulate in
    fp64 and round once (in bf16 or fp32, two entries near the largest gave inf): compiled on CPU, one read;
    eager, ATen copies the rows to fp64 first (30-40x the plain sum on CPU). fp64 rows whose sum is not finite
    are summed again scaled by 2^-ceil(log2(len)): on CPU only those, found from the sums, not the rows."""
    if rows.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return compiler.run(_row_sums64, rows.numel(), rows).to(rows.dtype)
    sums = rows.sum(dim=1)
    if not rows.is_floating_point() or rows.numel() == 0:
        return sums
    bad = ~torch.isfinite(sums)
    scale = 2.0 ** math.ceil(math.log2(max(rows.shape[1], 2)))  # no partial sum of finite entries overflows
    if not host_reads(rows):
        return torch.where(bad, (rows / scale).sum(dim=1) * scale, sums)
    if not bool(bad.any()):
        return sums
    idx = torch.nonzero(bad).reshape(-1)
    return sums.index_put_((idx,), (rows.index_select(0, idx) / scale).sum(dim=1) * scale)


_REDUCERS: dict[str, Callable[[torch.Tensor], Any]] = {
    "norm": row_norms,
    "absmax": lambda r: r.abs().amax(dim=1),
    "minmax": _row_minmax,
    "sum": _row_sums,
}


def reduce(flat: torch.Tensor, op: str, chunk: int) -> Any:
    """Per-chunk ``op`` of ``flat`` (one entry per chunk, the short last
    chunk included): ``norm`` (L2, no overflow or underflow), ``absmax``,
    ``sum`` (no overflow of partial sums: accumulated in fp64, rounded once
    to the input's dtype), or ``minmax`` (a ``(mins, maxs)`` pair)."""
    if op not in _REDUCERS:
        raise ValueError(f"kit.reduce: op got {op!r}; allowed: {', '.join(_REDUCERS)}")
    parts = [_REDUCERS[op](r) for r in chunks(flat, max(chunk, 1))]
    if op == "minmax":
        if not parts:
            return flat.new_zeros(0), flat.new_zeros(0)
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return torch.cat(parts) if parts else flat.new_zeros(0)


@compiler.cpu_reduction
def _sum64(flat: torch.Tensor) -> torch.Tensor:
    return flat.sum(dtype=torch.float64)


@compiler.cpu_reduction
def _deviation_sums(flat: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    dev = flat.to(torch.float64) - mean
    return torch.stack([(dev * dev).sum(), dev.sum()])


@compiler.cpu_reduction
def _extremes_sum64(flat: torch.Tensor) -> torch.Tensor:
    return torch.stack([flat.amin().to(torch.float64), flat.amax().to(torch.float64), flat.sum(dtype=torch.float64)])


def extremes(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(lo, hi, mean)`` of the non-empty flat floating ``flat``: its
    minimum and maximum (0-d, ``flat``'s dtype; NaN propagates) and, when
    compiled, its fp64 mean from the same pass (``None`` eager, where
    :func:`std` computes its own). One compiled read instead of
    ``aminmax`` and the first pass of :func:`std`: 4.4 against 4.2 + 2.9 ms
    at 25M fp32 entries, one thread (docs/bench.md "Index lanes")."""
    n = flat.numel()
    if not compiler.will_compile(_extremes_sum64, n, flat.device.type):
        lo, hi = torch.aminmax(flat)
        return lo, hi, None
    stats = compiler.run(_extremes_sum64, n, flat)
    return stats[0].to(flat.dtype), stats[1].to(flat.dtype), stats[2] / n


def std(flat: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, mean: torch.Tensor | None = None) -> torch.Tensor:
    """Population standard deviation of the flat floating ``flat`` whose
    minimum and maximum are ``lo`` and ``hi`` (0-d, ``flat``'s dtype; 0
    when ``lo == hi``, a constant infinite tensor included; otherwise
    non-finite for a non-finite input).

    Compiled (fp32, fp16, bf16): two read-only passes accumulating in fp64,
    the mean, then the sums of the deviations and of their squares (the
    corrected two-pass algorithm of Chan, Golub and LeVeque 1983). In fp64 no
    square of a finite fp32 entry overflows or underflows, so no scaling is
    needed; the result is the exact deviation rounded once. Eager (and fp64
    inputs): :func:`gradpress.compress.numerics.centered_std`, scaled passes
    in the input's dtype (fp32 for fp16/bf16) that write the deviations out,
    bit-identical to the hand-written methods; in fp32 their accumulation
    drifts with the size (3.6e-5 relative at 2M entries, 135 units in the
    last place at 1M), so compiled and eager differ by that much. At 25M
    entries, one thread: about 10 ms compiled against 70 ms eager
    (docs/bench.md). ``mean``: the fp64 mean :func:`extremes` computed in
    the same pass as ``lo`` and ``hi`` (the compiled path then reads
    ``flat`` once more, not twice)."""
    n = flat.numel()
    if flat.dtype == torch.float64 or not n or not compiler.will_compile(_deviation_sums, n, flat.device.type) \
            or not compiler.will_compile(_sum64, n, flat.device.type):
        if flat.dtype in (torch.float16, torch.bfloat16):  # numerics' scaling is for fp32 and fp64
            return centered_std(flat.float(), lo.float(), hi.float()).to(flat.dtype)
        return centered_std(flat, lo, hi)
    if mean is None:
        mean = compiler.run(_sum64, n, flat) / n
    sums = compiler.run(_deviation_sums, n, flat, mean) / n
    value = (sums[0] - sums[1] ** 2).clamp(min=0).sqrt().to(flat.dtype)
    return torch.where(lo == hi, torch.zeros_like(value), value)
