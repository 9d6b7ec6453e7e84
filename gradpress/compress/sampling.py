"""DGC's sampled threshold estimate (Lin et al. 2018, "Deep Gradient
Compression"), shared by ``dgc`` and ``dgc_threshold``: the k-th largest
magnitude of a strided sample of the tensor, the stride coprime with the
tensor's last dimension so every column is visited."""

from __future__ import annotations

import math

import torch

from gradpress.compress.base import derive_seed

__all__ = ["MIN_SAMPLES", "sample_stride", "sampled_threshold"]

MIN_SAMPLES = 4096


def sample_stride(d: int, target: int, period: int) -> int:
    """Stride close to d/target that is coprime with ``period`` (the tensor's
    last dimension), so a strided sample visits every column instead of a
    few (a weight gradient is an outer product: its columns differ in scale).
    Odd like the authors' ``32j + 1`` strides."""
    stride = max(1, d // target)
    if stride > 1 and stride % 2 == 0:
        stride -= 1
    while stride > 1 and math.gcd(stride, max(period, 1)) != 1:
        stride -= 2
    return max(stride, 1)


def sampled_threshold(a: torch.Tensor, ratio: float, sample_ratio: float, seed: int, period: int = 1) -> torch.Tensor:
    """Threshold estimate from a strided sample of ``a = |x|`` (0-d tensor;
    ``a`` may also be ``x`` itself: only the sample's magnitudes are taken).

    The sample has at least ``max(ceil(sample_ratio*d), ceil(2/ratio), 4096)``
    elements (the whole tensor when it is smaller), taken at a stride coprime
    with ``period`` (see :func:`sample_stride`) from a start derived from
    ``seed``; the threshold is the ceil(ratio*n_s)-th largest sample.
    """
    d = a.numel()
    target = max(math.ceil(sample_ratio * d), math.ceil(2.0 / ratio), MIN_SAMPLES)
    if d <= target:
        samples = a
    else:
        stride = sample_stride(d, target, period)
        start = derive_seed("dgc-sample", seed) % stride
        samples = a[start::stride]
    samples = samples.abs()
    k_s = min(samples.numel(), max(1, math.ceil(ratio * samples.numel())))
    return torch.topk(samples, k_s, sorted=False).values.min()
