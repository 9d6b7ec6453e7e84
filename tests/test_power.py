"""Unbiasedness with statistical power: E[decode(encode(x))] = x checked so
that a 2% bias on any coordinate fails.

Each test takes the per-coordinate variance from the method's own definition
(QSGD: a Bernoulli rounding between two levels one step ``norm / s`` apart,
variance ``step^2 f (1 - f)``; natural compression: ``(2^(e+1) - |x|)(|x| -
2^e)``; TernGrad without clipping: ``|x| (max - |x|)``; dithering with the
infinity norm: ``norm^2 (hi - y)(y - lo)``; scaled random-k: ``x^2 (d / k -
1)``), not from the draws. The tolerance is ``Z = 5`` standard errors of the
mean over ``n`` samples per coordinate (a false alarm has probability below
6e-7 per coordinate), plus fp32 rounding; ``n`` is chosen, and checked by the
test itself, so that ``(Z + Z_POWER) * sigma / sqrt(n) <= 2% * |x|`` on
every coordinate: a 2% bias on any coordinate lands outside the tolerance
with probability at least 0.9987 (``Z_POWER = 3``).

Samples per coordinate come cheaply from large tensors made of many copies
of one short vector (one QSGD bucket, one base vector): every copy is an
independent draw of the same coordinate (random-k's copies are drawn without
replacement, negatively correlated, so the independent variance bounds the
mean's). Large-tensor shapes have ``ratio * d`` not an integer. Tiny tensors
(where ``ceil(ratio * d)`` differs most from ``ratio * d``) are checked
exactly where the method is deterministic given its randomness (random-k's
kept values are ``x * d / k``) and statistically with the detectable bias
stated in the test.
"""

from __future__ import annotations

import math

import pytest
import torch

from gradpress.compress import Context
from gradpress.compressors import create

pytestmark = pytest.mark.mutants

Z = 5.0
Z_POWER = 3.0
BIAS = 0.02
F64 = torch.float64


def _ctx(i: int) -> Context:
    return Context(key="power", step=i, rank=i % 3, world_size=3, seed=11)


def _mean_of_copies(spec: str, base: torch.Tensor, copies: int, draws: int, dtype: torch.dtype = torch.float32,
                    stream: str | None = None) -> torch.Tensor:
    comp = create(spec)
    if stream is not None:
        comp.random_stream = stream
    x = base.float().to(dtype).repeat(copies)
    acc = torch.zeros(base.numel(), dtype=F64)
    for i in range(draws):
        acc += comp.decode(comp.encode(x, _ctx(i))).double().view(copies, -1).sum(0)
    return acc / (draws * copies)


def powered(spec: str, base: torch.Tensor, sigma: torch.Tensor, copies: int, dtype: torch.dtype = torch.float32,
            stream: str | None = None) -> None:
    """Draw until every coordinate has the samples a 2% bias needs, then
    check the mean against the tolerance; ``sigma``: per-coordinate standard
    deviation of one sample, from the method's definition; ``dtype``: the
    tensors' dtype, ``stream``: the compressor's ``random_stream`` (None: its
    default)."""
    x = base.float().double()
    nonzero = x.abs() > 0
    need = ((Z + Z_POWER) * sigma[nonzero] / (BIAS * x.abs()[nonzero])).pow(2).max().item()
    draws = max(1, math.ceil(need / copies))
    n = draws * copies
    se = sigma / math.sqrt(n)
    assert bool(((Z + Z_POWER) * se[nonzero] <= BIAS * x.abs()[nonzero]).all())  # the test has its power
    mean = _mean_of_copies(spec, base, copies, draws, dtype, stream)
    tol = Z * se + 1e-6 * x.abs() + 1e-30
    bad = (mean - x).abs() > tol
    assert not bad.any(), (spec, x[bad], mean[bad], tol[bad], f"relative bias {((mean - x) / x)[bad]}")


def test_qsgd_every_coordinate_within_two_percent() -> None:
    """QSGD (s = 4, buckets of 8): 8192 copies of one bucket per draw;
    detectable bias 2% of |x| on every coordinate (e.g. rounding up with
    probability f + 0.1 f (1 - f) instead of f is 4-6% on these
    coordinates)."""
    s, b = 4, 8
    base = torch.tensor([3.0, -2.5, 2.0, -1.7, 1.5, -1.2, 1.1, -0.9])
    v = base.double()
    step = v.norm() / s
    y = s * v.abs() / v.norm()
    f = y - y.floor()
    powered(f"qsgd:levels={s},bucket={b}", base, step * (f * (1 - f)).sqrt(), copies=8192)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("stream", ["counter", "torch"])
def test_natural_every_coordinate_within_two_percent(dtype: torch.dtype, stream: str) -> None:
    """Natural compression: stochastic rounding to the neighbouring powers of
    two; detectable bias 2% on every coordinate, for both random streams and
    for the fp32 and the fp64 rounding (fp64 carries 52 random bits into the
    exponent, fp32 23: a wrong mask biases or breaks one of the four)."""
    base = torch.tensor([3.0, -2.5, 1.3, -0.7, 0.45, -5.5, 0.11, 1.9, 7.0])
    a = base.double().abs()
    lo = torch.exp2(torch.floor(torch.log2(a)))
    powered("natural", base, ((2 * lo - a) * (a - lo)).clamp_min(0).sqrt(), copies=4096, dtype=dtype,
            stream=stream)


def test_terngrad_every_coordinate_within_two_percent() -> None:
    """TernGrad without clipping: max * sign * Bernoulli(|x| / max);
    coordinates between 0.5 and 1 of the maximum (|x| = max is exact);
    detectable bias 2% on every coordinate."""
    base = torch.tensor([1.0, -0.9, 0.75, -0.6, 0.55, -0.8, 0.66])
    a = base.double().abs()
    powered("terngrad:clip=0", base, (a * (a.max() - a)).sqrt(), copies=8192)


@pytest.mark.parametrize("bucket", [0, 8])
@pytest.mark.parametrize("natural", [False, True])
def test_dithering_every_coordinate_within_two_percent(natural: bool, bucket: int) -> None:
    """Random dithering with the infinity norm (y = |x| / max), 4 levels,
    standard or natural, one norm for the whole tensor or one per bucket of 8
    (every bucket is one copy of the base vector, so its norm and the
    variances are the same); detectable bias 2% on every coordinate."""
    s = 4
    base = torch.tensor([1.0, -0.9, 0.7, -0.6, 0.45, -0.8, 0.35, 0.55])
    a = base.double().abs()
    norm = a.max()
    y = a / norm
    if natural:
        levels = torch.tensor([0.0] + [2.0 ** (k - s) for k in range(1, s + 1)], dtype=F64)
    else:
        levels = torch.arange(s + 1, dtype=F64) / s
    lo = torch.stack([levels[levels <= v].max() for v in y])
    hi = torch.stack([levels[levels >= v].min() for v in y])
    spec = f"dithering:levels={s},p=inf,natural={'true' if natural else 'false'},bucket={bucket}"
    powered(spec, base, norm * ((hi - y) * (y - lo)).clamp_min(0).sqrt(), copies=4096)


def test_randomk_large_tensor_every_coordinate_within_two_percent() -> None:
    """Scaled random-k on d = 7 * 4097 = 28679 entries, ratio 0.3 (ratio * d =
    8603.7, not an integer): each copy's coordinate is x * d / k with
    probability k / d; detectable bias 2% on every coordinate (a selection
    that favours some positions, or a wrong scale, fails)."""
    base = torch.tensor([1.0, -2.0, 0.5, 3.0, -0.25, 1.5, -1.25])
    copies = 4097
    d = base.numel() * copies
    k = math.ceil(0.3 * d)
    assert 0.3 * d != int(0.3 * d)
    powered("randomk:ratio=0.3,scale=true", base, base.double().abs() * math.sqrt(d / k - 1), copies=copies)


@pytest.mark.parametrize("shape, ratio", [((7,), 0.3), ((3, 5), 0.1), ((1,), 0.5), ((2, 3), 0.45), ((11,), 0.19)])
def test_randomk_tiny_kept_values_are_scaled_by_d_over_k(shape: tuple[int, ...], ratio: float) -> None:
    """Tiny tensors with ratio * d not an integer (k = ceil(ratio * d)): every
    kept value is x * d / k to fp32 rounding (scaling by 1 / ratio instead is 43% off
    for d = 7, ratio = 0.3), k entries are kept, the others are zero."""
    d = math.prod(shape)
    k = min(d, max(1, math.ceil(ratio * d)))
    x = (torch.arange(1, d + 1, dtype=torch.float32) * 0.37 - 1.1).reshape(shape)
    comp = create(f"randomk:ratio={ratio},scale=true")
    for i in range(50):
        out = comp.decode(comp.encode(x, _ctx(i)))
        kept = out != 0
        assert int(kept.sum()) == k, (shape, ratio, int(kept.sum()), k)
        expected = x.double() * d / k
        # exact up to the fp32 product's rounding (2 ulps)
        assert torch.allclose(out[kept].double(), expected[kept], rtol=2.0**-22, atol=0), (shape, ratio, out[kept])


def test_randomk_tiny_tensor_is_unbiased_statistically() -> None:
    """d = 7, ratio 0.3 (k = 3), 12000 draws: per coordinate sigma = |x|
    sqrt(d / k - 1) = 1.15 |x|; detectable bias (Z + Z_POWER) * 1.15 /
    sqrt(12000) = 8.4% on every coordinate (this is where a ceil-blind
    scale would be 43% off, and where a selection skewed toward some
    positions shows)."""
    base = torch.tensor([1.0, -2.0, 0.5, 3.0, -0.25, 1.5, -1.25])
    d, k, draws = 7, 3, 12000
    comp = create("randomk:ratio=0.3,scale=true")
    acc = torch.zeros(d, dtype=F64)
    for i in range(draws):
        acc += comp.decode(comp.encode(base, _ctx(i))).double()
    x = base.double()
    se = x.abs() * math.sqrt(d / k - 1) / math.sqrt(draws)
    assert bool(((Z + Z_POWER) * se <= 0.085 * x.abs()).all())  # the stated detectable bias holds
    assert bool(((acc / draws - x).abs() <= Z * se + 1e-6 * x.abs()).all()), (acc / draws, x)


def test_qsgd_tiny_single_bucket_is_unbiased() -> None:
    """QSGD on a 5-entry tensor (one bucket, s = 2), 6000 draws: detectable
    bias (Z + Z_POWER) * sigma / sqrt(6000) per coordinate, which the test
    computes and requires to be at most 10% of |x|."""
    s = 2
    base = torch.tensor([1.0, -0.8, 0.7, -0.9, 0.6])
    v = base.double()
    y = s * v.abs() / v.norm()
    f = y - y.floor()
    sigma = v.norm() / s * (f * (1 - f)).sqrt()
    draws = 6000
    se = sigma / math.sqrt(draws)
    assert bool(((Z + Z_POWER) * se <= 0.10 * v.abs()).all())
    mean = _mean_of_copies(f"qsgd:levels={s},bucket=0", base, 1, draws)
    assert bool(((mean - v).abs() <= Z * se + 1e-6 * v.abs()).all()), (mean, v)


def _omega_reference(d: int, s: int, p: float, natural: bool) -> float | None:
    """The stated variance bounds, omega with E||C(x) - x||^2 <= omega ||x||^2,
    written out from the papers: natural dithering (Horvath et al. 2019,
    "Natural compression for distributed deep learning", the bound for
    natural dithering with a p-norm):
    ``1/8 + d^(1/r) 2^(1-s) min(1, d^(1/r) 2^(1-s))`` with ``r = min(p, 2)``;
    standard dithering with p = 2 (Alistarh et al. 2017, QSGD, Lemma 3.1):
    ``min(d / s^2, sqrt(d) / s)``; no bound stated otherwise (None)."""
    if natural:
        r = min(p, 2.0)
        t = math.pow(d, 1.0 / r) * math.pow(2.0, 1 - s)
        return 1.0 / 8.0 + t * min(1.0, t)
    if p != 2.0:
        return None
    return min(d / (s * s), math.sqrt(d) / s)


@pytest.mark.parametrize("d, levels, p, natural, bucket", [
    (16, 8, 2.0, True, 0),      # t = 4 * 2^-7 < 1: omega = 1/8 + t^2
    (4096, 3, 2.0, True, 0),    # t = 16: omega = 1/8 + t
    (100, 5, 1.0, True, 0),     # r = 1
    (300, 7, math.inf, True, 64),  # r = 2, one bucket of 64 sets d
    (64, 4, 2.0, False, 0),     # d / s^2 = 4 > sqrt(d) / s = 2
    (10, 8, 2.0, False, 0),     # d / s^2 < sqrt(d) / s
    (50, 4, 3.0, False, 0),     # no bound for standard dithering with p != 2
])
def test_dithering_variance_factor_is_the_stated_bound(d: int, levels: int, p: float, natural: bool, bucket: int) -> None:
    """``variance_factor`` (the omega the planner and the literature checks
    use) equals the paper's bound computed here for the tensor's bucket, on
    both sides of ``t = 1`` where ``min(1, t)`` switches."""
    spec = f"dithering:levels={levels},p={'inf' if math.isinf(p) else p},natural={str(natural).lower()},bucket={bucket}"
    got = create(spec).variance_factor(d)
    want = _omega_reference(bucket if 0 < bucket < d else d, levels, p, natural)
    if want is None:
        assert got is None
    else:
        assert got == pytest.approx(want, rel=1e-12, abs=0.0), (spec, got, want)


def _on_levels(d: int, b: int, levels: list[float]) -> torch.Tensor:
    """``d`` entries in buckets of ``b``; bucket j has norm ``m_j = 2^(j % 5 - 2)``
    (its first entry), every entry is ``+-m_j * level`` with ``level`` one of
    the quantizer's levels: the draws cannot move them (exact in fp32)."""
    idx = torch.arange(d)
    m = torch.exp2((idx // b % 5 - 2).to(torch.float64))
    level = torch.tensor(levels, dtype=torch.float64)[idx % len(levels)]
    level[idx % b == 0] = 1.0
    sign = 1.0 - 2.0 * (idx % 3 == 1).to(torch.float64)
    return (m * level * sign).float()


@pytest.mark.parametrize("natural", [False, True])
def test_dithering_entries_on_levels_are_exact_across_buckets_and_spans(natural: bool) -> None:
    """Dithering with the infinity norm, 4 levels, buckets of 24 on 65636
    entries: the CPU span (2^16 entries, ``compress/spans.py``) ends inside a
    bucket and the last bucket is short, so every piece of the per-bucket
    scaling (head of a bucket, whole buckets, tail) is used; an entry whose
    ``|x| / norm`` is a level is deterministic and must come back exactly
    (levels k/4, or 2^(k-4) natural), with each bucket's own norm."""
    s, b, d = 4, 24, (1 << 16) + 100
    assert (1 << 16) % b and d % b  # a bucket straddles the span boundary; a short last bucket
    levels = [0.0] + [2.0 ** (k - s) for k in range(1, s + 1)] if natural else [k / s for k in range(s + 1)]
    x = _on_levels(d, b, levels)
    comp = create(f"dithering:levels={s},p=inf,natural={'true' if natural else 'false'},bucket={b}")
    for i in range(3):
        out = comp.decode(comp.encode(x, _ctx(i)))
        bad = out != x
        assert not bad.any(), (bad.nonzero()[:5].reshape(-1).tolist(), out[bad][:5], x[bad][:5])


@pytest.mark.parametrize("levels", [13, 130, 1300])
def test_qsgd_entries_on_levels_are_exact_narrow_and_wide_codes(levels: int) -> None:
    """QSGD, one bucket, x = (3, -4, 0, 12, 0, 0, -0, 0) (norm 13) and
    (1.5, -2, 0, 6) (norm 6.5): the norm is exact and ``|x| s / norm`` an
    integer level for s a multiple of 13,
    so every draw gives x back up to the float rounding of ``level * norm / s``
    (relative 1e-6). s = 130 and 1300 need more than 8 code bits: the wide
    codes' decoding (sign applied in floating point) is used."""
    x = torch.tensor([3.0, -4.0, 0.0, 12.0, 0.0, 0.0, -0.0, 0.0, 1.5, -2.0, 0.0, 6.0])
    comp = create(f"qsgd:levels={levels},bucket=0")
    for half in (x[:8], x[8:]):
        want = half.double()
        assert float(want.norm()) in (13.0, 6.5)
        for i in range(4):
            out = comp.decode(comp.encode(half, _ctx(i))).double()
            assert torch.allclose(out, want, rtol=1e-6, atol=0.0), (levels, out, want)


#: (spec, accepted): the edges of every parameter range the unbiased quantizers state
#: (QSGD: 1 <= levels <= 2^23 - 1, bucket >= 0; dithering: 1 <= levels <= 65535, 120 when natural,
#: p >= 1 or inf, bucket >= 0; TernGrad: clip >= 0; random-k: 0 < ratio <= 1)
RANGE_EDGES = [
    ("qsgd:levels=1", True), ("qsgd:levels=0", False), (f"qsgd:levels={(1 << 23) - 1}", True),
    (f"qsgd:levels={1 << 23}", False), ("qsgd:bucket=0", True), ("qsgd:bucket=-1", False),
    ("dithering:levels=1", True), ("dithering:levels=0", False), ("dithering:levels=65535", True),
    ("dithering:levels=65536", False), ("dithering:levels=120,natural=true", True),
    ("dithering:levels=121,natural=true", False), ("dithering:p=1", True), ("dithering:p=1.5", True),
    ("dithering:p=inf", True), ("dithering:p=0.99", False), ("dithering:p=0", False),
    ("dithering:bucket=0", True), ("dithering:bucket=-1", False),
    ("terngrad:clip=0", True), ("terngrad:clip=2.5", True), ("terngrad:clip=-0.1", False),
    ("randomk:ratio=1", True), ("randomk:ratio=0.001", True), ("randomk:ratio=0", False), ("randomk:ratio=1.01", False),
]


@pytest.mark.parametrize("spec, accepted", RANGE_EDGES, ids=[s for s, _ in RANGE_EDGES])
def test_quantizer_parameter_ranges_are_the_stated_ones(spec: str, accepted: bool) -> None:
    """Each stated range's edges: the edge itself is accepted, one step
    outside is refused with a ``ValueError`` naming the parameter (a range
    check with the wrong comparison lets a biased or undefined setting
    through, e.g. a norm order p < 1, which is not a norm)."""
    if accepted:
        create(spec)
        return
    name = spec.split(":")[1].split("=")[0]
    with pytest.raises(ValueError, match=f"parameter '{name}'"):
        create(spec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_natural_outputs_are_powers_of_two_bit_exactly(dtype: torch.dtype) -> None:
    """Natural compression (Horvath et al. 2019) rounds to a neighbouring
    power of two: a power of two (either sign, exponents -30..30) comes back
    bit for bit, and every output of arbitrary inputs is 0 or +-2^e exactly
    (``frexp`` mantissa 0.5), with the input's sign. A stray bit in the
    decoded word (the sign table, the exponent shift) is a relative error
    of 2^-23, which no statistical test sees."""
    e = torch.arange(-30, 31, dtype=torch.float64)
    pow2 = torch.cat([torch.exp2(e), -torch.exp2(e)]).to(dtype)
    comp = create("natural")
    for i in range(3):
        out = comp.decode(comp.encode(pow2, _ctx(i)))
        assert torch.equal(out, pow2), (out - pow2).abs().max()
    x = torch.randn(4096, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(dtype)
    for i in range(3):
        out = comp.decode(comp.encode(x, _ctx(i)))
        mant, _ = torch.frexp(out[out != 0])
        assert bool((mant.abs() == 0.5).all()), out[out != 0][mant.abs() != 0.5][:5]
        assert torch.equal(torch.signbit(out), torch.signbit(x))
