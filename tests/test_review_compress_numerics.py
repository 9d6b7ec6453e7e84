"""Review F: finite extreme inputs for the threshold sparsifiers, DGC's
local clipping and PowerSGD's warm start. Every reference is computed here
in float64 from the paper's formula or the input itself; a finite gradient
must never come back as NaN/Inf, an exception, or silently as zeros."""

from __future__ import annotations

import math

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


@pytest.mark.parametrize("first", ["zero", "one_column"])
def test_powersgd_warm_start_recovers_after_a_zero_gradient(first: str) -> None:
    """A zero gradient (an unused parameter under DDP) made the stored Q
    zero; with warm start, P = M Q then stayed zero on every later step and
    every gradient silently decoded to zeros. One power iteration on a
    matrix of rank <= r is exact (P P^T M = M), so the float64 M itself is
    the reference."""
    g = torch.Generator().manual_seed(1)
    m64 = torch.randn(24, 2, generator=g, dtype=torch.float64) @ torch.randn(2, 18, generator=g, dtype=torch.float64)
    comp = create("powersgd:rank=2,start_iter=0")
    zero = torch.zeros(24, 18)
    if first == "one_column":  # a rank-1 gradient whose Q keeps one exactly zero column
        zero[:, 0] = 1.0
    comp.decode(comp.encode(zero, Context(key="w", step=0)))
    if first == "one_column":
        comp.q["w"][:, 1] = 0.0
    for step in (1, 2):
        out = comp.decode(comp.encode(m64.float(), Context(key="w", step=step)))
        assert torch.allclose(out.double(), m64, rtol=0, atol=1e-4 * float(m64.abs().max())), step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_dgc_local_clipping_of_a_gradient_whose_norm_overflows(dtype: torch.dtype) -> None:
    """DGC clips ||g||_2 to clip * N^1/2 (Lin et al. 2018, sec. 3.2, on g / N as in Algorithm 1). With
    finite entries near the dtype's max the norm is inf, the coefficient
    clip / inf was 0 and the whole gradient was silently sent as zeros."""
    big = torch.finfo(dtype).max
    g64 = torch.linspace(-0.9, 0.9, 64, dtype=torch.float64) * big
    x = g64.to(dtype)
    clip, world = 2.0, 4
    comp = create(f"dgc:ratio=1,clip={clip},momentum=0")
    y = comp.decode(comp.encode(x, Context(key="w", step=0, world_size=world)))
    x64 = x.double()
    want = x64 * (clip * world**0.5 / torch.linalg.vector_norm(x64 / big) / big)  # the paper's clip, float64
    tol = 1e-5 if dtype != torch.bfloat16 else 1e-2
    assert torch.isfinite(y).all()
    assert torch.allclose(y.double(), want, rtol=tol, atol=tol * float(want.abs().max()))


@pytest.mark.parametrize("dtype, scale", [(torch.float32, 1e37), (torch.float32, 3e36), (torch.bfloat16, 1e37),
                                          (torch.float64, 1e306)])
def test_gaussiank_threshold_of_large_finite_gradients(dtype: torch.dtype, scale: float) -> None:
    """Gaussian-k's threshold |mu| + sigma Phi^-1(1 - delta/2) (Shi et al.
    2019): the one-pass mean and std overflowed on finite data of large
    magnitude, giving a NaN threshold (everything sent) or an infinite one
    (nothing sent). Reference: mu and sigma in float64 (of x / scale)."""
    from statistics import NormalDist

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(20000, generator=g, dtype=torch.float64) * scale).to(dtype)
    x64 = x.double()
    xs = x64 / scale  # float64 statistics on unit-scale data (fp64 data near its max would overflow)
    thr = (xs.mean().abs() + NormalDist().inv_cdf(1 - 0.01 / 2) * xs.std()) * scale
    want = torch.nonzero(x64.abs() >= thr).reshape(-1)
    comp = create("gaussiank:ratio=0.01,correction=none")
    packet = comp.encode(x, Context(key="w", step=0))
    assert comp.last_adjustments == 0  # the float64 threshold keeps 2k/3 <= count <= 4k/3
    got = packet.tensors[1].long()
    assert len(set(got.tolist()) ^ set(want.tolist())) <= 1  # at most one entry at the boundary rounds apart
    assert torch.equal(packet.tensors[0], x[got])


def _pow2_unit(x64: torch.Tensor) -> float:
    """2^-e with max|x| 2^-e in [0.5, 1): an exact rescaling of float64 data."""
    return 2.0 ** -torch.frexp(x64.abs().max())[1].item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_gaussiank_uncorrected_threshold_of_finite_data_near_the_dtype_max(dtype: torch.dtype) -> None:
    """``gaussiank:correction=none`` (Shi et al. 2019): thr = |mu| + sigma
    Phi^-1(1 - delta/2), then up to 3 steps (x0.5 below 2k/3, x1.5 above
    4k/3). Uniform data on +-0.9 max: sigma Phi^-1 exceeds the dtype (inf),
    so nothing was selected, and inf x0.5 stayed inf: every step sent
    nothing. Reference: the same definition in float64 on the data scaled by
    a power of two (exact), counts by |x| >= thr."""
    from statistics import NormalDist

    ratio, d = 0.01, 20000
    g = torch.Generator().manual_seed(3)
    x = ((torch.rand(d, generator=g, dtype=torch.float64) * 2 - 1) * (0.9 * torch.finfo(dtype).max)).to(dtype)
    c = _pow2_unit(x.double())
    xs = x.double() * c  # exact; |xs| < 1
    k = math.ceil(ratio * d)  # kept_count
    thr = xs.mean().abs().item() + NormalDist().inv_cdf(1 - ratio / 2) * xs.std().item()
    steps = 0
    for _ in range(3):
        n = int(((xs.abs() >= thr) & (xs != 0)).sum())
        if n < 2 * k / 3:
            thr *= 0.5
        elif n > 4 * k / 3:
            thr *= 1.5
        else:
            break
        steps += 1
    want = torch.nonzero((xs.abs() >= thr) & (xs != 0)).reshape(-1)
    assert want.numel() > 0  # the definition sends something here
    comp = create("gaussiank:ratio=0.01,correction=none")
    packet = comp.encode(x, Context(key="w", step=0))
    y = comp.decode(packet)
    assert torch.isfinite(y).all()
    assert comp.last_adjustments == steps
    got = packet.tensors[1].long()
    assert len(set(got.tolist()) ^ set(want.tolist())) <= 1  # at most one entry at the boundary rounds apart
    assert torch.equal(packet.tensors[0], x[got])

