"""Review F: finite extreme inputs for the threshold sparsifiers, DGC's
local clipping and PowerSGD's warm start. Every reference is computed here
in float64 from the paper's formula or the input itself; a finite gradient
must never come back as NaN/Inf, an exception, or silently as zeros."""

from __future__ import annotations

import pytest
import torch

from gradpress.compress import Context, create

F64_MAX = torch.finfo(torch.float64).max


@pytest.mark.parametrize("spec", ["sidco", "sidco:dist=gpareto", "sidco:dist=gamma", "gaussiank", "dgc_threshold"])
def test_threshold_search_near_fp64_max_keeps_exact_values(spec: str) -> None:
    """The density correction's search stepped its threshold past e^709.78
    (``math.exp`` raised OverflowError) on fp64 data near the dtype's max."""
    x = torch.full((64,), 0.9 * F64_MAX, dtype=torch.float64)
    x[::2] = -x[::2]
    comp = create(spec)
    packet = comp.encode(x, Context(key="w", step=0))
    y = comp.decode(packet)
    assert torch.isfinite(y).all()
    kept = y != 0
    assert kept.any()
    assert torch.equal(y[kept], x[kept])  # a sparsifier sends exact values
