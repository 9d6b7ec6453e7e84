"""Summable 16-bit payloads are added in 16 bits (allreduce, the ring's hops,
a PS root): fp32 gradients beyond fp16's range must average to a finite,
saturated value, never inf (found by tests/test_exchange_fuzz.py's long run:
fp16 through allreduce/ring/auto averaged fp32 inputs near 1e37 to inf)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from distributed import run_workers
from hypothesis import given, settings
from hypothesis import strategies as st

from gradpress.compress import Context, create
from gradpress.compress.numerics import summand_limit
from gradpress.exchange import get_strategy
from gradpress.exchange.feedback import Feedback

HALF = [torch.float16, torch.bfloat16]


def _sum_in(dtype: torch.dtype, terms: list[float], order: str) -> float:
    """The sum of ``terms`` (each rounded to ``dtype``), added in ``dtype``:
    left to right, or pairwise (a tree, as reduce-scatter schedules add)."""
    vals = [torch.tensor(t, dtype=dtype) for t in terms]
    if order == "sequential":
        acc = vals[0]
        for v in vals[1:]:
            acc = acc + v
        return float(acc)
    while len(vals) > 1:
        vals = [vals[i] + vals[i + 1] if i + 1 < len(vals) else vals[i] for i in range(0, len(vals), 2)]
    return float(vals[0])


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n", [2, 3, 4, 7, 16, 100, 255])
def test_the_worst_case_sum_stays_finite(dtype: torch.dtype, n: int) -> None:
    limit = summand_limit(dtype, n)
    top = torch.finfo(dtype).max
    for order in ("sequential", "pairwise"):
        assert abs(_sum_in(dtype, [limit] * n, order)) <= top
        assert abs(_sum_in(dtype, [-limit] * n, order)) <= top
    # not needlessly small: the bound gives up at most (n + 1) half spacings of the top binade (2^emax eps / 2)
    half_spacing = top / (2 - torch.finfo(dtype).eps) * torch.finfo(dtype).eps / 2
    assert n * limit >= top - (n + 1) * half_spacing - 1e-9 * top


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(HALF), st.integers(2, 64), st.integers(0, 2**31))
def test_any_terms_within_the_bound_sum_finitely_in_any_order(dtype: torch.dtype, n: int, seed: int) -> None:
    rnd = random.Random(seed)
    limit = summand_limit(dtype, n)
    terms = [limit * rnd.choice([1.0, 1.0, 0.999, rnd.random()]) for _ in range(n)]
    rnd.shuffle(terms)
    for order in ("sequential", "pairwise"):
        assert abs(_sum_in(dtype, terms, order)) <= torch.finfo(dtype).max


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_bound_is_the_identity_within_range_and_a_clamp_beyond(name: str) -> None:
    comp = create(name)
    x = torch.randn(1000, dtype=torch.float32)
    assert comp.bound_summand(x, 4) is x  # in range: the packet is bit for bit the unbounded one
    assert comp.bound_summand(x, 1) is x
    target = torch.float16 if name == "fp16" else torch.bfloat16
    big = torch.tensor([3e38, -3e38, float("inf"), float("nan"), 1.0], dtype=torch.float32)
    if name == "fp16":
        big[:2] = torch.tensor([1e6, -1e6])
    limit = summand_limit(target, 4)
    out = comp.bound_summand(big, 4)
    assert out[0].item() == pytest.approx(limit, rel=1e-6) and out[1].item() == pytest.approx(-limit, rel=1e-6)
    assert out[2].item() == pytest.approx(limit, rel=1e-6) and torch.isnan(out[3]) and out[4].item() == 1.0
    assert create("none").bound_summand(big, 4) is big  # payload in the input's own dtype: nothing to bound


def _worker(rank: int, world: int) -> dict:
    out = {}
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 9, generator=g, dtype=torch.float32)
    x[0, :] = 1e6 * (rank + 1)  # every rank beyond fp16's range, same sign
    x[1, :] = -3e37  # near fp32's maximum
    x[2, :] = 40000.0  # x / N fits one fp16 payload, the sum of N does not (N >= 2)
    for strategy in ("allreduce", "ring", "ps"):
        for ef in (False, True):
            strat = get_strategy(strategy, None)
            ctx = Context(key="w", step=0, rank=rank, world_size=world, seed=3)
            feedback = Feedback() if ef else None
            res = strat.exchange(create("fp16"), [x.clone()], [ctx], feedback)
            out[(strategy, ef)] = res.tensors[0]
    out["x"] = x
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_fp16_averages_of_out_of_range_gradients_saturate(world: int) -> None:
    results = run_workers(_worker, world)
    xs = torch.stack([r["x"].double() for r in results])
    mean = xs.mean(0)
    top = torch.finfo(torch.float16).max
    for key in results[0]:
        if key == "x":
            continue
        avg = results[0][key]
        assert all(torch.equal(r[key], avg) for r in results), key  # replicas identical
        assert torch.isfinite(avg).all(), (key, avg[:3, 0])
        assert (avg[0] > top / 2).all() and (avg[0] <= top).all(), key  # saturated, right sign
        assert (avg[1] < -top / 2).all() and (avg[1] >= -top).all(), key
        # 40000 on every rank: x / N fits, and so does the mean, though N such payloads each at 65504 / N would not
        assert torch.allclose(avg[2].double(), mean[2], rtol=1e-3), key
        # entries in range: the float64 mean within fp16 rounding (the bound did not touch them)
        rest = avg[3:].double()
        assert torch.allclose(rest, mean[3:], rtol=2e-3, atol=2e-3), key


def _bound_by_definition(target: torch.dtype, n: int) -> float:
    """(M - (N + 1) h) / N, h half the spacing of the top binade (floored at M / 2 in total)."""
    finfo = torch.finfo(target)
    h = 2.0 ** (math.frexp(finfo.max)[1] - 1) * finfo.eps / 2  # the top binade starts at 2^emax
    return max(finfo.max - (n + 1) * h, finfo.max / 2) / n


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("n", [2, 3, 8])
def test_bounded_summand_keeps_the_input_dtype(name: str, dtype: torch.dtype, n: int) -> None:
    """The bounded tensor (and so the packet, and the decoded average) has
    the input's dtype, whether or not anything was beyond the bound: a rank
    whose gradient reached the bound must not decode another dtype than
    the ranks whose gradient did not (replicas differ in dtype otherwise),
    and each entry stays within the bound."""
    comp = create(name)
    target = torch.float16 if name == "fp16" else torch.bfloat16
    top = torch.finfo(dtype).max
    x = torch.tensor([top, -top, float("inf"), float("-inf"), float("nan"), 1.0, -0.5], dtype=dtype)
    out = comp.bound_summand(x, n)
    assert out.dtype == dtype
    limit = _bound_by_definition(target, n)
    finite = out[torch.isfinite(out)].double()
    assert finite.numel() == 6 and (finite.abs() <= limit).all(), (finite, limit)
    assert float(out[5]) == 1.0 and float(out[6]) == -0.5 and torch.isnan(out[4])
    packet = comp.encode(out, Context(key="w"))
    assert packet.dtype == dtype and comp.decode(packet).dtype == dtype
    # n such payloads added in the payload's dtype stay finite
    payload = packet.tensors[0][:4]
    total = payload.clone()
    for _ in range(n - 1):
        total = total + payload
    assert torch.isfinite(total).all(), total


def _dtype_worker(rank: int, world: int) -> dict:
    out = {}
    for name in ("fp16", "bf16"):
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.linspace(-1, 1, 24, dtype=torch.float64).to(dtype).reshape(4, 6)
            if rank == 0:  # only rank 0 reaches the bound
                x[1, 2] = torch.finfo(dtype).max
            for strategy in ("allreduce", "ring", "ps"):
                ctx = Context(key="w", step=0, rank=rank, world_size=world, seed=3)
                res = get_strategy(strategy, None).exchange(create(name), [x.clone()], [ctx], None)
                out[(name, str(dtype), strategy)] = res.tensors[0]
            out[(name, str(dtype), "x")] = x
    return out


def test_an_average_that_one_rank_bounded_is_the_same_tensor_on_every_rank() -> None:
    results = run_workers(_dtype_worker, 2)
    for key, avg in results[0].items():
        if key[2] == "x":
            continue
        name, dtype, _ = key
        assert all(r[key].dtype == avg.dtype for r in results), (key, [r[key].dtype for r in results])
        assert str(avg.dtype) == dtype, key  # the input's dtype
        assert all(torch.equal(r[key], avg) for r in results), key
        assert torch.isfinite(avg).all(), key
        mean = torch.stack([r[(name, dtype, "x")].double() for r in results]).mean(0)
        rest = torch.ones_like(mean, dtype=torch.bool)
        rest[1, 2] = False
        assert torch.allclose(avg.double()[rest], mean[rest], rtol=2e-2, atol=2e-2), key
        # saturated near the smaller of the two maxima over N = 2 (rank 0's max / 2 at least, had it fit)
        top = min(torch.finfo(torch.float16 if name == "fp16" else torch.bfloat16).max,
                  torch.finfo(getattr(torch, dtype.split(".")[1])).max)
        assert top / 2 * 0.99 < avg[1, 2].double() <= top, key


# ------------------------------------------------------------- under a loss scaler: an overflow is Inf everywhere
SCALER_STRATEGIES = ("allreduce", "allgather", "ring", "ps", "hierarchical:workers_per_host=2",
                     "hierarchical:workers_per_host=2,outer=ring")
SCALER_CODECS = ("fp16", "topk:ratio=0.25>fp16")


def _scaler_worker(rank: int, world: int) -> dict:
    """Rank 1 alone holds 1e6 at [0, 0] (its own fp16 cast overflows, whatever the division by N); every rank
    holds 7e4 at [1, 0] (7e4 / N fits one payload, the 16-bit sum of N does not). Both exchanged with
    ``Context.loss_scaler`` True (a loss scaler attached) and False, through every path that adds 16-bit
    payloads or re-encodes them (collective sum, allgather, ring hops, PS root, hierarchical leaders)."""
    from gradpress.exchange.base import parse_strategy, strategy_class

    out = {}
    x = torch.linspace(-1, 1, 64 * 4, dtype=torch.float64).reshape(64, 4).float()
    x[1, 0] = 7e4
    if rank == 1:
        x[0, 0] = 1e6
    for spec in SCALER_CODECS:
        for strategy in SCALER_STRATEGIES:
            name, params = parse_strategy(strategy)
            strat = strategy_class(name)(None, **params)
            if spec != "fp16" and name == "allreduce":
                continue  # a composition is not summable
            for scaler in (True, False):
                ctx = Context(key="w", step=0, rank=rank, world_size=world, seed=3, loss_scaler=scaler)
                res = strat.exchange(create(spec), [x.clone()], [ctx], None)
                out[(spec, strategy, scaler)] = res.tensors[0]
    return out


def test_under_a_loss_scaler_one_ranks_fp16_overflow_is_inf_on_every_rank_on_every_path() -> None:
    """Plain fp16 AMP's rule with a scaler (every rank's scaler must see the overflow and skip the step):
    the overflowing entries come out non-finite on every rank, the same bytes everywhere; without a scaler
    the same exchange saturates (finite). A PS root or a ring hop that re-encodes without the caller's
    ``loss_scaler`` saturated the Inf it had received back to 65504."""
    results = run_workers(_scaler_worker, 4)
    assert len(results[0]) == 2 * (2 * len(SCALER_STRATEGIES) - 1)
    for key, avg in results[0].items():
        spec, strategy, scaler = key
        for r, res in enumerate(results):
            got = res[key]
            same = torch.equal(torch.isfinite(got), torch.isfinite(avg)) and torch.equal(
                got[torch.isfinite(got)], avg[torch.isfinite(avg)])
            assert same, f"{key}: rank {r}'s average differs from rank 0's"
        bad = ~torch.isfinite(avg)
        if scaler:
            assert bool(bad[0, 0]) and bool(bad[1, 0]), (f"{spec} via {strategy} with a scaler: the overflow was "
                                                        f"hidden: {avg[0, 0].item()}, {avg[1, 0].item()}")
            assert not bool(bad[2:].any()), f"{spec} via {strategy}: entries in range went non-finite"
        else:
            assert not bool(bad.any()), f"{spec} via {strategy} without a scaler: not saturated"
