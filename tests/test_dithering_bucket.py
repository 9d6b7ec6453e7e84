"""Per-bucket random dithering (``dithering:bucket=b``): one norm per bucket
of b entries, as QSGD's bucketing (Alistarh et al. 2017, section 3.1), so the
relative error E||C(x) - x||^2 / ||x||^2 stays at omega(b) (Horvath et al.
2019 for natural levels, Alistarh et al. 2017 for standard ones) instead of
growing like sqrt(d)/s with the tensor's size.

Every reference is computed here in float64 from x itself: the bucket norms,
and the exact expected squared error of the two-level rounding,
sum_i n_b^2 (hi_i - y_i)(y_i - lo_i) with y_i = |x_i| / n_b and lo_i <= y_i <= hi_i
the adjacent levels.
"""

from __future__ import annotations

import math

import pytest
import torch

from gradpress.compress import create
from gradpress.compress.base import Context
from gradpress.compress.dithering import variance_bound

B = 1000  # not a power of two: buckets straddle the encoder's 2^16-entry spans


def _gauss(d: int, seed: int) -> torch.Tensor:
    return torch.randn(d, generator=torch.Generator().manual_seed(seed))


def _norms64(x: torch.Tensor, b: int, p: float = 2.0) -> torch.Tensor:
    v = x.double().reshape(-1)
    rows = torch.nn.functional.pad(v, (0, -v.numel() % b)).reshape(-1, b)  # zeros change no p-norm
    return torch.linalg.vector_norm(rows, p, dim=1)


def _expected_sq_error(x: torch.Tensor, b: int, s: int, natural: bool) -> float:
    """E||C(x) - x||^2 in float64 for per-bucket dithering with L2 norms."""
    v = x.double().reshape(-1)
    n = _norms64(x, b).repeat_interleave(b)[: v.numel()]
    y = v.abs() / n
    if natural:
        lo = torch.where(y >= 2.0 ** (1 - s), torch.exp2(torch.floor(torch.log2(y))), torch.zeros_like(y))
        hi = torch.where(y >= 2.0 ** (1 - s), 2 * lo, torch.full_like(y, 2.0 ** (1 - s)))
        hi = torch.where(y >= 1, torch.ones_like(y), hi)
    else:
        lo = torch.floor(y * s) / s
        hi = lo + 1.0 / s
    return float((n**2 * (hi - y) * (y - lo)).sum())


def _measured_ratio(spec: str, x: torch.Tensor, draws: int) -> float:
    comp = create(spec)
    x64 = x.double()
    sq = float((x64**2).sum())
    total = 0.0
    for i in range(draws):
        out = comp.decode(comp.encode(x, Context(key="t", step=i, seed=3)))
        total += float(((out.double() - x64) ** 2).sum())
    return total / draws / sq


@pytest.mark.parametrize("natural", [False, True])
def test_relative_error_bounded_and_flat_in_size(natural: bool) -> None:
    """At d = 2^10 .. 2^21 the measured relative error matches the float64
    expectation within 8%, stays under omega(b), and does not grow with d;
    one norm for the whole tensor is far worse at the largest size."""
    s = 8 if not natural else 3
    flag = "true" if natural else "false"
    spec = f"dithering:levels={s},natural={flag},bucket={B}"
    omega = variance_bound(B, s, 2.0, natural)
    ratios = []
    for d in (1 << 10, 1 << 14, 1 << 18, 1 << 21):
        x = _gauss(d, d)
        draws = max(1, (1 << 18) // d)  # >= 2^18 entries behind every estimate
        got = _measured_ratio(spec, x, draws)
        want = _expected_sq_error(x, B, s, natural) / float((x.double() ** 2).sum())
        assert got == pytest.approx(want, rel=0.08), (d, got, want)
        assert got <= omega, (d, got, omega)
        ratios.append(got)
    assert max(ratios) <= 1.15 * min(ratios), ratios
    x = _gauss(1 << 21, 1 << 21)
    whole = _measured_ratio(f"dithering:levels={s},natural={flag}", x, 1)
    assert whole > 10 * ratios[-1], (whole, ratios[-1])


def test_norms_per_bucket_match_float64() -> None:
    d = 70_001  # a short last bucket and a span boundary inside a bucket
    x = _gauss(d, 1) * 1e3
    for p, spec in ((2.0, f"dithering:bucket={B}"), (math.inf, f"dithering:bucket={B},p=inf")):
        packet = create(spec).encode(x, Context(key="n"))
        want = _norms64(x, B, p)
        assert packet.tensors[0].shape == (math.ceil(d / B),)
        assert torch.allclose(packet.tensors[0].double(), want, rtol=1e-6, atol=0), spec
    # fp64 inputs keep fp64 norms
    packet = create(f"dithering:bucket={B}").encode(x.double(), Context(key="n"))
    assert packet.tensors[0].dtype == torch.float64
    assert torch.allclose(packet.tensors[0], _norms64(x.double(), B), rtol=1e-12, atol=0)


def test_infinity_norm_bucket_maxima_decode_exactly() -> None:
    """p = inf: each bucket's largest |x| has y = 1, level s, and decodes to
    its bucket's max exactly, with its sign; nothing exceeds its bucket max."""
    d, b = 10_007, 64
    x = _gauss(d, 2)
    comp = create(f"dithering:levels=4,p=inf,bucket={b}")
    out = comp.decode(comp.encode(x, Context(key="m"))).double()
    pad = (-d) % b
    xb = torch.cat([x.double(), torch.zeros(pad, dtype=torch.float64)]).view(-1, b)
    ob = torch.cat([out, torch.zeros(pad, dtype=torch.float64)]).view(-1, b)
    arg = xb.abs().argmax(1)
    rows = torch.arange(xb.shape[0])
    assert torch.equal(ob[rows, arg], xb[rows, arg])
    assert bool((ob.abs() <= xb.abs().amax(1, keepdim=True)).all())


@pytest.mark.parametrize("spec", ["dithering:levels=2,bucket=8", "dithering:levels=2,natural=true,bucket=8"])
def test_unbiased_per_bucket(spec: str) -> None:
    # buckets of very different scale: a shared norm would round the small ones to 0 or the norm
    x = _gauss(40, 4) * torch.tensor([1e-3, 1.0, 1e3, 1.0, 1e-2]).repeat_interleave(8)
    comp = create(spec)
    draws = torch.stack([comp.decode(comp.encode(x, Context(key="u", step=i, seed=9))).double() for i in range(4000)])
    se = draws.std(0) / math.sqrt(draws.shape[0])
    excess = (draws.mean(0) - x.double()).abs() - 5 * se - 1e-6 * x.double().abs()
    assert float(excess.max()) <= 0, float(excess.max())


def test_whole_tensor_bucket_is_the_published_method() -> None:
    """``bucket=0`` and any bucket >= d give the same packet: one norm."""
    x = _gauss(5000, 5)
    ctx = Context(key="w", step=2, seed=1)
    a = create("dithering:levels=6").encode(x, ctx)
    for b in (5000, 10**6):
        other = create(f"dithering:levels=6,bucket={b}").encode(x, ctx)
        assert all(torch.equal(u, v) for u, v in zip(a.tensors, other.tensors))
    assert a.tensors[0].numel() == 1


def test_wire_size_and_bad_bucket() -> None:
    d, b = 10_000, 512
    packet = create(f"dithering:levels=8,bucket={b}").encode(_gauss(d, 6))
    assert packet.nbytes == 4 * math.ceil(d / b) + math.ceil(d / 8) + math.ceil(d * 4 / 8)
    assert create(f"dithering:bucket={b}").variance_factor(d) == variance_bound(b, 8, 2.0, False)
    with pytest.raises(ValueError, match="bucket"):
        create("dithering:bucket=-1")


def test_fp16_decode_saturates_per_bucket() -> None:
    """A bucket whose decoded magnitudes exceed fp16 saturates at 65504;
    the other buckets decode as in fp32."""
    x = torch.cat([torch.full((8,), 6e4), torch.full((8,), 1.0)]).to(torch.float16)
    comp = create("dithering:levels=1,bucket=8")  # decoded: 0 or the bucket's L2 norm
    seen = torch.zeros(16, dtype=torch.bool)
    for i in range(40):
        out = comp.decode(comp.encode(x, Context(key="h", step=i)))
        assert out.dtype == torch.float16 and bool(torch.isfinite(out).all())
        big = torch.tensor(65504.0, dtype=torch.float16)  # sqrt(8) * 6e4 > fp16 max
        small = torch.tensor(math.sqrt(8.0), dtype=torch.float16)
        assert bool(((out[:8] == 0) | (out[:8] == big)).all()), out[:8]
        assert bool(((out[8:] == 0) | (out[8:] == small)).all()), out[8:]
        seen |= out != 0
    assert bool(seen.all())
