"""Sparse kernels shared by the sparsifiers (top-k, random-k, threshold
methods, DGC, AdaComp): how many entries a density keeps, and the dense
tensor of a (values, indices) packet, and the sum of many such packets
without densifying each. Vectorized; no Python loop over elements."""

from __future__ import annotations

import math

import torch

__all__ = ["kept_count", "scatter_sparse", "sparse_sum"]


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
