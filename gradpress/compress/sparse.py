"""Sparse kernels shared by the sparsifiers (top-k, random-k, threshold
methods, DGC, AdaComp): how many entries a density keeps, and the dense
tensor of a (values, indices) packet, and the sum of many such packets
without densifying each. Vectorized; no Python loop over elements."""

from __future__ import annotations

import math

import torch

__all__ = ["MAX_INDEXED", "check_indexable", "kept_count", "scatter_sparse", "sparse_sum", "topk_magnitude"]

#: largest tensor a sparsifier's int32 flat indices can address
MAX_INDEXED = (1 << 31) - 1


def check_indexable(numel: int, name: str) -> None:
    """ValueError (naming compressor ``name``) for a tensor too large for
    int32 flat indices: they would wrap around to negative indices and the
    values land on the wrong coordinates, silently."""
    if numel > MAX_INDEXED:
        raise ValueError(f"compressor {name!r}: {numel} elements; allowed: at most {MAX_INDEXED} per tensor "
                         "(its flat indices are int32)")


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


#: integer view of each float dtype (for :func:`_rank_keys`)
_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
         torch.bfloat16: torch.int16}


def _rank_keys(mag: torch.Tensor) -> torch.Tensor:
    """Integers ordered as ``torch.topk`` orders the magnitudes ``mag``
    (``|x|``: no sign bit set): the bit patterns of non-negative floats
    increase with their value, and every NaN maps to the largest integer
    (NaN ranks above +inf, and all NaNs rank alike, whatever their payload)."""
    ints = _BITS.get(mag.dtype)
    if ints is None:  # integer input: its own values
        return mag
    keys = mag.contiguous().view(ints)
    return torch.where(torch.isnan(mag), torch.iinfo(ints).max, keys)


def _first_k(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Mask of the ``k`` largest ``keys``, ties at the k-th key resolved
    to the lowest positions."""
    kth = torch.topk(keys, k, sorted=False).values.min()
    above = keys > kth
    tied = keys == kth
    need = k - above.sum()
    return above | (tied & (tied.cumsum(0) <= need))


def topk_magnitude(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Flat indices (int64, **ascending**) of the ``k`` entries of largest
    magnitude. Ranking as ``torch.topk(flat.abs(), k)`` ranks (NaN above
    every number); ties at the k-th magnitude go to the lowest indices, so
    the result is a function of the values alone (``torch.topk`` breaks
    ties and orders its unsorted output as its kernel happens to).

    On large tensors a full ``torch.topk`` is the step's largest cost (110 ms
    at 10M entries on one CPU thread, docs/bench.md). Here a strided sample
    (1 in 64) estimates the magnitude t above which about 2k entries lie; the
    entries with |x| >= t are found in one comparison pass (ascending) and
    the top-k is taken among them (exact: every entry left out is below t,
    and at least k are not, so every entry tied with the k-th is a candidate).
    When fewer than k pass (a skewed tensor) or the sample holds a NaN, the
    selection runs on the whole tensor. NaN magnitudes always pass the filter
    (``not a < t``)."""
    d = flat.numel()
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64, device=flat.device)
    if k >= d:
        return torch.arange(d, device=flat.device)
    a = flat.reshape(-1).abs()
    if d >= 8 * _SAMPLE_STRIDE and k * _OVERSAMPLE * 4 <= d:
        sample = a[::_SAMPLE_STRIDE]
        want = min(sample.numel(), max(1, math.ceil(_OVERSAMPLE * k * sample.numel() / d)))
        t = torch.topk(sample, want, sorted=False).values.min()
        if not bool(torch.isnan(t)):
            cand = torch.nonzero(a.lt(t).logical_not_()).reshape(-1)
            if cand.numel() >= k:
                return cand[_first_k(_rank_keys(a[cand]), k)]
    return torch.nonzero(_first_k(_rank_keys(a), k)).reshape(-1)
