"""Shared sparse kernels (compress/sparse.py): the exact top-k by magnitude
with a sampled candidate filter, against a reference computed here
(float64 magnitudes, a stable full sort: ties to the lowest index; indices
ascending)."""

from __future__ import annotations

import pytest
import torch
from references import topk_indices

from gradpress.compress.sparse import topk_magnitude


def _kth(x: torch.Tensor, k: int) -> float:
    return float(x.double().abs().sort(descending=True).values[k - 1])


@pytest.mark.parametrize("kind", ["normal", "heavy", "skewed", "zeros", "constant", "small"])
def test_topk_magnitude_keeps_exactly_the_k_largest(kind: str) -> None:
    gen = torch.Generator().manual_seed(3)
    d = 200_003
    x = {
        "normal": lambda: torch.randn(d, generator=gen),
        "heavy": lambda: torch.randn(d, generator=gen) ** 5,
        # every large entry in one region: the strided sample sees few of them
        "skewed": lambda: torch.cat([torch.randn(1000, generator=gen) * 100, torch.randn(d - 1000, generator=gen)]),
        "zeros": lambda: torch.cat([torch.zeros(d - 50), torch.randn(50, generator=gen)]),
        "constant": lambda: torch.full((d,), 0.5),
        "small": lambda: torch.randn(300, generator=gen),
    }[kind]()
    for k in (1, 7, 200, 2000):
        k = min(k, x.numel())
        idx = topk_magnitude(x, k)
        assert idx.numel() == k and idx.unique().numel() == k
        # the rule: the k first of a stable sort by float64 magnitude, descending (ties: lower index
        # first), returned in ascending index order
        assert torch.equal(idx, topk_indices(x, k)), (kind, k)
        kept = x.double().abs()[idx]
        kth = _kth(x, k)
        assert float(kept.min()) == kth  # nothing kept below the k-th magnitude
        dropped = torch.ones(x.numel(), dtype=torch.bool)
        dropped[idx] = False
        if bool(dropped.any()):
            assert float(x.double().abs()[dropped].max()) <= kth  # nothing dropped above it


def test_topk_magnitude_nan_falls_back() -> None:
    x = torch.randn(100_000)
    x[5] = float("nan")
    idx = topk_magnitude(x, 100)
    assert torch.equal(idx, topk_indices(x, 100))
    assert 5 in idx.tolist()  # NaN ranks above every number


@pytest.mark.parametrize("d", [64, 64 * 5 + 1, 64 * 5 + 37, 37])
def test_block_max_selects_exactly_the_entries_at_or_above_the_threshold(d: int) -> None:
    """``BlockMax`` (rows of 64 and a short tail) against ``nonzero(|x| >= t)``:
    the same indices in the same order, the tail's included, and its count
    and max |x|; NaN entries always qualify."""
    from gradpress.compress._threshold_select import BlockMax

    x = torch.randn(d, generator=torch.Generator().manual_seed(d))
    x[-5:] = torch.tensor([3.0, -0.1, -4.0, 0.2, 5.0])[: min(5, d)]  # tail entries above the threshold, not first
    for thr in (2.5, 0.15, 10.0):
        bm = BlockMax(x)
        want = torch.nonzero(x.abs() >= thr).reshape(-1)
        assert torch.equal(bm.select(torch.tensor(thr)), want), (d, thr)
        assert bm.count(torch.tensor(thr)) == want.numel()
    assert float(BlockMax(x).abs_max()) == float(x.abs().max())
    x[d // 2] = float("nan")
    assert (d // 2) in BlockMax(x).select(torch.tensor(2.5)).tolist() and torch.isnan(BlockMax(x).abs_max())
