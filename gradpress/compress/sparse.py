"""Sparse kernels shared by the sparsifiers (top-k, random-k, threshold
methods, DGC, AdaComp): how many entries a density keeps, and the dense
tensor of a (values, indices) packet, and the sum of many such packets
without densifying each. Vectorized; no Python loop over elements."""

from __future__ import annotations

import math

import torch

__all__ = ["kept_count", "scatter_sparse", "sparse_sum", "topk_magnitude"]


def kept_count(numel: int, ratio: float) -> int:
    """k = ceil(ratio * d), at least 1 for a non-empty tensor."""
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(ratio * numel)))


def scatter_sparse(values: torch.Tensor, indices: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Dense tensor of ``shape`` with ``values`` at flat ``indices``."""
    out = torch.zeros(math.prod(shape), dtype=dtype, device=values.device)
    out.index_put_((indices.long(),), values.to(dtype), accumulate=False)
    return out.reshape(shape)


def sparse_sum(values: list[torch.Tensor], indices: list[torch.Tensor], numel: int, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Flat dense sum of sparse (values, flat indices) pairs, accumulated in
    list order (one ``index_put_(accumulate=True)`` over their concatenation).

    Used to average the top-k style packets of N ranks at once instead of
    decoding N dense tensors and adding them (N fills and N - 1 passes over
    d entries become one fill and N k scattered adds). On CPU the accumulation
    is serial, in the order given, so each entry is ``((0 + v_a) + v_b) + ...``
    over the pairs that hold it: equal to the rank-order fold of the dense
    decodes (adding an exact zero changes no finite value) and the same on
    every rank given the same lists. Not for CUDA, where accumulation order
    is not fixed. ``out``: a flat contiguous tensor of ``numel`` entries of
    ``dtype`` to write the sum into (zeroed first), else a new one."""
    if out is None:
        out = torch.zeros(numel, dtype=dtype, device=values[0].device if values else None)
    else:
        out.zero_()
    if values:
        idx = torch.cat([i.reshape(-1).long() for i in indices])
        val = torch.cat([v.reshape(-1).to(dtype) for v in values])
        out.index_put_((idx,), val, accumulate=True)
    return out


#: a candidate filter keeps about this many times k entries (the rest is an exact top-k among them)
_OVERSAMPLE = 2.0
#: one entry in this many is sampled to estimate the filter's threshold
_SAMPLE_STRIDE = 64


def topk_magnitude(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Flat indices (int64, unsorted) of ``k`` entries of largest magnitude:
    exactly the set ``torch.topk(flat.abs(), k)`` selects, up to ties at the
    k-th magnitude.

    On large tensors a full ``torch.topk`` is the step's largest cost (240 ms
    at 10M entries on one CPU thread, docs/bench.md). Here a strided sample
    (1 in 64) estimates the magnitude t above which about 2k entries lie; the
    entries with |x| >= t are found in one comparison pass and the top-k is
    taken among them (exact: every entry left out is below t, and at least k
    are not). When fewer than k pass (a skewed tensor), it falls back to the
    full ``torch.topk``. NaN magnitudes always pass the filter (``not a < t``),
    so they rank as ``torch.topk`` ranks them (above every number)."""
    d = flat.numel()
    a = flat.abs()
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64, device=flat.device)
    if d < 8 * _SAMPLE_STRIDE or k * _OVERSAMPLE * 4 > d:
        return torch.topk(a, k, sorted=False).indices
    sample = a[::_SAMPLE_STRIDE]
    want = min(sample.numel(), max(1, math.ceil(_OVERSAMPLE * k * sample.numel() / d)))
    t = torch.topk(sample, want, sorted=False).values.min()
    cand = torch.nonzero(a.lt(t).logical_not_()).reshape(-1)
    if cand.numel() < k or bool(torch.isnan(t)):
        return torch.topk(a, k, sorted=False).indices
    return cand[torch.topk(a[cand], k, sorted=False).indices]
