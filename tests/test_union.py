"""The ``union`` strategy (sparse allreduce on the union of the ranks' top-k
supports, SparCML) against its definition, computed here in float64: the
support is the union of every rank's own top-k of |x| (or threshold mask),
every coordinate of it is the exact mean over the ranks, every rank keeps
its own tensor off the union as its residual; replicas bit-identical; bytes
as documented. Also the refusals, variable supports (threshold, an empty
one), and training through the DDP hook and DiLoCo."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import run_workers
from references import topk_support
from regression import train_hook_and_diloco
from test_cyclic import ENGINE_SHAPES, EXTREME, RATIO, SHAPES, _engine_inputs, _extreme, _tensors

import gradpress
from gradpress.compress import Context, create
from gradpress.exchange import Synchronizer, get_strategy
from gradpress.exchange.feedback import Feedback

TAU = 2.5


def _threshold_tensors(rank: int) -> list[torch.Tensor]:
    """Counts differ between ranks; rank 0's last tensor selects nothing."""
    ts = _tensors(rank, 7)
    if rank == 0:
        ts[2] = ts[2] * 0.1
    return ts


def _direct(rank: int, world: int) -> dict:
    out = {}
    strat = get_strategy("union", None)
    for name, spec in (("topk", f"topk:ratio={RATIO}"), ("threshold", f"threshold:tau={TAU}")):
        comp = create(spec)
        steps = range(3) if name == "topk" else [7]
        for step in steps:
            ts = _tensors(rank, step) if name == "topk" else _threshold_tensors(rank)
            ctxs = [Context(key=f"t{i}", step=step, rank=rank, world_size=world) for i in range(len(ts))]
            res = strat.exchange(comp, [t.clone() for t in ts], ctxs, Feedback())
            out[name, step] = {"avg": res.tensors, "residuals": res.residuals, "bytes": res.bytes_sent,
                               "tensor_bytes": res.tensor_bytes}
    import gradpress.exchange.strategies.union as union_module

    limit, union_module.MAX_INDEXED = union_module.MAX_INDEXED, 8  # every tensor "too large" for int32 indices
    try:
        wide = strat.exchange(create(f"topk:ratio={RATIO}"), [t.clone() for t in _tensors(rank, 0)],
                              [Context(key=f"t{i}", step=0, rank=rank, world_size=world) for i in range(len(SHAPES))],
                              Feedback())
    finally:
        union_module.MAX_INDEXED = limit
    out["wide", 0] = {"avg": wide.tensors, "residuals": wide.residuals, "bytes": wide.bytes_sent,
                      "tensor_bytes": wide.tensor_bytes}
    no_fb = strat.exchange(create(f"topk:ratio={RATIO}"), [t.clone() for t in _tensors(rank, 0)],
                           [Context(key=f"t{i}", step=0, rank=rank, world_size=world) for i in range(len(SHAPES))], None)
    out["no_feedback"] = (no_fb.tensors, no_fb.residuals)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def direct(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    return request.param, run_workers(_direct, request.param)


def _threshold_support(x: torch.Tensor) -> torch.Tensor:
    return torch.nonzero(x.double().reshape(-1).abs() >= TAU).reshape(-1)


def _check_union(xs: list[list[torch.Tensor]], results: list[dict], key: tuple, support) -> list[int]:  # noqa: ANN001
    """Every rank's average and residual against the float64 definition
    (``support(r, i)``: rank r's selected indices of tensor i); returns the
    union sizes."""
    world, sizes = len(xs), []
    for i in range(len(SHAPES)):
        union = torch.unique(torch.cat([support(r, i) for r in range(world)]))
        sizes.append(union.numel())
        want = torch.zeros(xs[0][i].numel(), dtype=torch.float64)
        want[union] = sum(xs[r][i].double().reshape(-1)[union] for r in range(world)) / world
        for r in range(world):
            got = results[r][key]["avg"][i]
            assert got.shape == xs[r][i].shape and got.dtype == torch.float32
            assert torch.allclose(got.double().reshape(-1), want, rtol=1e-6, atol=1e-6), (world, key, i, r)
            assert torch.equal(got, results[0][key]["avg"][i])  # replicas bit-identical
            kept = xs[r][i].clone().reshape(-1)
            kept[union] = 0
            assert torch.equal(results[r][key]["residuals"][i].reshape(-1), kept), (key, i, r)
    return sizes


def test_union_is_the_exact_mean_on_every_ranks_support(direct: tuple[int, list[dict]]) -> None:
    world, results = direct
    for step in range(3):
        xs = [_tensors(r, step) for r in range(world)]
        sizes = _check_union(xs, results, ("topk", step), lambda r, i, xs=xs: topk_support(xs[r][i], RATIO))
        ks = [max(1, math.ceil(RATIO * math.prod(s))) for s in SHAPES]
        assert all(k < u <= world * k for k, u in zip(ks, sizes))  # random tensors: supports differ, may overlap


def test_union_bytes_are_indices_gathered_and_union_values_summed(direct: tuple[int, list[dict]]) -> None:
    """Per rank: the size exchange (one int64 count per tensor and one size),
    its indices padded to the largest rank's (8-byte multiple), the union's
    values; ``tensor_bytes``: its own indices and the union's values."""
    world, results = direct
    for key, tensors, select in [(("topk", s), lambda r, s=s: _tensors(r, s),
                                     lambda x: topk_support(x, RATIO)) for s in range(3)] + [
            (("threshold", 7), _threshold_tensors, _threshold_support)]:
        xs = [tensors(r) for r in range(world)]
        unions = [torch.unique(torch.cat([select(xs[r][i]) for r in range(world)])).numel() for i in range(len(SHAPES))]
        counts = [[select(xs[r][i]).numel() for i in range(len(SHAPES))] for r in range(world)]
        widest = max(4 * sum(c) for c in counts)
        for r in range(world):
            assert results[r][key]["tensor_bytes"] == [4 * u + 4 * c for u, c in zip(unions, counts[r])], (key, r)
            want = 8 * len(SHAPES) + 8 + (widest + 7) // 8 * 8 + 4 * sum(unions)
            assert results[r][key]["bytes"] == want, (key, r)


def test_union_sends_int64_indices_when_a_tensor_is_beyond_int32(direct: tuple[int, list[dict]]) -> None:
    """Past 2^31 - 1 elements (the limit lowered to 8 here) the indices
    travel as int64, 8 bytes each, and the average is still the definition
    (int32 would wrap to negative indices: values land elsewhere, silently)."""
    world, results = direct
    xs = [_tensors(r, 0) for r in range(world)]
    sizes = _check_union(xs, results, ("wide", 0), lambda r, i: topk_support(xs[r][i], RATIO))
    counts = [[topk_support(xs[r][i], RATIO).numel() for i in range(len(SHAPES))] for r in range(world)]
    for r in range(world):
        assert results[r]["wide", 0]["tensor_bytes"] == [4 * u + 8 * c for u, c in zip(sizes, counts[r])]
        assert results[r]["wide", 0]["bytes"] == 8 * len(SHAPES) + 8 + max(8 * sum(c) for c in counts) + 4 * sum(sizes)


def test_union_with_variable_and_empty_supports(direct: tuple[int, list[dict]]) -> None:
    world, results = direct
    xs = [_threshold_tensors(r) for r in range(world)]
    assert _threshold_support(xs[0][2]).numel() == 0 and _threshold_support(xs[1][2]).numel() > 0
    assert len({_threshold_support(xs[r][0]).numel() for r in range(world)}) > 1  # counts differ between ranks
    _check_union(xs, results, ("threshold", 7), lambda r, i: _threshold_support(xs[r][i]))


def test_union_without_feedback_gives_the_same_average(direct: tuple[int, list[dict]]) -> None:
    world, results = direct
    for r in range(world):
        avg, residuals = results[r]["no_feedback"]
        assert residuals is None
        assert all(torch.equal(a, b) for a, b in zip(avg, results[r]["topk", 0]["avg"]))


def _through_the_engine(rank: int, world: int) -> dict:
    """The engine's whole path: compensation, the result written into the
    caller's tensors, residuals staged; 3 steps per case."""
    out = {}
    for fb in (True, False):
        for transpose in (False, True):
            probe = _engine_inputs(0, 0, transpose)
            params = [(f"p{i}", list(x.shape), x.dtype) for i, x in enumerate(probe)]
            engine = Synchronizer("topk:ratio=0.1", params=params, strategy="union", min_numel=0, error_feedback=fb)
            steps = []
            for step in range(3):
                ts = _engine_inputs(rank, step, transpose)
                engine.sync([f"p{i}" for i in range(len(ts))], ts, step=step)
                steps.append([t.clone() for t in ts])
            out[fb, transpose] = (steps, engine.stats["bytes_sent"])
    return out


def test_union_through_the_engine_is_the_definition() -> None:
    """float64 reference with error feedback carried across steps (or not):
    each rank's top-k of its compensated tensor, the exact mean on the union."""
    world = 2
    results = run_workers(_through_the_engine, world)
    for fb in (True, False):
        for transpose in (False, True):
            resid = [[torch.zeros(math.prod(s), dtype=torch.float64) for s in ENGINE_SHAPES] for _ in range(world)]
            for step in range(3):
                comp = [[t.double().reshape(-1) + (resid[r][i] if fb else 0)
                         for i, t in enumerate(_engine_inputs(r, step, transpose))] for r in range(world)]
                for i in range(len(ENGINE_SHAPES)):
                    union = torch.unique(torch.cat([topk_support(comp[r][i], 0.1)
                                                    for r in range(world)]))
                    want = torch.zeros_like(comp[0][i])
                    want[union] = sum(comp[r][i][union] for r in range(world)) / world
                    for r in range(world):
                        got = results[r][fb, transpose][0][step][i].double().reshape(-1)
                        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), (fb, transpose, step, i, r)
                        resid[r][i] = comp[r][i].clone()
                        resid[r][i][union] = 0
            assert results[0][fb, transpose][1] > 0


def test_union_on_extreme_finite_inputs_stays_finite_exact_and_identical() -> None:
    world = 2
    results = run_workers(_extreme, world, "union")
    for dtype in EXTREME:
        xs = [results[r][dtype][0] for r in range(world)]
        union = torch.unique(torch.cat([topk_support(x, RATIO) for x in xs]))
        want = torch.zeros(xs[0].numel(), dtype=torch.float64)
        want[union] = sum(x.double().reshape(-1)[union] / world for x in xs)  # float64's own sum would overflow
        got = results[0][dtype][1]
        assert got.dtype == dtype and bool(torch.isfinite(got).all()), dtype
        assert torch.equal(got, results[1][dtype][1]), dtype
        eps = torch.finfo(dtype).eps
        assert torch.allclose(got.double().reshape(-1), want, rtol=4 * eps, atol=0), dtype


def test_union_refuses_what_it_cannot_carry() -> None:
    strat = get_strategy("union", None)
    assert strat.supports(create("topk:ratio=0.01")) is None
    assert strat.supports(create("threshold:tau=0.1")) is None
    assert strat.supports(create("sidco:ratio=0.01")) is None  # every rank runs its own compressor: state is fine
    assert "qsgd" in strat.supports(create("qsgd")) and "topk" in strat.supports(create("qsgd"))
    with pytest.raises(ValueError, match="union"):
        gradpress.exchange.base.check_strategy("union", create("qsgd"))
    with pytest.raises(ValueError, match=r"not 'none' \(pass one, e.g. --compressor topk"):
        gradpress.exchange.base.check_strategy("union", create("none"))


def test_union_is_one_piece_per_tensor_for_the_planner() -> None:
    """Its prediction asks for no partitioning (a second piece would only add
    a second index gather and allreduce)."""
    from gradpress.exchange.costs import CostModel
    from gradpress.exchange.planner import Planner

    link = {"allreduce": (2e-4, 2e-4, 1e-6), "allgather": (2e-4, 2e-4, 4e-6), "broadcast": (5e-5, 5e-5, 1e-8),
            "p2p": (2e-4, 2e-4, 1e-6), "encode": (1e-5, 1e-5, 1e-9), "decode": (1e-5, 1e-5, 1e-9),
            "wire": (0.0, 0.0, 1.0), "root_wire": (0.0, 0.0, 1.0)}
    assert get_strategy("union", None).predict(CostModel.from_mapping(link), 100_000, 4, False)[1] == 1
    assert Planner.from_costs(link, 4, candidates=["union"]).decide("w", 100_000).parts == 1


@pytest.mark.parametrize("spec", ["threshold:tau=0.5", "sidco:ratio=0.1", "dgc_threshold:ratio=0.1", "topk:ratio=0.1",
                                  "dgc:ratio=0.1", "adacomp", "gaussiank:ratio=0.1", "redsync:ratio=0.1",
                                  "fft:theta=0.5"])
def test_sparsifiers_refuse_tensors_their_int32_indices_cannot_address(spec: str, monkeypatch) -> None:  # noqa: ANN001
    """Beyond 2^31 - 1 elements int32 indices would wrap to negative numbers
    and the values land elsewhere, silently: refused, naming the limit (the
    limit lowered here: a real tensor that large is 8 GB)."""
    import gradpress.compress.sparse as sparse

    monkeypatch.setattr(sparse, "MAX_INDEXED", 1000)
    x = torch.randn(1001)
    with pytest.raises(ValueError, match=r"1001 elements; allowed: at most 1000 per tensor \(its flat indices are int32\)"):
        create(spec).encode(x, Context(key="w", step=0, rank=0, world_size=1))
    create(spec).encode(x[:1000], Context(key="w", step=0, rank=0, world_size=1))


def _train(rank: int, world: int) -> dict:
    return train_hook_and_diloco(rank, "union")


def test_union_trains_through_the_hook_and_diloco() -> None:
    r0, r1 = run_workers(_train, 2)
    for how in ("hook", "diloco"):
        assert torch.equal(r0[how]["params"], r1[how]["params"]), how
        assert r0[how]["losses"][-1] < 0.8 * r0[how]["losses"][0], (how, r0[how]["losses"])


def _stateful(rank: int, world: int) -> list[dict]:
    """A threshold estimator (state per tensor, on every rank) through union, 3 steps."""
    comp, strat, out = create("sidco:ratio=0.1"), get_strategy("union", None), []
    for step in range(3):
        ts = _tensors(rank, step)
        ctxs = [Context(key=f"t{i}", step=step, rank=rank, world_size=world) for i in range(len(ts))]
        res = strat.exchange(comp, [t.clone() for t in ts], ctxs, Feedback())
        out.append({"avg": res.tensors, "residuals": res.residuals})
    return out


def test_union_carries_a_stateful_threshold_estimator() -> None:
    """Each rank's support is what its own ``sidco`` (state carried over the
    steps) selects, replayed here rank by rank; the union's mean and the
    residuals follow the definition in float64."""
    world = 2
    results = run_workers(_stateful, world)
    replay = [create("sidco:ratio=0.1") for _ in range(world)]
    for step in range(3):
        xs = [_tensors(r, step) for r in range(world)]
        supports = [[replay[r].encode(xs[r][i].clone(), Context(key=f"t{i}", step=step, rank=r, world_size=world))
                     .tensors[1].long() for i in range(len(SHAPES))] for r in range(world)]
        per_step = [{("sidco", step): results[r][step]} for r in range(world)]
        _check_union(xs, per_step, ("sidco", step), lambda r, i, s=supports: s[r][i])


@pytest.mark.parametrize("out_first", [True, False], ids=["out-below-input", "out-above-input"])
@pytest.mark.parametrize("name", ["union", "cyclic"])
def test_the_result_goes_into_out_unless_it_is_the_input_with_feedback(name: str, out_first: bool) -> None:
    """Both one-support strategies (one rank here) write the average into the
    caller's ``out`` when it is contiguous, at either side of the input in
    memory; into a fresh tensor when ``out`` is the input itself and error
    feedback still needs the input for the residual (in place without
    feedback) or when ``out`` is not contiguous. The values follow the
    definition every time."""
    strat, comp = get_strategy(name, None), create(f"topk:ratio={RATIO}")
    ctx = [Context(key="w", step=0, rank=0, world_size=1)]
    x = torch.randn(40, 25, generator=torch.Generator().manual_seed(3))
    want = torch.zeros(x.numel())
    idx = topk_support(x, RATIO)
    want[idx] = x.reshape(-1)[idx]
    want = want.view_as(x)
    buf = torch.zeros(2 * x.numel())
    lo, hi = buf[: x.numel()].view_as(x), buf[x.numel():].view_as(x)
    out, t = (lo, hi) if out_first else (hi, lo)
    t.copy_(x)
    res = strat.exchange(comp, [t], ctx, Feedback(), out=[out])
    assert res.tensors[0].data_ptr() == out.data_ptr() and torch.equal(res.tensors[0], want)
    same = x.clone()
    res = strat.exchange(comp, [same], ctx, Feedback(), out=[same])
    assert res.tensors[0].data_ptr() != same.data_ptr() and torch.equal(res.tensors[0], want)
    assert torch.equal(res.residuals[0], x - want)
    same = x.clone()
    res = strat.exchange(comp, [same], ctx, None, out=[same])
    assert res.tensors[0].data_ptr() == same.data_ptr() and torch.equal(res.tensors[0], want)
    strided = torch.zeros(25, 40).t()
    res = strat.exchange(comp, [x.clone()], ctx, None, out=[strided])
    assert res.tensors[0].is_contiguous() and torch.equal(res.tensors[0], want)
