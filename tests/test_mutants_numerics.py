"""Contracts of the range-safe numerics and the density correction's search
(``compress/numerics.py``, ``compress/_density.py``) that the codec-level
tests do not pin. Written for survivors of ``make mutants`` (``numerics``
group); every expected value is the test's own (float64, by the definition or
the docstring's invariant), never the code's output.

* ``refine`` (the in-call threshold search): it reports the counts it spent,
  which are exactly the calls of ``count_at`` and never more than ``passes``;
  a zero count with ``max |x|`` zero or not finite stops at once ("nothing a
  threshold can fix"), without a count and without an error; when no count
  reaches the band, the threshold kept is the one whose count was closest to
  k in ratio (a zero count never preferred to a nonzero one).
* ``pack_scale`` on fp64: a scale at or beyond fp64's largest finite value
  (``saturate``: +-inf too) sends the largest finite upper word, so it
  decodes to (2 - 2^-20) 2^1023, the largest fp64 value with 20 fraction
  bits, and never to inf nor to a smaller value.
* ``saturate_``: clamps to +-max of the target dtype only where that dtype
  cannot hold the tensor's range; a target as wide or wider leaves the tensor
  (inf included) untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from gradpress.compress._density import BAND, MAX_PASSES, refine
from gradpress.compress.numerics import pack_scale, saturate_, unpack_scale

pytestmark = pytest.mark.mutants


class Counter:
    """``count_at`` of a selection ``|x| >= t`` on ``x``, recording its calls."""

    def __init__(self, x: torch.Tensor) -> None:
        self.a = x.abs()
        self.calls: list[float] = []

    def __call__(self, t: torch.Tensor) -> int:
        self.calls.append(float(t))
        return int((self.a >= t).sum())


def _heavy(d: int = 4096) -> torch.Tensor:
    """A heavy-tailed sample (the cube of a Gaussian)."""
    g = torch.Generator().manual_seed(3)
    return torch.randn(d, generator=g, dtype=torch.float64) ** 3


@pytest.mark.parametrize("passes", [1, 2, 5, MAX_PASSES])
@pytest.mark.parametrize("start", [1e-6, 1e3])
def test_refine_spends_exactly_the_counts_it_makes(passes: int, start: float) -> None:
    """From a threshold far from the band (all or none of x kept), the search
    spends counts until one is in the band or ``passes`` are spent: the
    returned ``spent`` is the number of ``count_at`` calls, at most
    ``passes``, and the returned count is the count at the returned
    threshold (recounted here)."""
    x = _heavy()
    k = 40
    count_at = Counter(x)
    thr = torch.tensor(start, dtype=torch.float64)
    count = int((x.abs() >= thr).sum())
    found, got, spent, _ = refine(count_at, thr, count, k, lambda: x.abs().amax(), passes=passes)
    assert spent == len(count_at.calls)
    assert spent <= passes
    assert got == int((x.abs() >= found).sum())
    if spent < passes:  # it stopped early: only because a count was in the band
        assert BAND[0] * k <= got <= BAND[1] * k


def test_refine_spends_every_pass_when_no_count_can_reach_the_band() -> None:
    """Every entry equal: a count keeps all 1000 or none, never the band
    around k = 10, so the search spends exactly ``passes`` counts, no more."""
    x = torch.ones(1000, dtype=torch.float64)
    count_at = Counter(x)
    for passes in (1, 3, MAX_PASSES):
        count_at.calls.clear()
        thr = torch.tensor(0.5, dtype=torch.float64)
        _, got, spent, _ = refine(count_at, thr, 1000, 10, lambda: x.abs().amax(), passes=passes)
        assert spent == len(count_at.calls) == passes
        assert got in (0, 1000)


@pytest.mark.parametrize("top", [0.0, math.inf, math.nan])
def test_refine_stops_on_a_zero_count_when_max_is_zero_or_not_finite(top: float) -> None:
    """A positive threshold that keeps nothing, on data whose max |x| is 0
    (an all-zero tensor) or not finite: nothing a threshold can fix, so the
    threshold and its zero count come back with no count spent (no error)."""
    calls: list[float] = []

    def count_at(t: torch.Tensor) -> int:
        calls.append(float(t))
        return 0

    thr = torch.tensor(0.25, dtype=torch.float64)
    found, got, spent, slope = refine(count_at, thr, 0, 8, lambda: torch.tensor(top, dtype=torch.float64))
    assert (float(found), got, spent, slope) == (0.25, 0, 0, None)
    assert calls == []


def _scripted(counts: list[int]) -> tuple[Callable[[torch.Tensor], int], list[float]]:
    """``count_at`` returning ``counts`` in turn (whatever the threshold), recording the thresholds."""
    seen: list[float] = []

    def count_at(t: torch.Tensor) -> int:
        seen.append(float(t))
        return counts[len(seen) - 1]
    return count_at, seen


@pytest.mark.parametrize("counts, best", [
    ([300, 50, 10, 0, 500], 1),  # 50 (ratio 1/2) is closest to 100; the last nonzero (500) is not
    ([2000, 400, 30, 0, 60], 4),  # the last one is the closest
    ([0, 5000, 0, 0, 3000], None),  # the start (1000) is closer than every later nonzero count
    ([0, 0, 0, 0, 0], None),  # a zero count never replaces the nonzero start
])
def test_refine_keeps_the_count_closest_to_k_when_none_is_in_the_band(counts: list[int], best: int | None) -> None:
    """Docstring: "The threshold kept is the last one in the band, else the
    one whose count was closest to k in ratio; a zero count is never
    preferred to a nonzero one." The counts are scripted (none in the band
    [80, 125] of k = 100), the start keeps 1000 at threshold 0.5; the
    expected choice is computed here by |ln(count / k)|."""
    k = 100
    count_at, seen = _scripted(counts)
    thr = torch.tensor(0.5, dtype=torch.float64)
    found, got, spent, _ = refine(count_at, thr, 1000, k, lambda: torch.tensor(64.0, dtype=torch.float64),
                                  passes=len(counts))
    assert spent == len(seen) == len(counts)
    tried = [(0.5, 1000)] + list(zip(seen, counts))
    want = min((c for _, c in tried if c > 0), key=lambda c: abs(math.log(c / k)))
    assert got == want == (1000 if best is None else counts[best])
    assert float(found) == dict((c, t) for t, c in tried)[want]


#: the largest fp64 value whose lower 32 bits are zero: 1 + 20 fraction bits at exponent 1023
TOP20 = math.ldexp(2.0 - 2.0 ** -20, 1023)


@pytest.mark.parametrize("away", [False, True])
@pytest.mark.parametrize("value", [torch.finfo(torch.float64).max, math.ldexp(2.0 - 2.0 ** -21, 1023),
                                   math.nextafter(TOP20, math.inf)])
def test_pack_scale_fp64_near_max_clamps_to_the_largest_finite_word(value: float, away: bool) -> None:
    """A finite fp64 scale whose upper word rounds beyond the largest finite
    one decodes to TOP20 (never inf, never less: that would lose 2^-20 more
    of the scale than the 20 bits must), with its sign."""
    t = torch.tensor([value, -value], dtype=torch.float64)
    got = unpack_scale(pack_scale(t, torch.float64, away=away), torch.float64)
    assert got.tolist() == [TOP20, -TOP20]


def test_pack_scale_fp64_saturate_sends_inf_as_the_largest_finite_word() -> None:
    """``saturate``: +-inf (the overflowed norm of a finite bucket) clamps to
    +-TOP20; NaN stays NaN; without ``saturate`` inf stays inf."""
    t = torch.tensor([math.inf, -math.inf, math.nan], dtype=torch.float64)
    got = unpack_scale(pack_scale(t, torch.float64, away=True, saturate=True), torch.float64)
    assert got[:2].tolist() == [TOP20, -TOP20]
    assert math.isnan(float(got[2]))
    plain = unpack_scale(pack_scale(t[:2], torch.float64, away=True), torch.float64)
    assert plain.tolist() == [math.inf, -math.inf]


SAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("source", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("target", SAT_DTYPES)
def test_saturate_clamps_only_into_a_narrower_range(source: torch.dtype, target: torch.dtype) -> None:
    """``saturate_(t, dtype)``: where ``dtype``'s largest finite value is
    below ``t.dtype``'s, +-inf and values beyond it become +-that value (NaN
    stays NaN); otherwise ``t`` is left as it is (inf stays inf, no error).
    Sources: the compute dtypes the codecs call it with (fp32, fp64), whose
    grids hold every narrower maximum exactly, and fp16 (never narrowed)."""
    top = torch.finfo(source).max
    values = [math.inf, -math.inf, math.nan, top, -top, 1.5, -0.0]
    t = torch.tensor(values, dtype=source)
    big = torch.finfo(target).max
    want = [min(max(v, -big), big) if big < top and not math.isnan(v) else v for v in values]
    assert saturate_(t, target) is t  # in place
    got = t.double().tolist()
    assert [math.isnan(g) for g in got] == [math.isnan(w) for w in want]
    assert [g for g in got if not math.isnan(g)] == [w for w in want if not math.isnan(w)]


@pytest.mark.parametrize("source,target", [(torch.bfloat16, torch.float16)])
def test_saturate_limit_rounds_toward_zero_in_a_coarser_grid(source: torch.dtype, target: torch.dtype) -> None:
    """A source grid that cannot hold the target's maximum (bf16 has no
    65504: it rounds to 65536) clamps at the largest source value not above
    it, so the cast that follows stays finite (reference: the largest
    bf16 value <= 65504, found by stepping bf16's grid in float64)."""
    big = torch.finfo(target).max
    grid = torch.tensor(big, dtype=torch.float64).to(source)
    while float(grid) > big:
        grid = torch.nextafter(grid, torch.zeros_like(grid))
    t = torch.tensor([math.inf, -math.inf, 1e10, -1e10, 1.5], dtype=source)
    saturate_(t, target)
    assert t.double().tolist() == [float(grid), -float(grid), float(grid), -float(grid), 1.5]
    assert torch.isfinite(t.to(target)).all()
