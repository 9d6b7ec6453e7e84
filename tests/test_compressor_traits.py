"""The soundness traits compressed gossip relies on (``is_contractive``,
``variance_factor``), checked against their definitions by Monte Carlo in
float64 (Koloskova et al. 2019, Assumption 1 and Sec. 3):

* contractive: ||Q(v) - v||^2 < ||v||^2 for every draw (delta > 0);
* unbiased with omega: the mean of ||Q(v) - v||^2 / ||v||^2 over many draws
  stays below omega (up to Monte Carlo slack).

A compressor whose declared trait is false fails here, whatever its
implementation (hand-written or generated).
"""

from __future__ import annotations

import pytest
import torch

from gradpress.compress import Context, create, registry


def _registered(trait) -> list[str]:
    """Every registered name whose default instance has ``trait``, so a
    method added later is held too (these lists were written out, and a new
    unbiased method with a ``variance_factor`` was left out)."""
    return [n for n in registry.names() if trait(create(n))]


def _with(specs: list[str], names: list[str]) -> list[str]:
    return specs + [n for n in names if n not in specs]


SPECS_CONTRACTIVE = _with(["topk:ratio=0.05", "randomk:ratio=0.05", "efsignsgd", "onebit", "fp16", "bf16", "rangefloat",
                           "fft", "threshold", "sidco", "dgc_threshold", "gaussiank", "redsync"],
                          _registered(lambda c: c.is_contractive and not c.identity))
SPECS_UNBIASED = _with(["qsgd", "qsgd:levels=4,bucket=64", "natural", "dithering", "dithering:natural=true,levels=3",
                        "randomk:ratio=0.1,scale=true"],
                       _registered(lambda c: c.is_unbiased and bool(c.variance_factor(2048))))


def _vectors(n: int = 2048) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    heavy = torch.randn(n, generator=g, dtype=torch.float64) ** 3
    return [torch.randn(n, generator=g), heavy.float(), torch.linspace(-1, 1, n) + 1e-3]


def _roundtrip(spec: str, v: torch.Tensor, step: int) -> torch.Tensor:
    comp = create(spec)
    ctx = Context(key="t", step=step, rank=0, world_size=1, seed=step)
    return comp.decode(comp.encode(v.clone(), ctx)).to(torch.float64)


@pytest.mark.parametrize("spec", SPECS_CONTRACTIVE)
def test_declared_contractive_compressors_contract(spec: str) -> None:
    comp = create(spec)
    assert comp.is_contractive, spec
    for v in _vectors():
        v64 = v.to(torch.float64)
        for step in range(3):
            err = (_roundtrip(spec, v, step) - v64).pow(2).sum()
            assert err < v64.pow(2).sum(), (spec, float(err / v64.pow(2).sum()))


@pytest.mark.parametrize("spec", SPECS_UNBIASED)
def test_variance_factor_bounds_the_measured_variance(spec: str) -> None:
    comp = create(spec)
    assert comp.is_unbiased
    v = _vectors(1024)[0]
    v64 = v.to(torch.float64)
    omega = comp.variance_factor(v.numel())
    assert omega is not None and omega > 0
    draws = torch.stack([(_roundtrip(spec, v, s) - v64).pow(2).sum() / v64.pow(2).sum() for s in range(200)])
    assert float(draws.mean()) <= omega * 1.1 + 1e-9, (spec, float(draws.mean()), omega)


def test_every_registered_compressor_declares_its_soundness_consistently() -> None:
    """A compressor is never both refused by its traits and listed as sound:
    unbiased ones either give a finite positive omega or None."""
    for name in registry.names():
        comp = create(name)
        omega = comp.variance_factor(4096)
        if omega is not None:
            assert comp.is_unbiased, name
            assert 0.0 < omega < float("inf"), (name, omega)


def test_unscaled_randomk_is_contractive_and_scaled_is_not() -> None:
    assert create("randomk").is_contractive and create("randomk").variance_factor(100) is None
    scaled = create("randomk:ratio=0.1,scale=true")
    assert not scaled.is_contractive
    assert scaled.variance_factor(100) == pytest.approx(100 / 10 - 1)
