"""Sparse kernels shared by the sparsifiers (top-k, random-k, threshold
methods, DGC, AdaComp): how many entries a density keeps, and the dense
tensor of a (values, indices) packet. Vectorized; no Python loop over
elements."""

from __future__ import annotations

import math

import torch

__all__ = ["kept_count", "scatter_sparse"]


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
