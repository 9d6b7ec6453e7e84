"""fp16/bf16 saturate once: a summand bounded by ``bound_summand`` is not checked or clamped again by ``encode``.

The strategies encode ``compressor.encode(compressor.bound_summand(x, n))``. On an accelerator
``_Cast._may_overflow`` answers True without reading (no host sync), so both steps clamped: two full
passes, the second a no-op (the summand bound is below the format's maximum). On CPU both steps read
``aminmax``. The accelerator's branch is taken here by replacing ``_may_overflow`` with what it does off the
CPU; every output is compared with a float64 saturation computed from the definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradpress.compress import create
from gradpress.compress.halfprec import _Cast

TARGETS = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _summand_bound(target: torch.dtype, n: int, dtype: torch.dtype) -> float:
    """The largest ``dtype`` value not above (M - (n + 1) h) / n (floored at M / 2 / n), M the format's
    maximum and h half the spacing of its top binade; n = 1: M itself (the plain saturating cast)."""
    man, emax = {torch.float16: (10, 15), torch.bfloat16: (7, 127)}[target]
    top = (2 - 2.0 ** -man) * 2.0 ** emax
    if n == 1:
        return top
    h = 2.0 ** emax * 2.0 ** -man / 2
    limit = max(top - (n + 1) * h, top / 2) / n
    if dtype == torch.float64:
        return limit
    b = np.float32(limit)
    return float(np.nextafter(b, np.float32(0)) if float(b) > limit else b)


def _reference(x: torch.Tensor, target: torch.dtype, n: int) -> torch.Tensor:
    b = _summand_bound(target, n, x.dtype)
    vals = [v if math.isnan(v) else min(max(v, -b), b) for v in x.to(torch.float64).tolist()]
    return torch.tensor(vals, dtype=torch.float64).to(target).to(x.dtype)


def _input(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, generator=gen, dtype=dtype) * 3e4
    x[:6] = torch.tensor([1e6, -1e6, float("inf"), float("-inf"), float("nan"), 65504.0], dtype=dtype)
    if dtype != torch.float16:
        x[6:8] = torch.tensor([3e38, -3e38], dtype=dtype)
    return x


@pytest.fixture
def count(monkeypatch):
    """Counts calls of ``torch.Tensor.clamp`` and ``torch.aminmax`` (the full passes of the saturation)."""
    calls = {"clamp": 0, "aminmax": 0}
    clamp, aminmax = torch.Tensor.clamp, torch.aminmax

    def counted_clamp(self, *args, **kwargs):
        calls["clamp"] += 1
        return clamp(self, *args, **kwargs)

    def counted_aminmax(*args, **kwargs):
        calls["aminmax"] += 1
        return aminmax(*args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clamp", counted_clamp)
    monkeypatch.setattr(torch, "aminmax", counted_aminmax)
    return calls


def _accelerator(monkeypatch) -> None:
    """``_may_overflow``'s branch off the CPU: no read, the clamp always runs."""
    monkeypatch.setattr(_Cast, "_may_overflow", staticmethod(lambda flat, limit: flat.numel() > 0))


@pytest.mark.parametrize("name", sorted(TARGETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [2, 4])
def test_a_bounded_summand_is_clamped_once_on_accelerators(name, dtype, n, monkeypatch, count):
    _accelerator(monkeypatch)
    comp, x = create(name), _input(dtype)
    packet = comp.encode(comp.bound_summand(x, n))
    assert count["clamp"] == 1, count  # was 2: bound_summand's clamp, then encode's to the format's maximum
    torch.testing.assert_close(comp.decode(packet), _reference(x, TARGETS[name], n), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", sorted(TARGETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_bounded_summand_is_read_once_on_cpu(name, dtype, count):
    comp = create(name)
    for x in (_input(dtype), torch.randn(64, dtype=dtype)):  # beyond the bound (clamped), within it (as is)
        count.update(clamp=0, aminmax=0)
        packet = comp.encode(comp.bound_summand(x, 4))
        assert count["aminmax"] == 1, count  # was 2: encode read the bounded summand again
        torch.testing.assert_close(comp.decode(packet), _reference(x, TARGETS[name], 4), rtol=0, atol=0,
                                   equal_nan=True)


@pytest.mark.parametrize("name", sorted(TARGETS))
@pytest.mark.parametrize("accelerator", [False, True])
def test_encode_alone_and_a_summand_changed_after_bounding_still_saturate(name, accelerator, monkeypatch):
    if accelerator:
        _accelerator(monkeypatch)
    comp, target = create(name), TARGETS[name]
    x = _input(torch.float32)
    torch.testing.assert_close(comp.decode(comp.encode(x)), _reference(x, target, 1), rtol=0, atol=0, equal_nan=True)
    for bounded in (comp.bound_summand(x.clone(), 4), comp.bound_summand(torch.ones(64), 4)):
        bounded.mul_(1e30)  # changed in place between bound_summand and encode: not the bounded summand any more
        torch.testing.assert_close(comp.decode(comp.encode(bounded)), _reference(bounded, target, 1), rtol=0,
                                   atol=0, equal_nan=True)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_a_compressor_that_bounded_a_summand_pickles_and_copies(name):
    import copy
    import pickle

    comp = create(name)
    x = comp.bound_summand(_input(torch.float32), 4)
    for clone in (pickle.loads(pickle.dumps(comp)), copy.deepcopy(comp)):
        assert clone.spec() == comp.spec()
        torch.testing.assert_close(clone.decode(clone.encode(x)), _reference(x, TARGETS[name], 4), rtol=0, atol=0,
                                   equal_nan=True)
