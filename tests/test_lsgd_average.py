"""LSGD's ``average=true`` on 4 gloo workers against a float64 reference the
test computes itself: every tau steps the worker with the lowest mean
training loss since the last election leads (ties to the lowest rank) and
every worker moves to (1 - c) mean_i(x_i) + c x_leader; the same leader and
bit-identical parameters on every rank after each election, c = 1 copies the
leader exactly, bit-identical resume, the bytes of one model allreduce per
election, and the configurations it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import checkpoint, restore, run_workers, value_errors
from test_algorithms import make_model
from test_algorithms_lsgd import build, flat, local_sgd_step, train

import gradpress.algorithms as algorithms

WORLD = 4
STEPS = 9


def reference(world: int, steps: int, tau: int, c: float) -> tuple[list[torch.Tensor], list[int]]:
    """Final parameters of every worker and the leader of every election."""
    models = [make_model() for _ in range(world)]
    window: list[list[float]] = [[] for _ in range(world)]
    leaders = []
    for s in range(steps):
        local_sgd_step(models, s, window)
        if (s + 1) % tau:
            continue
        means = [(sum(w) / len(w), r) for r, w in enumerate(window)]
        window = [[] for _ in range(world)]
        lead = min(means)[1]
        leaders.append(lead)
        xs = [flat(m) for m in models]
        mean = sum(xs) / world
        new = (1 - c) * mean + c * xs[lead]
        for m in models:
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(new.clone(), m.parameters())
    return [flat(m) for m in models], leaders


def _worker(rank: int, world: int) -> dict:
    out: dict = {}
    model, opt, algo = build(rank, "lsgd:tau=3,c=0.3,average=true")
    out["avg"] = train(rank, model, opt, algo, 0, STEPS)
    out["stats"] = algo.stats
    out["eval"] = flat(algo.eval_model())
    model, opt, algo = build(rank, "lsgd:tau=2,c=1,average=true")
    out["copy"] = train(rank, model, opt, algo, 0, STEPS)
    # resume between elections
    model, opt, algo = build(rank, "lsgd:tau=2,c=0.5,average=true")
    train(rank, model, opt, algo, 0, 5)
    saved = checkpoint(algo=algo, model=model, opt=opt)
    straight = train(rank, model, opt, algo, 5, STEPS)["params"]
    model, opt, algo = build(rank, "lsgd:tau=2,c=0.5,average=true")
    restore(saved, model=model, opt=opt, algo=algo)
    out["resume"] = {"straight": straight, "again": train(rank, model, opt, algo, 5, STEPS)["params"]}
    out["errors"] = value_errors(lambda case: build(rank, case[0], **case[1]), {
        "lsgd:average=true,groups=2": ("lsgd:average=true,groups=2", {}),
        "lsgd:average=true,prox=0.5": ("lsgd:average=true,prox=0.5", {}),
        "lsgd:average=true": ("lsgd:average=true", {"compressor": "topk:ratio=0.2", "min_numel": 64})})
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


def test_average_pull_matches_the_float64_reference(results: list[dict]) -> None:
    ref, leaders = reference(WORLD, STEPS, 3, 0.3)
    for rank, res in enumerate(results):
        assert torch.allclose(res["avg"]["params"][-1], ref[rank], rtol=0, atol=1e-10), \
            (res["avg"]["params"][-1] - ref[rank]).abs().max()
        assert [res["avg"]["leaders"][t - 1][0] for t in (3, 6, 9)] == leaders
    assert len(set(leaders)) > 1 or leaders[0] != 0, "the test should elect someone other than rank 0"
    for t in (3, 6, 9):  # every rank holds the same parameters right after each election
        for res in results[1:]:
            assert torch.equal(res["avg"]["params"][t - 1], results[0]["avg"]["params"][t - 1])
    assert not torch.equal(results[0]["avg"]["params"][3], results[1]["avg"]["params"][3])  # between: they differ
    model_bytes = sum(p.numel() * 8 for p in make_model().parameters())
    s = results[0]["stats"]
    # per election: one model allreduce and the 8-byte losses' allgather
    assert s["bytes_sent"] == (STEPS // 3) * (model_bytes + 8)
    for res in results:  # the leader's model (all equal after the last election)
        assert torch.equal(res["eval"], results[0]["avg"]["params"][-1])


def test_c_one_copies_the_leader_exactly(results: list[dict]) -> None:
    ref, leaders = reference(WORLD, STEPS, 2, 1.0)
    for rank, res in enumerate(results):
        assert torch.allclose(res["copy"]["params"][-1], ref[rank], rtol=0, atol=1e-10)
    for t in range(2, STEPS + 1, 2):
        for res in results[1:]:
            assert torch.equal(res["copy"]["params"][t - 1], results[0]["copy"]["params"][t - 1])


def test_resume_is_bit_identical(results: list[dict]) -> None:
    for res in results:
        for a, b in zip(res["resume"]["straight"], res["resume"]["again"]):
            assert torch.equal(a, b)


def test_refused_configurations_name_the_field(results: list[dict]) -> None:
    for res in results:
        e = res["errors"]
        assert "'average' is true but 'groups' is 2" in e["lsgd:average=true,groups=2"]
        assert "'average' is true but 'prox' is 0.5" in e["lsgd:average=true,prox=0.5"]
        assert "'average' is true but the compressor is" in e["lsgd:average=true"]


def test_parameter_is_registered() -> None:
    rows = {r["name"]: r for r in algorithms.describe()}
    params = {p["name"]: p for p in rows["lsgd"]["params"]}
    assert params["average"]["default"] is False
    assert algorithms.parse("lsgd:average=true")[1]["average"] is True
