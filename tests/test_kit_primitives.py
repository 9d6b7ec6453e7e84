"""The authoring kit's primitives (gradpress/compress/kit/primitives.py)
called directly, against their definitions computed here in float64 or
with plain indexing: ``reduce`` per chunk (the short last chunk included),
``elementwise`` with per-chunk statistics, ``select_topk`` and
``select_mask``, ``scatter`` and ``gather``. The registered compressors use
only some of them (``select_mask`` none), and docs/authoring.md offers all
of them to method authors."""

from __future__ import annotations

import math

import pytest
import torch
from references import topk_indices

from gradpress.compress import kit
from gradpress.compress.kit import compiler

pytestmark = pytest.mark.mutants

SIZES = [0, 1, 7, 64, 100, 1000]


def _x(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3


def _rows(x: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    return [x[i: i + chunk] for i in range(0, x.numel(), chunk)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk", [1, 16, 100, 4096])
def test_reduce_per_chunk_with_the_short_last_one(n: int, chunk: int) -> None:
    x = _x(n)
    rows = _rows(x.double(), chunk)
    norms = kit.reduce(x, "norm", chunk)
    assert norms.shape == (len(rows),) and norms.dtype == x.dtype
    for got, r in zip(norms.tolist(), rows):
        assert got == pytest.approx(math.sqrt(sum(v * v for v in r.tolist())), rel=1e-6)
    assert kit.reduce(x, "absmax", chunk).tolist() == [float(r.abs().max()) for r in rows]
    assert kit.reduce(x, "sum", chunk).tolist() == pytest.approx([math.fsum(r.tolist()) for r in rows], rel=1e-5,
                                                                 abs=1e-4)
    lo, hi = kit.reduce(x, "minmax", chunk)
    assert lo.tolist() == [float(r.min()) for r in rows] and hi.tolist() == [float(r.max()) for r in rows]
    with pytest.raises(ValueError, match="kit.reduce: op got 'mean'; allowed: norm, absmax, minmax, sum"):
        kit.reduce(x, "mean", chunk)


def _sum_reference(row: torch.Tensor, dtype: torch.dtype) -> float:
    """The exact sum of ``row`` (rational arithmetic), rounded to float64 and then to ``dtype`` (inf beyond
    its range)."""
    from fractions import Fraction

    exact = sum((Fraction(v) for v in row.double().tolist()), Fraction(0))
    try:
        rounded = float(exact)
    except OverflowError:  # beyond float64 (fp64 entries only)
        return math.inf if exact > 0 else -math.inf
    return float(torch.tensor(rounded, dtype=torch.float64).to(dtype))


@pytest.mark.parametrize("compile_mode", ["off", "on"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_reduce_sum_is_range_safe(dtype: torch.dtype, compile_mode: str) -> None:
    """kit.reduce(x, "sum") summed in the input's dtype: two bf16 or fp32 entries near the largest finite value
    gave inf (NaN once a negative one followed) where the true sum is finite; fp16 (accumulated in fp32 by torch)
    did not. Now a finite row gives its sum rounded to the dtype where that is finite, inf with its sign only
    where the true sum exceeds the dtype, in the input's dtype; error at most the rounding to the dtype plus
    the fp64 accumulation's n 2^-52 sum|x|."""
    big = torch.finfo(dtype).max
    gen = torch.Generator().manual_seed(5)
    rows = [
        [big, big, -big, -big / 2, 1.0, 0.0, 0.0],  # partial sums beyond the dtype, the sum within it
        [big / 2] * 3 + [-big / 2] * 3 + [torch.finfo(dtype).tiny],  # cancels to the smallest normal
        [big] * 4 + [-big] * 2 + [0.0],  # true sum 2 max: beyond the dtype, +inf
        [-big] * 3 + [big / 4] * 4,  # -2 max: -inf
        (torch.randn(7, generator=gen, dtype=torch.float64) * (big / 8)).tolist(),
        [big / 2, big / 2, big / 8, -big / 8, 3.0, -3.0, 0.5],  # just below the largest finite value
    ]
    x = torch.tensor(rows, dtype=torch.float64).to(dtype).reshape(-1)  # the entries as the dtype holds them
    with compiler.forced(compile_mode):  # compiled: fp16, bf16 and fp32's fp64 row sums (CPU)
        got = kit.reduce(x, "sum", 7)
        nan_row = kit.reduce(torch.tensor([big, -big, float("nan")], dtype=dtype), "sum", 3)
        inf_row = kit.reduce(torch.tensor([big, float("inf")], dtype=dtype), "sum", 2)
    assert got.dtype == dtype and got.shape == (len(rows),)
    eps = 2.0 ** -52
    for i, (value, row) in enumerate(zip(got.tolist(), _rows(x, 7))):
        want = _sum_reference(row, dtype)
        assert math.isinf(value) == math.isinf(want), (dtype, i, value, want)
        if math.isinf(want):
            assert value == want, (dtype, i, value, want)
            continue
        ulp = float(torch.finfo(dtype).eps) * max(abs(want), float(torch.finfo(dtype).tiny))
        bound = ulp + 7 * eps * float(row.double().abs().sum())  # inf for fp64 rows whose |x| sum overflows
        assert abs(value - want) <= bound, (dtype, i, value, want, bound)
    assert math.isnan(nan_row[0])
    assert inf_row.tolist() == [math.inf]


_VIEWS = {"aten::slice", "aten::as_strided", "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::alias",
          "aten::detach", "aten::expand", "aten::select", "aten::unsqueeze", "aten::squeeze"}


def _ops_reading(fn, numel: int) -> list[str]:
    """The aten operators, views aside, that the profiler saw take a tensor of at least ``numel`` entries."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("aten::") and e.name not in _VIEWS
            and any(isinstance(s, list) and s and math.prod(s) >= numel for s in e.input_shapes)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_reduce_sum_reads_finite_rows_once(dtype: torch.dtype) -> None:
    """kit.reduce(x, "sum") on finite CPU rows is one read of them. fp64 checked isfinite(rows).all() on every
    call before looking at the sums (aten::isfinite, abs, ne, eq, mul, all over the rows: 136 ms against a
    3.3 ms sum at 8M entries, one thread); fp32, fp16 and bf16 summed with dtype=float64, which ATen does by
    copying the rows to fp64 first (aten::to, _to_copy, copy_: 106 ms against 3 ms). Now fp64 checks the sums
    and reads the rows again only for a sum that is not finite; the others run compiled (auto, on CPU, from
    MIN_COMPILE_NUMEL entries), the cast inside the reduction. The values are the fp64 definition's."""
    chunk = 1024
    whole = compiler.MIN_COMPILE_NUMEL // chunk * chunk
    x = torch.randn(whole + 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)
    with compiler.forced("auto"):
        kit.reduce(x, "sum", chunk)  # a compilation reads more; this one is before the count
        assert _ops_reading(lambda: kit.reduce(x, "sum", chunk), whole) in ([], ["aten::sum"])
        got = kit.reduce(x, "sum", chunk)
    want = [float(torch.tensor(math.fsum(r.double().tolist()), dtype=torch.float64).to(dtype)) for r in _rows(x, chunk)]
    assert got.dtype == dtype
    if dtype == torch.float64:  # summed in fp64 itself: within n 2^-52 sum|x| of the exact sum
        assert all(abs(g - w) <= chunk * 2.0 ** -52 * float(r.abs().sum()) for g, w, r in zip(got.tolist(), want, _rows(x, chunk)))
    else:  # fp64 holds these sums exactly: the exact sum rounded once
        assert got.tolist() == want
    if dtype == torch.float64:  # an overflowing row is summed again, the others are kept
        big = torch.finfo(dtype).max
        y = x.clone()
        y[chunk: chunk + 4] = torch.tensor([big, big, -big, -big / 2], dtype=dtype)
        sums = kit.reduce(y, "sum", chunk)
        rest = y[chunk + 4: 2 * chunk]
        assert abs(sums[1].item() - (big / 2 + math.fsum(rest.tolist()))) <= 2 * chunk * 2.0 ** -52 * big
        assert torch.equal(sums[[0, *range(2, len(sums))]], got[[0, *range(2, len(got))]])


def _scaled(v: torch.Tensor, a: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None,
            shift: float) -> torch.Tensor:
    return v * a + shift


@pytest.mark.parametrize("n", SIZES)
def test_elementwise_broadcasts_one_statistic_per_chunk(n: int) -> None:
    """Each chunk's entries see that chunk's statistic; the ragged tail its own."""
    x, chunk = _x(n), 16
    stats = torch.arange(1, -(-n // chunk) + 1, dtype=torch.float32)
    got = kit.elementwise(_scaled, x, chunk, (stats,), shift=0.5)
    want = torch.cat([r * s + 0.5 for r, s in zip(_rows(x, chunk), stats)]) if n else torch.zeros(0)
    assert got.shape == (n,) and torch.equal(got, want)


@pytest.mark.parametrize("n", [1, 7, 100, 1000])
def test_select_topk_is_the_k_largest_magnitudes_in_index_order(n: int) -> None:
    x = _x(n, 1)
    x[n // 2] = -x.abs().max() * 2  # the largest magnitude is negative
    for k in sorted({1, max(1, n // 10), n}):
        values, idx = kit.select_topk(x, k)
        want = topk_indices(x, k)  # ascending; ties to the lower index
        assert idx.dtype == torch.int32 and torch.equal(idx.long(), want)
        assert torch.equal(values, x[want])


def test_select_topk_ranks_nan_first_and_breaks_ties_by_index() -> None:
    x = torch.tensor([1.0, -3.0, 3.0, float("nan"), 3.0, 0.5])
    _, idx = kit.select_topk(x, 3)
    assert idx.tolist() == [1, 2, 3]  # NaN, then the first two of the three |3|s


@pytest.mark.parametrize("n", SIZES)
def test_select_mask_keeps_the_masked_entries_in_index_order(n: int) -> None:
    x = _x(n, 2)
    for mask in (x.abs() >= 2.0, torch.zeros(n, dtype=torch.bool), torch.ones(n, dtype=torch.bool)):
        values, idx = kit.select_mask(x, mask)
        want = [i for i in range(n) if bool(mask[i])]
        assert idx.dtype == torch.int32 and idx.tolist() == want
        assert torch.equal(values, x[want])
    values, idx = kit.select_mask(x.view(-1, 1) if n else x, (x.abs() >= 2.0).view(-1, 1) if n else x > 0)
    assert idx.tolist() == [i for i in range(n) if abs(float(x[i])) >= 2.0]  # any shape, flat indices


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_scatter_puts_values_at_their_indices_and_zeros_elsewhere(dtype: torch.dtype) -> None:
    values, idx = torch.tensor([1.5, -2.0, 4.0]), torch.tensor([7, 0, 3], dtype=torch.int32)
    out = kit.scatter(values, idx, 9, dtype)
    want = [0.0] * 9
    for v, i in zip(values.tolist(), idx.tolist()):
        want[i] = v
    assert out.dtype == dtype and out.tolist() == want
    assert kit.scatter(values[:0], idx[:0], 4, dtype).tolist() == [0.0] * 4


def test_gather_reads_codes_through_the_table() -> None:
    table = torch.tensor([-1.0, 0.0, 2.5, 7.0])
    codes = torch.tensor([3, 0, 2, 2, 1], dtype=torch.uint8)
    assert kit.gather(table, codes).tolist() == [7.0, -1.0, 2.5, 2.5, 0.0]


@pytest.mark.parametrize("chunk", [7, 100, 1024])
def test_minmax_is_aminmax_bit_for_bit_with_signed_zeros_and_nan(chunk: int) -> None:
    """``reduce(..., "minmax")`` takes amin and amax (faster on CPU) and falls
    back to aminmax on rows whose extreme is a zero or NaN, where the two may
    pick another zero or NaN: the result is aminmax's, bits included."""
    g = torch.Generator().manual_seed(chunk)
    rows = 40
    x = -torch.rand(rows * chunk + 3, generator=g)  # all negative: a zero is the max where one exists
    zeros = torch.rand(x.numel(), generator=g) < 0.3
    signs = torch.rand(x.numel(), generator=g) < 0.5
    x[zeros] = torch.where(signs[zeros], torch.tensor(-0.0), torch.tensor(0.0))
    x[: 5 * chunk] = x[: 5 * chunk].abs()  # the first rows: a zero is the min
    x[7 * chunk: 8 * chunk] = 0.0
    x[7 * chunk: 8 * chunk: 3] = -0.0  # an all-zero row of both signs
    x[9 * chunk + 1] = float("nan")
    x[11 * chunk + 2] = float("inf")
    lo, hi = kit.reduce(x, "minmax", chunk)
    want = [torch.aminmax(r, dim=1) for r in kit.chunks(x, chunk)]
    for got, ref in ((lo, torch.cat([w[0] for w in want])), (hi, torch.cat([w[1] for w in want]))):
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("bits", [3, 6, 12])
def test_pack_rows_of_a_wide_width_gives_each_rows_stream(bits: int) -> None:
    """``pack_rows(codes, bits, fuse=True)`` for widths whose group spans
    several bytes (no kernel of the registered methods fuses them, an
    author's may): ``(rows, c * bits / 8)``, row r the LSB-first stream of
    row r's codes, built here from Python integers."""
    rows, c = 3, 16
    codes = torch.randint(0, 1 << bits, (rows, c), generator=torch.Generator().manual_seed(bits), dtype=torch.int32)
    got = kit.pack_rows(codes, bits, True)
    assert got.shape == (rows, c * bits // 8) and got.dtype == torch.uint8
    for r in range(rows):
        stream = sum(int(v) << (i * bits) for i, v in enumerate(codes[r].tolist()))
        assert got[r].tolist() == list(stream.to_bytes(c * bits // 8, "little")), r


def _half_plus(v: torch.Tensor, s: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None) -> torch.Tensor:
    return v * 0.5 + s  # the input's dtype


# n, chunk: one view of whole chunks (10, 5), whole chunks and a short last one (10, 4), the short one alone (3, 4),
# nothing (0, 4)
OUT_CASES = [(10, 5), (10, 4), (3, 4), (0, 4)]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("n, chunk", OUT_CASES)
def test_elementwise_out_of_another_dtype_size_or_device_is_refused(n: int, chunk: int, compiled: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``out`` must have the result's dtype (float32 here), size and device:
    eager it was cast into silently (a float64 buffer got float32 values
    widened, a float16 one rounded). ``compiled``: the compiled paths, with
    a ``torch.compile`` that hands the function back (their logic, no
    Inductor)."""
    from gradpress.compress.kit import compiler

    monkeypatch.setattr(compiler, "_cache", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    x = _x(n, seed=n)
    stat = torch.arange(1, -(-n // chunk) + 1, dtype=torch.float32)
    mode = "on" if compiled else "off"
    for bad in (torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float16)):
        with compiler.forced(mode), pytest.raises(ValueError, match=rf"out is .*{bad.dtype}.*result is .*float32"):
            kit.elementwise(_half_plus, x, chunk, (stat,), out=bad)
    strided = [torch.empty(n, 2)[:, 0]] if n > 1 else []  # an empty or one-entry view is contiguous
    for bad in (torch.empty(n + 1), torch.empty(n, device="meta"), torch.empty(1, n), *strided):
        with compiler.forced(mode), pytest.raises(ValueError, match=r"kit.elementwise: out is"):
            kit.elementwise(_half_plus, x, chunk, (stat,), out=bad)
    want = [v * 0.5 + float(stat[i // chunk]) for i, v in enumerate(x.double().tolist())]
    good = torch.full((n,), float("nan"))
    with compiler.forced(mode):
        got = kit.elementwise(_half_plus, x, chunk, (stat,), out=good)
    assert got is good and got.tolist() == pytest.approx(want, rel=1e-6)
