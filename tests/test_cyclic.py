"""The ``cyclic`` strategy (ScaleCom's cyclic local top-k) against its
definition, computed here in float64: at step s the leader is rank
s mod N, the support is the leader's top-k of |x|, every kept coordinate is
the exact mean over the ranks, every rank keeps its own tensor off the
support as its residual; replicas bit-identical; bytes as documented.
Also the refusals, and training through the DDP hook and DiLoCo."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import run_workers
from references import topk_support
from regression import train_hook_and_diloco

from gradpress.compress import Context, create
from gradpress.exchange import Synchronizer, get_strategy
from gradpress.exchange.feedback import Feedback
from gradpress.exchange.planner import Decision

SHAPES = [(40, 25), (3001,), (7, 11)]
RATIO = 0.1


def _tensors(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(97 * step + rank)
    return [torch.randn(s, generator=g) * (1 + rank) for s in SHAPES]


def _direct(rank: int, world: int) -> dict:
    out = {}
    strat = get_strategy("cyclic", None)
    comp = create(f"topk:ratio={RATIO}")
    for step in range(world + 1):
        ts = _tensors(rank, step)
        ctxs = [Context(key=f"t{i}", step=step, rank=rank, world_size=world) for i in range(len(ts))]
        res = strat.exchange(comp, [t.clone() for t in ts], ctxs, Feedback())
        out[step] = {"avg": res.tensors, "residuals": res.residuals, "bytes": res.bytes_sent,
                     "tensor_bytes": res.tensor_bytes}
    no_fb = strat.exchange(comp, [t.clone() for t in _tensors(rank, 0)],
                           [Context(key=f"t{i}", step=0, rank=rank, world_size=world) for i in range(len(SHAPES))], None)
    out["no_feedback"] = no_fb.tensors
    return out


@pytest.fixture(scope="module", params=[2, 3])
def direct(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    return request.param, run_workers(_direct, request.param)


def test_cyclic_is_the_leaders_support_and_the_exact_mean(direct: tuple[int, list[dict]]) -> None:
    world, results = direct
    for step in range(world + 1):
        leader = step % world
        xs = [_tensors(r, step) for r in range(world)]
        for i in range(len(SHAPES)):
            idx = topk_support(xs[leader][i], RATIO)
            want = torch.zeros(xs[0][i].numel(), dtype=torch.float64)
            want[idx] = sum(xs[r][i].double().reshape(-1)[idx] for r in range(world)) / world
            for r in range(world):
                got = results[r][step]["avg"][i]
                assert got.shape == xs[r][i].shape and got.dtype == torch.float32
                assert torch.allclose(got.double().reshape(-1), want, rtol=1e-6, atol=1e-6), (world, step, i, r)
                assert torch.equal(got, results[0][step]["avg"][i])  # replicas bit-identical
                kept = xs[r][i].clone().reshape(-1)
                kept[idx] = 0
                assert torch.equal(results[r][step]["residuals"][i].reshape(-1), kept), (step, i, r)


def test_cyclic_bytes_are_values_for_all_and_indices_on_the_leader(direct: tuple[int, list[dict]]) -> None:
    world, results = direct
    ks = [max(1, math.ceil(RATIO * math.prod(s))) for s in SHAPES]
    for step in range(world + 1):
        for r in range(world):
            leader = r == step % world
            want = [4 * k + (4 * k if leader else 0) for k in ks]
            assert results[r][step]["tensor_bytes"] == want
            assert results[r][step]["bytes"] == 4 * sum(ks) + (8 * len(SHAPES) + 4 * sum(ks) if leader else 0)


def test_cyclic_without_feedback_gives_the_same_average(direct: tuple[int, list[dict]]) -> None:
    world, results = direct
    for r in range(world):
        assert all(torch.equal(a, b) for a, b in zip(results[r]["no_feedback"], results[r][0]["avg"]))


ENGINE_SHAPES = [(30, 40), (50, 20)]
ENGINE_CASES = [{}, {"fb": False}, {"transpose": True}, {"transpose": True, "fb": False}, {"parts": 3},
                {"parts": 3, "fb": False}]


def _engine_inputs(rank: int, step: int, transpose: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    xs = [torch.randn(s, generator=g) * (1 + rank) for s in ENGINE_SHAPES]
    return [x.t() if transpose else x for x in xs]  # transposed: non-contiguous gradients


def _through_the_engine(rank: int, world: int) -> dict:
    """The engine's whole path: compensation, partitions, the result written
    into the caller's tensors, residuals staged; 3 steps per case."""
    out = {}
    for n, case in enumerate(ENGINE_CASES):
        probe = _engine_inputs(0, 0, case.get("transpose", False))
        params = [(f"p{i}", list(x.shape), x.dtype) for i, x in enumerate(probe)]
        engine = Synchronizer("topk:ratio=0.1", params=params, strategy="cyclic", min_numel=0,
                              error_feedback=case.get("fb", True))
        if case.get("parts"):
            for k, shape, _ in params:
                engine.plan.decisions[k] = Decision(k, math.prod(shape), "cyclic", case["parts"])
        steps = []
        for step in range(3):
            ts = _engine_inputs(rank, step, case.get("transpose", False))
            engine.sync([f"p{i}" for i in range(len(ts))], ts, step=step)
            steps.append([t.clone() for t in ts])
        out[n] = steps
    return out


def test_cyclic_through_the_engine_is_the_definition() -> None:
    """float64 reference with error feedback carried across steps (or not),
    each partition its own top-k of the leader's compensated piece."""
    world = 2
    results = run_workers(_through_the_engine, world)
    for n, case in enumerate(ENGINE_CASES):
        parts, fb = case.get("parts") or 1, case.get("fb", True)
        resid = [[torch.zeros(math.prod(s), dtype=torch.float64) for s in ENGINE_SHAPES] for _ in range(world)]
        for step in range(3):
            leader = step % world
            comp = [[t.double().reshape(-1) + (resid[r][i] if fb else 0)
                     for i, t in enumerate(_engine_inputs(r, step, case.get("transpose", False)))] for r in range(world)]
            for i in range(len(ENGINE_SHAPES)):
                support, offset = [], 0
                for piece in torch.tensor_split(comp[leader][i], parts):
                    support.append(topk_support(piece, 0.1) + offset)
                    offset += piece.numel()
                idx = torch.cat(support)
                want = torch.zeros_like(comp[0][i])
                want[idx] = sum(comp[r][i][idx] for r in range(world)) / world
                for r in range(world):
                    got = results[r][n][step][i].double().reshape(-1)
                    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), (case, step, i, r)
                    resid[r][i] = comp[r][i].clone()
                    resid[r][i][idx] = 0


EXTREME = {torch.float16: 6.0e4, torch.bfloat16: 3.0e38, torch.float32: 3.0e38, torch.float64: 1.7e308}


def _extreme(rank: int, world: int, strategy: str = "cyclic") -> dict:
    """Mixed magnitudes up to near each dtype's maximum (a sum of the ranks'
    values would overflow it), subnormal-sized entries, every dtype, through
    ``strategy`` (test_union.py runs it for ``union``)."""
    out = {}
    for dtype, big in EXTREME.items():
        g = torch.Generator().manual_seed(5 + rank)
        top = int(math.log10(big)) - 1  # below the maximum: only the entries set next reach it (no ties there)
        scale = torch.full((64, 16), 10.0, dtype=torch.float64) ** torch.randint(-40, top, (64, 16), generator=g)
        x = torch.randn(64, 16, generator=g, dtype=torch.float64) * scale
        x.view(-1)[:8] = big * (1 - 0.01 * rank)  # the largest entries, in the support
        x = x.to(dtype)
        assert bool(torch.isfinite(x).all())
        ctx = [Context(key="w", step=0, rank=rank, world_size=world)]
        res = get_strategy(strategy, None).exchange(create(f"topk:ratio={RATIO}"), [x.clone()], ctx, Feedback())
        out[dtype] = (x, res.tensors[0])
    return out


def test_cyclic_on_extreme_finite_inputs_stays_finite_exact_and_identical() -> None:
    """The mean on the support, computed here in float64, within the dtype's
    rounding; finite where the sum of the ranks' values is not (the values
    are scaled by 1/N before the allreduce, as ``allreduce`` scales its
    payloads); replicas bit-identical."""
    world = 2
    results = run_workers(_extreme, world)
    for dtype in EXTREME:
        xs = [results[r][dtype][0] for r in range(world)]
        idx = topk_support(xs[0], RATIO)  # rank 0 leads step 0; NaN first
        want = torch.zeros(xs[0].numel(), dtype=torch.float64)
        want[idx] = sum(x.double().reshape(-1)[idx] / world for x in xs)  # float64's own sum would overflow
        got = results[0][dtype][1]
        assert got.dtype == dtype and bool(torch.isfinite(got).all()), dtype
        assert torch.equal(got, results[1][dtype][1]), dtype
        eps = torch.finfo(dtype).eps
        assert torch.allclose(got.double().reshape(-1), want, rtol=4 * eps, atol=0), dtype


def _leader_fails(rank: int, world: int) -> str:
    comp = create("topk:ratio=0.1")

    def broken(x, ctx=None):  # noqa: ANN001, ANN202
        raise ValueError("the leader's encode broke")

    comp.encode = broken  # only the leader (rank 0 at step 0) calls it
    ctxs = [Context(key="w", step=0, rank=rank, world_size=world)]
    try:
        get_strategy("cyclic", None).exchange(comp, [torch.randn(100, 10)], ctxs, Feedback())
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_failing_leader_fails_every_rank_with_a_clear_error() -> None:
    leader, other = run_workers(_leader_fails, 2)
    assert leader == "ValueError: the leader's encode broke"
    assert other.startswith("RuntimeError") and "rank 0" in other and "'w'" in other, other


def test_cyclic_refuses_what_it_cannot_carry() -> None:
    strat = get_strategy("cyclic", None)
    assert strat.supports(create("topk:ratio=0.01")) is None
    assert strat.supports(create("threshold:tau=0.1")) is None
    assert "qsgd" in strat.supports(create("qsgd")) and "topk" in strat.supports(create("qsgd"))
    assert "state" in strat.supports(create("sidco:ratio=0.01"))


def _train(rank: int, world: int) -> dict:
    return train_hook_and_diloco(rank, "cyclic")


def test_cyclic_trains_through_the_hook_and_diloco() -> None:
    r0, r1 = run_workers(_train, 2)
    for how in ("hook", "diloco"):
        assert torch.equal(r0[how]["params"], r1[how]["params"]), how
        assert r0[how]["losses"][-1] < 0.8 * r0[how]["losses"][0], (how, r0[how]["losses"])
