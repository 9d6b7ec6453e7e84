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
                                                                         dtype: torch.dtype) -> None:
    """Every estimate is scale equivariant (each docstring: the fitted laws,
    the Gaussian, the sample's order statistic, RedSync's mean and max), and
    so is the density correction's state. Data near the dtype's max is the
    same data times 2^E (exact), so the selections must be those of the data
    at unit scale, call after call, within a boundary entry. Sums over
    |x| overflowed there: sidco and redsync selected every entry. With the
    density correction, gaussiank's estimate itself exceeded the dtype's max
    (inf: nothing learned, a search from max |x| on every call, ending near
    7x the target density), and a search step above the max stopped sidco's
    search where the same data at unit scale went on (fp32, first call: 596
    entries against 231); both were strict xfails until the rescue (x 2^-16) and the
    count-free zero above the max."""
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


def test_a_search_step_above_the_dtype_max_counts_as_an_empty_selection() -> None:
    """``refine`` from 0.9 x fp32's max on magnitudes spread evenly over
    [0.5, 1] x max, target k = 100 of 1000: the count there is ~200, and the
    first Newton step (slope guess 4) lands at ~1.07 x max, beyond fp32. That
    step keeps nothing (every |x| is below it), so the search brackets and
    ends within the band; it used to stop there and return the count of 200.
    No count is ever asked at a non-finite threshold."""
    from gradpress.compress._density import BAND, refine

    top = torch.finfo(torch.float32).max
    a = (torch.linspace(0.5, 1.0, 1000, dtype=torch.float64) * top).float()
    asked: list[float] = []

    def count_at(t: torch.Tensor) -> int:
        asked.append(float(t))
        return int((a >= t).sum())

    k = 100
    thr = torch.tensor(0.9 * top, dtype=torch.float32)
    found, count, spent, _ = refine(count_at, thr, count_at(thr), k, lambda: a.max())
    assert BAND[0] * k <= count <= BAND[1] * k, (count, spent)
    assert count == int((a >= found).sum()) and torch.isfinite(found)
    assert all(t < float("inf") for t in asked)
    assert spent == len(asked) - 1  # the counts made after the first (the caller's); the step beyond the max is none
