"""Statistical quality of the kit's counter-based generator
(gradpress/compress/kit/rng.py): uniformity of bytes and of the top bits,
independence of neighbouring elements and of streams from different seeds,
and the invariants the compressors rely on (same bits on every rank for the
same seed, in eager and in a chunked call). References are computed here
from the chi-square formula; thresholds are the 1e-6 upper quantiles
(so a correct generator fails with probability about 1e-6 per check)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from gradpress.compress import kit
from gradpress.compress.base import Context
from gradpress.compress.kit import compiler
from gradpress.compress.kit.rng import LANES, counter_bits, counter_uniform, element_index, offset_key, seed_words

N = 1 << 20


def _chi2_limit(df: int) -> float:
    """Upper 1e-6 quantile of chi-square(df), Wilson-Hilferty approximation."""
    z = 4.753  # P(Z > z) = 1e-6
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: torch.Tensor) -> float:
    expected = counts.sum().double() / counts.numel()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def _bits(seed: int, n: int = N) -> torch.Tensor:
    return counter_bits(seed_words(seed), torch.arange(n, dtype=torch.int32))


def test_every_byte_of_the_32_bits_is_uniform() -> None:
    h = _bits(12345)
    for shift in (0, 8, 16, 24):
        counts = torch.bincount(((h >> shift) & 0xFF).long(), minlength=256)
        assert _chi2(counts) < _chi2_limit(255), shift


def test_uniform_floats_fill_1024_equal_bins_and_stay_in_0_1() -> None:
    for dtype in (torch.float32, torch.float64):
        u = counter_uniform(seed_words(7), torch.arange(N, dtype=torch.int32), dtype)
        assert float(u.min()) >= 0 and float(u.max()) < 1
        counts = torch.bincount((u * 1024).long(), minlength=1024)
        assert _chi2(counts) < _chi2_limit(1023)
        assert abs(float(u.double().mean()) - 0.5) < 5 * math.sqrt(1 / 12 / N)


def test_uniform_floats_are_the_bits_on_the_documented_grid() -> None:
    """fp64: the 32 bits read as an unsigned integer over 2^32; fp32: the
    top 24 bits over 2^24 (the module's formula, from Python integers)."""
    idx = torch.arange(4096, dtype=torch.int32)
    unsigned = [b & 0xFFFFFFFF for b in counter_bits(seed_words(31), idx).tolist()]
    u64 = counter_uniform(seed_words(31), idx, torch.float64).tolist()
    u32 = counter_uniform(seed_words(31), idx, torch.float32).tolist()
    assert u64 == [b / 2**32 for b in unsigned]
    assert u32 == [(b >> 8) / 2**24 for b in unsigned]


def test_neighbouring_elements_are_independent() -> None:
    """Serial test: pairs (top 4 bits of element i, of element i + lag) fill
    the 256 cells uniformly; lag 1 and lags crossing a 16-bit boundary."""
    h = _bits(99)
    top = ((h >> 28) & 0xF).long()
    for lag in (1, 2, 3, 1 << 16):
        pairs = top[:-lag] * 16 + top[lag:]
        assert _chi2(torch.bincount(pairs, minlength=256)) < _chi2_limit(255), lag
    # and the serial correlation of the uniforms is within 5 standard errors of 0
    u = counter_uniform(seed_words(99), torch.arange(N, dtype=torch.int32), torch.float64)
    c = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]
    assert abs(float(c)) < 5 / math.sqrt(N)


def test_streams_of_consecutive_steps_and_ranks_are_independent() -> None:
    """The private seeds of consecutive steps (and of two ranks) give
    uncorrelated uniforms and pairs that fill the 256 cells uniformly."""
    idx = torch.arange(N, dtype=torch.int32)
    seeds = [Context(key="w", step=s, rank=r, seed=3).private_seed for s, r in ((1, 0), (2, 0), (1, 1))]
    us = [counter_uniform(seed_words(s), idx, torch.float64) for s in seeds]
    for a, b in ((0, 1), (0, 2)):
        c = torch.corrcoef(torch.stack([us[a], us[b]]))[0, 1]
        assert abs(float(c)) < 5 / math.sqrt(N)
        pairs = (us[a] * 16).long() * 16 + (us[b] * 16).long()
        assert _chi2(torch.bincount(pairs, minlength=256)) < _chi2_limit(255)


def test_bernoulli_rare_events_have_the_right_rate() -> None:
    """Stochastic rounding depends on the tails: P(U < p) for small p,
    against the binomial's 5 standard deviations."""
    u = counter_uniform(seed_words(2024), torch.arange(N, dtype=torch.int32), torch.float32).double()
    for p in (1e-4, 1e-3, 0.5, 1 - 1e-3):
        hits = float((u < p).sum())
        assert abs(hits - N * p) < 5 * math.sqrt(N * p * (1 - p)) + 1, p


def test_shared_randomness_is_identical_for_the_same_seed_and_chunking_does_not_change_it() -> None:
    """Every rank derives the same key from the shared seed, so the draws
    are the same; a kernel run chunk by chunk sees the same element indices."""
    seed = Context(key="k", step=5, rank=0, seed=1).shared_seed
    assert seed == Context(key="k", step=5, rank=3, seed=1).shared_seed
    flat = torch.randn(1000)

    def draw(v: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None) -> torch.Tensor:
        return kit.uniform(v, key, drawn)

    whole = kit.elementwise(draw, flat, 1000, key=seed_words(seed))
    chunked = kit.elementwise(draw, flat, 64, key=seed_words(seed))  # 15 whole chunks + a short one
    assert torch.equal(whole, chunked)
    assert torch.equal(whole, counter_uniform(seed_words(seed), torch.arange(1000, dtype=torch.int32), torch.float32))


def test_every_bit_of_the_63_bit_seed_matters() -> None:
    """Seeds that differ in one bit, low word or high word, give streams
    that agree on about half of their bits (not identical, not shifted)."""
    base = 0x5DEECE66D1234567
    ref = _bits(base, 1 << 14)
    for bit in (0, 17, 31, 32, 45, 62):
        other = _bits(base ^ (1 << bit), 1 << 14)
        same = float(((ref ^ other) >= 0).double().mean())  # sign bits agree
        assert 0.45 < same < 0.55, bit


def _iota(n: int, offset: int) -> torch.Tensor:
    return torch.arange(offset, offset + n, dtype=torch.int32)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_element_index_counts_every_element_whatever_way_it_is_built(mode: str) -> None:
    """The index a kernel hashes is the element's position plus the part's
    offset, checked against an iota computed here: through the lane table
    (last dimension a multiple of 16, rows of several widths), through the
    iota (other widths, a key without lanes), eager and compiled (one
    compile serves the symbolic widths); and the lane table stays
    0..15 when a part's key is offset."""
    key = seed_words(77)
    assert key[3:].tolist() == list(range(LANES))
    part = offset_key(key, 1000)
    assert part[:2].tolist() == key[:2].tolist() and int(part[2]) == 1000 and part[3:].tolist() == list(range(LANES))
    assert offset_key(key, 5, lanes=False).tolist() == [*key[:2].tolist(), 5]
    index = compiler.cpu_only(lambda v, k: element_index(v, k))
    with compiler.forced(mode), warnings.catch_warnings():
        warnings.filterwarnings("error", message="gradpress kit")  # a failed compile warns, falls back
        for shape in [(1, 4096), (7, 64), (3, 4096), (2, 48), (5, 10), (1, 4099), (40,), (3, 0), (), (4, 32, 16)]:
            v = torch.zeros(shape)
            n = v.numel()
            for k in (part, offset_key(key, 1000, lanes=False)):
                got = compiler.run(index, n, v, k) if n >= 64 else element_index(v, k)
                assert torch.equal(got.reshape(-1), _iota(n, 1000)), (shape, k.numel())


@pytest.mark.parametrize("mode", ["off", "on"])
def test_the_lane_index_is_the_draws_of_a_plain_iota(mode: str) -> None:
    """A kernel drawing through the lane table (rows of 4096) draws exactly
    the counter bits of the element positions (a permuted or shifted lane
    table, or a row base off by a block, changes them), eager and compiled
    (5 whole rows: above the compile threshold)."""
    flat = torch.randn(5 * 4096 + 5)
    key = seed_words(2024)

    def draw(v: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None) -> torch.Tensor:
        return kit.random_bits(v, key, drawn, 31)

    with compiler.forced(mode), warnings.catch_warnings():
        warnings.filterwarnings("error", message="gradpress kit")
        got = kit.elementwise(draw, flat, 4096, key=key)
    assert torch.equal(got, (counter_bits(key, _iota(flat.numel(), 0)) >> 1) & 0x7FFFFFFF)


def test_kernels_that_pack_their_rows_get_keys_without_lanes() -> None:
    """``elementwise`` hands a row-packing kernel (fused 2-bit pack) a key
    without its lane table, whose loads would cross its packing groups, and
    every other kernel, the short last row of the packing one included, the
    whole key."""
    seen: list[tuple[int, bool]] = []

    def codes(v: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None, bits: int,
              fuse: bool) -> torch.Tensor:
        seen.append((key.numel(), fuse))
        return kit.pack_rows((kit.random_bits(v, key, drawn, 2)), bits, fuse)

    flat = torch.randn(2 * 64 + 8)
    with compiler.forced("off"):
        kit.elementwise(codes, flat, 64, key=seed_words(5), pack=2, fuse_pack=True)  # fused: off CPU by default
        assert sorted(set(seen)) == [(3, True), (3 + LANES, False)]
        seen.clear()
        kit.elementwise(codes, flat, 64, key=seed_words(5), pack=2, fuse_pack=False)
        assert set(seen) == {(3 + LANES, False)}
