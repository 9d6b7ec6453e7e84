"""Review: the threshold estimators (gaussiank, sidco, dgc_threshold,
redsync) are scale equivariant by their definitions, so data near the
dtype's maximum must select what the same data at unit scale selects;
their statistics overflowed there (sums of |x|, squares, a threshold above
the dtype's max)."""

from __future__ import annotations

import pytest
import torch

from gradpress.compress import Context, create

#: the largest power of two each dtype holds: data u * 2^E with |u| <= 1.7 is finite and near the max
_TOP_EXP = {torch.float16: 15, torch.bfloat16: 127, torch.float32: 127, torch.float64: 1023}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("spec", ["gaussiank", "sidco", "sidco:dist=gpareto", "sidco:dist=gamma", "dgc_threshold",
                                  "redsync"])
@pytest.mark.parametrize("correction", ["none", "adaptive"])
def test_threshold_estimators_are_scale_equivariant_up_to_the_dtype_max(spec: str, correction: str,
                                                                         dtype: torch.dtype,
                                                                         request: pytest.FixtureRequest) -> None:
    """Every estimate is scale equivariant (each docstring: the fitted laws,
    the Gaussian, the sample's order statistic, RedSync's mean and max), and
    so is the density correction's state. Data near the dtype's max is the
    same data times 2^E (exact), so the selections must be those of the data
    at unit scale, call after call, within a boundary entry. Sums over
    |x| overflowed there: sidco and redsync selected every entry."""
    if correction == "adaptive" and spec in ("gaussiank", "sidco") and dtype != torch.float16:
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "known, left: the estimate itself exceeds the dtype's max here (inf); the density correction's "
            "per-tensor scale cannot learn from an infinite estimate, so every call searches again from "
            "max|x| and ends near 7x the target density")))
    full = f"{spec}{',' if ':' in spec else ':'}ratio=0.01,correction={correction}"
    unit, big = create(full), create(full)
    g = torch.Generator().manual_seed(4)
    for step in range(3):
        u = ((torch.rand(20000, generator=g, dtype=torch.float64) * 2 - 1) * 1.7).to(dtype)
        x = u * 2.0 ** _TOP_EXP[dtype]
        assert torch.isfinite(x).all() and torch.equal(x.double() / 2.0 ** _TOP_EXP[dtype], u.double())
        ctx = Context(key="w", step=step)
        pu, px = unit.encode(u, ctx), big.encode(x, ctx)
        assert torch.isfinite(big.decode(px)).all()
        want, got = set(pu.tensors[1].tolist()), set(px.tensors[1].tolist())
        assert len(want ^ got) <= 2, (step, len(want), len(got))
        assert torch.equal(px.tensors[0], x[px.tensors[1].long()])
