"""Statistical checks: E[decode(encode(x))] = x for every compressor that says
it is unbiased, and the variance bounds of QSGD and natural compression.

The mean of many draws (ctx.step varies, so the randomness changes) must lie
within 5 standard errors of x, using the empirical per-element variance;
entries whose draws never vary must be reproduced (up to fp32 rounding).
"""

from __future__ import annotations

import math

import pytest
import torch

from gradpress.compress import Compressor, Context
from gradpress.compressors import create, get_class, names

#: specs meaningful on a 64-element tensor (see tests/test_compressors.py)
SMALL_SPECS = {
    "randomk": "randomk:ratio=0.3",
    "qsgd": "qsgd:levels=4,bucket=8",
    "threshold": "threshold:tau=0.5",
    "topk": "topk:ratio=0.3",
}
#: unbiased variants that are not the defaults
EXTRA_SPECS = [
    "randomk:ratio=0.25,scale=true",
    "terngrad:clip=0",
    "qsgd:levels=1,bucket=0",
    "qsgd:levels=16,bucket=512",
]
DRAWS = 2000


def _unbiased_specs() -> list[str]:
    specs = []
    for name in names():
        if get_class(name).rounds != 1:
            continue
        spec = SMALL_SPECS.get(name, name)
        if create(spec).is_unbiased:
            specs.append(spec)
    return specs + EXTRA_SPECS


def _target(d: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(d, generator=gen)
    x[0] = 0.0
    x[1] = 2.0  # exact power of two
    x[2] = -0.375
    x[3] = 1e-39  # fp32 subnormal
    x[4] = 3.0e-3
    return x


def _draws(comp: Compressor, x: torch.Tensor, n: int = DRAWS) -> torch.Tensor:
    out = torch.empty(n, x.numel(), dtype=torch.float64)
    for i in range(n):
        ctx = Context(key="u", step=i, rank=i % 3, world_size=3, seed=11)
        out[i] = comp.decode(comp.encode(x, ctx)).double().reshape(-1)
    return out


def test_default_unbiased_methods_are_covered() -> None:
    specs = _unbiased_specs()
    for name in ("none", "natural", "qsgd"):
        assert any(s.split(":")[0] == name for s in specs)


@pytest.mark.parametrize("spec", _unbiased_specs())
def test_mean_of_draws_is_x(spec: str) -> None:
    comp = create(spec)
    assert comp.is_unbiased
    x = _target()
    draws = _draws(comp, x)
    mean = draws.mean(0)
    se = draws.std(0) / math.sqrt(draws.shape[0])
    tol = 5 * se + 1e-5 * x.double().abs() + 1e-30
    # an entry that never moved (a rare-event rounding: P(move) = 0.0004 for natural at -0.2501, so
    # P(no move in 2000 draws) = 0.45 whatever the generator) may be off by 14 H / N, the rule of
    # tests/test_extreme.py::bias (P(no move) >= 1e-6 needs P(move) <= 14 / N)
    tol = torch.where(draws.std(0) > 0, tol, tol + 14 * float(draws.abs().max()) / draws.shape[0])
    bad = (mean - x.double()).abs() > tol
    assert not bad.any(), (spec, x[bad], mean[bad], se[bad])
    # some randomness is actually there (a deterministic rounding would be biased)
    if spec.split(":")[0] != "none":
        assert (draws.std(0) > 0).any()


@pytest.mark.parametrize("spec", ["topk:ratio=0.3", "signsgd", "onebit", "terngrad"])
def test_biased_methods_are_detected(spec: str) -> None:
    """The statistical check has power: it rejects a biased method."""
    comp = create(spec)
    assert not comp.is_unbiased
    x = _target()
    draws = _draws(comp, x, 400)
    se = draws.std(0) / math.sqrt(draws.shape[0])
    assert ((draws.mean(0) - x.double()).abs() > 5 * se + 1e-5 * x.double().abs() + 1e-30).any()


@pytest.mark.parametrize("levels, bucket, d", [(1, 0, 64), (2, 0, 256), (16, 0, 64), (12, 0, 64), (4, 32, 200)])
@pytest.mark.parametrize("flat", [False, True], ids=["gaussian", "equal-magnitude"])
def test_qsgd_variance_bound(levels: int, bucket: int, d: int, flat: bool) -> None:
    gen = torch.Generator().manual_seed(levels * 1000 + d)
    x = torch.randn(d, generator=gen)
    if flat:
        x = torch.sign(x)
    comp = create("qsgd", levels=levels, bucket=bucket)
    draws = _draws(comp, x, 800)
    err = ((draws - x.double()) ** 2).sum(1).mean().item()
    b = bucket or d
    bound = min(b / levels**2, math.sqrt(b) / levels) * float(x.double().pow(2).sum())
    assert err <= bound, (err, bound)


def test_natural_variance_factor() -> None:
    x = _target(128)
    draws = _draws(create("natural"), x, 800)
    err = ((draws - x.double()) ** 2).sum(1).mean().item()
    assert 0 < err <= float(x.double().pow(2).sum()) / 8
