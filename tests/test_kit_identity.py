"""The kit declarations against the frozen hand-written compressors
(gradpress/compress/handwritten/): with ``random_stream = "torch"`` (the
same torch-generator draws) every payload byte and every decoded bit is
identical, on every dtype, on empty/short/ragged tensors and on extreme
values; deterministic methods (onebit, minmax8) are identical with
the default stream too. ``topk`` (ascending indices, ties to the lowest
index, unlike ``torch.topk``'s order) is checked against the rule computed
here in Python floats, and against the hand-written decode on tie-free input. With the default counter stream the random methods
are checked in distribution against the method's own formula (computed
here in float64). Also: the derived layout is the exact wire size."""

from __future__ import annotations

import math

import pytest
import torch
from references import topk_support

from gradpress.compress import Context, create
from gradpress.compress.handwritten import HANDWRITTEN, handwritten

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
EXTREME = [1e300, -1e50, 3.0, 1e-310, -1e-200, 0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, 2.0**-126,
           2.0**-127, -7e4, 7e4, 65504.0, 3e38, -3.4e38, 1e-40]
CASES = [("qsgd", {}), ("qsgd", {"levels": 300, "bucket": 7}), ("qsgd", {"levels": 1, "bucket": 0}),
         ("qsgd", {"levels": 127, "bucket": 100}), ("terngrad", {}), ("terngrad", {"clip": 0.0}),
         ("natural", {}), ("onebit", {}), ("minmax8", {}), ("minmax8", {"chunk": 100, "stochastic": True}),
         ("topk", {"ratio": 0.1})]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads included)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def _check_topk(comp, x: torch.Tensor, ratio: float) -> None:  # noqa: ANN001
    """``topk``'s packet against ``references.topk_indices`` (NaN first, ties to the lower index: the
    extreme inputs and the low-precision dtypes have both): int32 indices,
    the input's own bytes as values; the decode places them in zeros."""
    want = topk_support(x, ratio)
    packet = comp.encode(x)
    values, indices = packet.tensors
    assert _same(indices, want.to(torch.int32)), (x.dtype, x.numel())
    assert _same(values, x.reshape(-1)[want]), (x.dtype, x.numel())
    dense = torch.zeros(x.numel(), dtype=x.dtype)
    dense[want] = x.reshape(-1)[want]
    assert _same(comp.decode(packet), dense.reshape(x.shape))


def _input(d: int, dtype: torch.dtype, extreme: bool, seed: int = 0) -> torch.Tensor:
    x = torch.randn(d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3
    if extreme and d > len(EXTREME):
        x[3: 3 + len(EXTREME)] = torch.tensor(EXTREME, dtype=torch.float64)
    return x.to(dtype)


def test_every_replaced_compressor_has_a_reference_and_a_case() -> None:
    assert {name for name, _ in CASES} == set(HANDWRITTEN)


@pytest.mark.parametrize("extreme", [False, True], ids=["randn", "extreme"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name, params", CASES, ids=[f"{n}{p or ''}" for n, p in CASES])
def test_bit_identical_to_the_hand_written_version_with_the_same_draws(name: str, params: dict, dtype: torch.dtype,
                                                                       extreme: bool) -> None:
    for d in (0, 1, 7, 1000, 4099):
        x = _input(d, dtype, extreme)
        kit_c, ref = create(name, **params), handwritten(name, **params)
        if name == "topk":
            # the kit's top-k keeps the same set as the hand-written torch.topk but in ascending
            # index order, ties to the lowest index: checked against the rule itself, and the same
            # decode as the hand-written version when nothing ties at the k-th magnitude
            _check_topk(kit_c, x, params["ratio"])
            mags = x.double().abs().sort(descending=True).values
            k = math.ceil(params["ratio"] * d)
            if not extreme and 0 < k < d and mags[k - 1] != mags[k]:  # no tie at the k-th magnitude
                assert _same(kit_c.decode(kit_c.encode(x)), ref.decode(ref.encode(x))), (dtype, d)
            continue
        if kit_c.RANDOM:
            kit_c.random_stream = "torch"
        ctx = Context(key="t", step=3, rank=1, world_size=2, seed=5)
        got, want = kit_c.encode(x, ctx), ref.encode(x, ctx)
        assert len(got.tensors) == len(want.tensors)
        for i, (a, b) in enumerate(zip(got.tensors, want.tensors)):
            assert _same(a, b), (name, params, dtype, d, "payload", i)
        assert _same(kit_c.decode(got), ref.decode(want)), (name, params, dtype, d, "decode")
        assert got.nbytes == kit_c.wire_bytes(d, dtype) == ref.encode(x, ctx).nbytes


@pytest.mark.parametrize("name, params", [c for c in CASES if not create(c[0], **c[1]).RANDOM
                                          or (c[0] == "minmax8" and not c[1].get("stochastic"))])
def test_deterministic_methods_are_identical_with_the_default_stream(name: str, params: dict) -> None:
    for dtype in DTYPES:
        x = _input(3000, dtype, True, seed=1)
        if name == "topk":
            _check_topk(create(name, **params), x, params["ratio"])
            continue
        got, want = create(name, **params).encode(x), handwritten(name, **params).encode(x)
        assert all(_same(a, b) for a, b in zip(got.tensors, want.tensors)), (name, dtype)


def _level_probabilities(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """QSGD by its formula in float64: per entry, floor(y) and P(level = floor(y) + 1)."""
    y = x.double().abs() * levels / x.double().norm()
    return y.floor(), y - y.floor()


def test_counter_stream_qsgd_levels_follow_the_formula() -> None:
    """Each entry rounds up with probability y - floor(y): over 4000 calls
    the frequency of rounding up is within 5 binomial standard deviations,
    for every entry (and so the mean decode is x)."""
    x = _input(64, torch.float32, False, seed=4)
    comp = create("qsgd", levels=4, bucket=0)
    lo, p = _level_probabilities(x, 4)
    n = 4000
    ups = torch.zeros(64, dtype=torch.float64)
    norm = x.double().norm()
    for step in range(n):
        out = comp.decode(comp.encode(x, Context(key="q", step=step, rank=0, seed=2))).double()
        ups += (out.abs() * 4 / norm - lo > 0.5).double()
    assert bool(((ups - n * p).abs() <= 5 * (n * p * (1 - p)).sqrt() + 1).all())


@pytest.mark.parametrize("name", ["terngrad", "natural", "minmax8"])
def test_counter_stream_matches_the_reference_distribution(name: str) -> None:
    """terngrad (clip=0): P(+-s) = |g| / max|g|; natural: P(2a) = (|t| - a) / a;
    minmax8 (stochastic): P(code + 1) = frac((x - lo) / step), all from the
    formula in float64, against the counter stream's frequencies."""
    x = _input(64, torch.float32, False, seed=6)
    xd = x.double()
    comp = {"terngrad": create("terngrad", clip=0.0), "natural": create("natural"),
            "minmax8": create("minmax8", stochastic=True, chunk=64)}[name]
    if name == "terngrad":
        p, up = xd.abs() / xd.abs().max(), lambda out: out != 0
    elif name == "natural":
        a = 2.0 ** xd.abs().log2().floor()
        p, up = (xd.abs() - a) / a, lambda out: out.abs() > a * 1.5
    else:
        lo, step = xd.min(), (xd.max() - xd.min()) / 255
        v = (xd - lo) / step
        p, up = v - v.floor(), lambda out: (out - lo) / step > v.floor() + 0.5
    n = 3000
    hits = torch.zeros(64, dtype=torch.float64)
    for step_ in range(n):
        out = comp.decode(comp.encode(x, Context(key=name, step=step_, seed=8))).double()
        hits += up(out).double()
    assert bool(((hits - n * p).abs() <= 5 * (n * p * (1 - p)).sqrt() + 1).all()), name


def test_derived_layout_is_the_exact_wire_size_for_every_declaration() -> None:
    for name, params in CASES:
        comp = create(name, **params)
        for dtype in DTYPES:
            for d in (0, 1, 9, 1025):
                packet = comp.encode(torch.randn(d).to(dtype))
                fields = comp.layout(d, dtype)
                assert [f.name for f in fields] == [f.name for f in comp.FIELDS]
                assert sum(f.nbytes for f in fields) == packet.nbytes == comp.wire_bytes(d, dtype), (name, dtype, d)
                assert [f.dtype for f in fields] == [t.dtype for t in packet.tensors]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_topk_ties_and_nan_follow_the_rule(dtype: torch.dtype) -> None:
    """Ties at the k-th magnitude (a constant tensor, mostly zeros with
    signed zeros, +-equal pairs), NaN above +-inf, on the fast candidate path
    (large d, small ratio) and the whole-tensor path, against the rule."""
    gen = torch.Generator().manual_seed(11)
    d = 70_001
    cases = [
        torch.full((d,), 0.5),
        torch.cat([torch.randn(40, generator=gen), torch.zeros(d // 2), -torch.zeros(d - 40 - d // 2)]),
        torch.randn(d, generator=gen).round(),  # many exact ties at every integer magnitude
        torch.tensor([1.0, -1.0, 2.0, -2.0, 1.0] * 201),
    ]
    spiky = torch.randn(d, generator=gen)
    spiky[[5, 999, 60_000]] = torch.tensor([math.nan, math.inf, -math.inf])
    cases.append(spiky)
    for x in cases:
        for ratio in (0.001, 0.01, 0.3):
            _check_topk(create("topk", ratio=ratio), x.to(dtype), ratio)
