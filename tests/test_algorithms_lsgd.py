"""Leader SGD on 2 and 4 gloo workers against a float64 reference the test
computes itself (Teng et al. 2019: every tau steps the worker with the lowest
mean training loss since the last election leads, ties to the lowest rank;
x <- (1 - c) x + c x_leader; with prox = P, every local step also moves
x <- x + (P / tau) (x_leader - x) toward the last election's leader, the
paper's per-step pulling term as the authors' code applies it): same leader
on every rank, c = 1 copies the leader exactly, the loss is captured from
backward() or given to step(), compressed leader broadcasts with residuals,
bit-identical resume."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from distributed import checkpoint, restore, run_workers
from references import topk
from test_algorithms import LR, loss_of, make_model

import gradpress.algorithms as algorithms

STEPS = 9


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def reference(world: int, steps: int, tau: int, c: float, groups: int = 1, c_local: float = 0.0,
              c_global: float = 0.0, tau_global: int = 1,
              prox: float = 0.0, last: int = 0,
              record: dict | None = None) -> tuple[list[torch.Tensor], list[tuple[int, list[int]]]]:
    """Final parameters of every worker and the leaders of every election
    (global, then each group's); ``record["losses"]``: every election's
    mean loss per rank."""
    models = [make_model() for _ in range(world)]
    window: list[list[float]] = [[] for _ in range(world)]
    history: list[list[float]] = [[] for _ in range(world)]  # every step's loss (the election window `last`)
    size = world // groups
    leaders = []
    start = flat(make_model())
    x_global = [start] * world  # the per-step pull's targets: the start, then the last elected leaders
    x_local = [start] * world
    for s in range(steps):
        t = s + 1
        for rank, m in enumerate(models):
            m.zero_grad()
            loss = loss_of(m, rank, s)
            loss.backward()
            window[rank].append(float(loss.detach()))
            history[rank].append(float(loss.detach()))
            with torch.no_grad():
                for p in m.parameters():
                    p -= LR * p.grad
            if prox:
                x = flat(m)
                if groups == 1:
                    new = x + prox / tau * (x_global[rank] - x)
                else:
                    new = x + prox / tau_global * (x_global[rank] - x) + prox / tau * (x_local[rank] - x)
                with torch.no_grad():
                    torch.nn.utils.vector_to_parameters(new, m.parameters())
        due_local = groups > 1 and t % tau == 0
        due_global = t % tau == 0 if groups == 1 else t % tau_global == 0
        if not (due_local or due_global):
            continue
        means = [(sum(w) / len(w), r) for r, w in enumerate(window)]
        if last:
            means = [(sum(h[-last:]) / len(h[-last:]), r) for r, h in enumerate(history)]
        window = [[] for _ in range(world)]
        if record is not None:
            record.setdefault("losses", []).append([m for m, _ in means])
        lead = min(means)[1]
        local = [min(means[g * size:(g + 1) * size])[1] for g in range(groups)]
        leaders.append((lead, local))
        before = [flat(m) for m in models]
        for rank in range(world):
            if due_global:
                x_global[rank] = before[lead]
            if due_local:
                x_local[rank] = before[local[rank // size]]
        for rank, m in enumerate(models):
            x = before[rank]
            if groups == 1:
                new = (1 - c) * x + c * before[lead]
            else:
                new = x.clone()
                if due_global:
                    new += c_global * (before[lead] - x)
                if due_local:
                    new += c_local * (before[local[rank // size]] - x)
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(new, m.parameters())
    return [flat(m) for m in models], leaders


def build(rank: int, spec: str, **kw):  # noqa: ANN003, ANN201
    model = make_model()
    if rank:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(float(rank))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    return model, opt, algorithms.create(spec, model, opt, **kw)


def _straight_and_resumed(rank: int, spec: str, split: int) -> tuple[dict, dict, dict]:
    """Train ``spec`` to ``split``, save everything, train on to STEPS
    (straight); then rebuild, load the save and train the same steps again."""
    model, opt, algo = build(rank, spec)
    first = train(rank, model, opt, algo, 0, split)
    saved = checkpoint(algo=algo, model=model, opt=opt)
    straight = train(rank, model, opt, algo, split, STEPS)
    model, opt, algo = build(rank, spec)
    restore(saved, model=model, opt=opt, algo=algo)
    return first, straight, train(rank, model, opt, algo, split, STEPS)


def train(rank: int, model, opt, algo, start: int, stop: int, explicit: bool = False) -> dict:  # noqa: ANN001
    params, leaders = [], []
    for step in range(start, stop):
        opt.zero_grad()
        loss = loss_of(model, rank, step)
        loss.backward()
        algo.step(loss.detach() if explicit else None)
        params.append(flat(model))
        leaders.append((algo.leaders["global"], list(algo.leaders["local"])))
    return {"params": params, "leaders": leaders}


def _worker(rank: int, world: int) -> dict:
    out: dict = {}
    model, opt, algo = build(rank, "lsgd:tau=3,c=0.5")
    out["probe"] = train(rank, model, opt, algo, 0, STEPS)
    out["last_losses"] = [algo.last_losses.clone()]
    out["stats"] = algo.stats
    out["eval"] = flat(algo.eval_model())
    out["own"] = flat(model)
    out["eval_leader"] = algo.leaders["global"]
    model, opt, algo = build(rank, "lsgd:tau=3,c=0.5")
    train(rank, model, opt, algo, 0, 3)
    out["last_losses"].insert(0, algo.last_losses.clone())  # the first election's
    model, opt, algo = build(rank, "lsgd:tau=3,c=0.5")
    out["explicit"] = train(rank, model, opt, algo, 0, STEPS, explicit=True)
    model, opt, algo = build(rank, "lsgd:tau=3,c=0.5,evaluate=average")
    train(rank, model, opt, algo, 0, STEPS - 1)  # between elections: the workers differ
    out["eval_average"] = {"eval": flat(algo.eval_model()), "own": flat(model)}
    train(rank, model, opt, algo, STEPS - 1, STEPS)  # evaluating left training untouched
    out["eval_average"]["after"] = flat(model)
    model, opt, algo = build(rank, "lsgd:tau=2,c=1")
    out["copy"] = train(rank, model, opt, algo, 0, STEPS)
    # the per-step pull, and its targets through a resume in the middle of a period
    first, straight, again = _straight_and_resumed(rank, "lsgd:tau=3,c=0.5,prox=0.6", 4)
    out["prox"] = {"straight": first["params"] + straight["params"], "again": again["params"]}
    # the election over each worker's last 4 steps, through a resume between elections
    first, straight, again = _straight_and_resumed(rank, "lsgd:tau=2,c=0.5,window=4", 5)
    out["window"] = {"params": first["params"] + straight["params"], "leaders": first["leaders"] + straight["leaders"],
                     "again": again["params"]}
    # compressed leader broadcast: residuals, the leader copy agrees on every rank, resume mid-window
    spec, kw = "lsgd:tau=2,c=0.5", {"compressor": "topk:ratio=0.2", "min_numel": 64}
    model, opt, algo = build(rank, spec, **kw)
    first = train(rank, model, opt, algo, 0, 5)["params"]
    saved = checkpoint(algo=algo, model=model, opt=opt)
    straight = train(rank, model, opt, algo, 5, STEPS)["params"]
    out["ref_copy"] = torch.cat([r.reshape(-1) for r in algo.ref])
    model, opt, algo = build(rank, spec, **kw)
    restore(saved, model=model, opt=opt, algo=algo)
    again = train(rank, model, opt, algo, 5, STEPS)["params"]
    out["compressed"] = {"first": first, "straight": straight, "again": again, "saved": saved["algo"],
                         "stats": algo.stats}
    try:
        build(rank, "lsgd:groups=3")
        out["groups_error"] = None
    except ValueError as exc:
        out["groups_error"] = str(exc)
    dist.barrier()
    return out


#: scripted training losses of 4 workers, one election per step: ties, NaN, +-inf
SCRIPTED = [[1.0, 1.0, 1.0, 1.0], [3.0, 2.0, 5.0, 2.0], [math.nan, 4.0, 4.0, math.nan],
            [math.nan] * 4, [math.inf, math.nan, 7.0, math.inf], [-1.0, -1.0, -math.inf, -math.inf],
            [0.5, math.nan, 0.5, 0.25]]


def elected(losses: list[float], ranks: list[int]) -> int:
    """The doc's rule: the lowest loss leads, ties to the lowest rank; a NaN
    loss never leads unless every loss is NaN (then the lowest rank)."""
    numbers = [r for r in ranks if not math.isnan(losses[r])]
    if not numbers:
        return ranks[0]
    best = min(losses[r] for r in numbers)
    return min(r for r in numbers if losses[r] == best)


def _scripted(rank: int, spec: str) -> dict:
    """Elections on the scripted losses (given to ``step``, lr 0); before each
    step every worker holds parameters equal to its rank + 1."""
    model, _, algo = build(rank, spec)
    opt = algo.optimizer
    opt.param_groups[0]["lr"] = 0.0
    leaders, held = [], []
    for losses in SCRIPTED:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(rank + 1.0)
        opt.zero_grad()
        algo.step(torch.tensor(losses[rank], dtype=torch.float64))
        leaders.append((algo.leaders["global"], list(algo.leaders["local"])))
        held.append(flat(model))
    return {"leaders": leaders, "held": held}


def _worker4(rank: int, world: int) -> dict:
    model, opt, algo = build(rank, "lsgd:tau=2,groups=2,c_local=0.5,c_global=0.25,tau_global=4")
    out = train(rank, model, opt, algo, 0, 8)
    model, opt, algo = build(rank, "lsgd:tau=2,groups=2,c_local=0.5,c_global=0.25,tau_global=4,prox=0.5")
    out["prox"] = train(rank, model, opt, algo, 0, 8)
    out["scripted"] = _scripted(rank, "lsgd:tau=1,c=1")
    out["scripted_groups"] = _scripted(rank, "lsgd:tau=1,groups=2,c_local=1,tau_global=1000")
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, 2)


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return run_workers(_worker4, 4)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=0, atol=1e-12)


def test_same_leader_on_every_rank_and_the_reference_pull(results: list[dict]) -> None:
    ref, leaders = reference(2, STEPS, 3, 0.5)
    assert len(leaders) == 3 and len({lead for lead, _ in leaders}) == 2, leaders  # both ranks lead at times
    for rank, res in enumerate(results):
        assert close(res["probe"]["params"][-1], ref[rank]), (res["probe"]["params"][-1] - ref[rank]).abs().max()
        got = [res["probe"]["leaders"][t - 1] for t in (3, 6, 9)]
        assert got == [(lead, local) for lead, local in leaders]
    assert results[0]["probe"]["leaders"] == results[1]["probe"]["leaders"]


def test_election_losses_are_each_ranks_mean_since_the_last_election(results: list[dict]) -> None:
    record: dict = {}
    reference(2, STEPS, 3, 0.5, record=record)
    first, last = (torch.tensor(record["losses"][i], dtype=torch.float64) for i in (0, -1))
    for res in results:
        for got, want in zip(res["last_losses"], (first, last)):
            assert close(got, want), (got, want)


def test_loss_given_to_step_equals_the_loss_captured_from_backward(results: list[dict]) -> None:
    for res in results:
        for a, b in zip(res["probe"]["params"], res["explicit"]["params"]):
            assert torch.equal(a, b)


def test_pull_strength_one_copies_the_leader_exactly(results: list[dict]) -> None:
    for t in range(2, STEPS + 1, 2):
        assert torch.equal(results[0]["copy"]["params"][t - 1], results[1]["copy"]["params"][t - 1]), t
    assert not torch.equal(results[0]["copy"]["params"][0], results[1]["copy"]["params"][0])  # local between


def test_per_step_pull_matches_the_reference_and_resumes_exactly(results: list[dict]) -> None:
    ref, _ = reference(2, STEPS, 3, 0.5, prox=0.6)
    plain, _ = reference(2, STEPS, 3, 0.5)
    for rank, res in enumerate(results):
        got = res["prox"]["straight"][-1]
        assert close(got, ref[rank]), (got - ref[rank]).abs().max()
        assert not close(got, plain[rank])  # the per-step pull changed the trajectory
        for a, b in zip(res["prox"]["straight"][4:], res["prox"]["again"]):
            assert torch.equal(a, b)


def test_election_window_matches_the_reference_and_resumes_exactly(results: list[dict]) -> None:
    ref, leaders = reference(2, STEPS, 2, 0.5, last=4)
    _, since = reference(2, STEPS, 2, 0.5)
    assert [lead for lead, _ in leaders] != [lead for lead, _ in since]  # the window changed some election
    for rank, res in enumerate(results):
        got = res["window"]["params"][-1]
        assert close(got, ref[rank]), (got - ref[rank]).abs().max()
        assert [res["window"]["leaders"][t - 1] for t in (2, 4, 6, 8)] == leaders
        for a, b in zip(res["window"]["params"][5:], res["window"]["again"]):
            assert torch.equal(a, b)


def test_stats_and_evaluation_model(results: list[dict]) -> None:
    s = results[0]["stats"]
    model_bytes = sum(p.numel() * p.element_size() for p in make_model().parameters())
    # 3 elections: one 8-byte loss in the allgather and one dense broadcast of the leader's parameters
    assert s["exchanges"] == 3 and s["bytes_sent"] == 3 * (8 + model_bytes)
    assert s["dense_bytes"] == STEPS * model_bytes
    assert torch.equal(results[0]["eval"], results[1]["eval"])  # every rank evaluates the leader's model
    leader = results[0]["eval_leader"]
    assert torch.equal(results[0]["eval"], results[leader]["own"])


def test_average_evaluation_is_the_mean_of_the_workers(results: list[dict]) -> None:
    ref, _ = reference(2, STEPS - 1, 3, 0.5)
    mean = (ref[0] + ref[1]) / 2
    assert not close(ref[0], ref[1])
    for rank, res in enumerate(results):
        r = res["eval_average"]
        assert close(r["eval"], mean), (r["eval"] - mean).abs().max()
        assert close(r["own"], ref[rank])
        assert torch.equal(r["after"], res["probe"]["params"][-1])  # same trajectory as without evaluating


def test_compressed_leader_broadcast_keeps_residuals_and_resumes_exactly(results: list[dict]) -> None:
    for res in results:
        r = res["compressed"]
        residuals = r["saved"]["exchange"]["feedback"]["residuals"]
        assert residuals and any(v.abs().sum() > 0 for v in residuals.values())
        for a, b in zip(r["straight"], r["again"]):
            assert torch.equal(a, b)
        assert r["stats"]["ratio"] > 1.5
    assert torch.equal(results[0]["ref_copy"], results[1]["ref_copy"])  # the leader copy agrees


def test_groups_must_divide_the_world(results: list[dict]) -> None:
    for res in results:
        assert "parameter 'groups' got 3; allowed: a divisor of the world size 2" in res["groups_error"]


def test_local_and_global_leaders_on_four_workers(four: list[dict]) -> None:
    res = four
    ref, leaders = reference(4, 8, 2, 0.0, groups=2, c_local=0.5, c_global=0.25, tau_global=4)
    for rank in range(4):
        assert close(res[rank]["params"][-1], ref[rank]), (res[rank]["params"][-1] - ref[rank]).abs().max()
        assert [res[rank]["leaders"][t - 1] for t in (2, 4, 6, 8)] == leaders
    ref, leaders = reference(4, 8, 2, 0.0, groups=2, c_local=0.5, c_global=0.25, tau_global=4, prox=0.5)
    for rank in range(4):
        got = res[rank]["prox"]["params"][-1]
        assert close(got, ref[rank]), (got - ref[rank]).abs().max()
        assert [res[rank]["prox"]["leaders"][t - 1] for t in (2, 4, 6, 8)] == leaders


def test_elections_break_ties_to_the_lowest_rank_and_never_elect_a_nan_loss(four: list[dict]) -> None:
    """Scripted losses (ties, NaN, +-inf) on 4 workers: every rank elects the
    global leader and each group's (2 groups of 2) by the doc's rule, and
    with c = 1 every worker then holds the global leader's parameters (its
    rank + 1), with c_local = 1 its group leader's."""
    for key, groups in (("scripted", 1), ("scripted_groups", 2)):
        size = 4 // groups
        for t, losses in enumerate(SCRIPTED):
            want = (elected(losses, list(range(4))),
                    [elected(losses, list(range(g * size, (g + 1) * size))) for g in range(groups)])
            for rank in range(4):
                assert four[rank][key]["leaders"][t] == want, (key, t, losses, four[rank][key]["leaders"][t])
                source = want[0] if groups == 1 else want[1][rank // size]
                held = four[rank][key]["held"][t]
                assert torch.equal(held, torch.full_like(held, source + 1.0)), (key, t, rank)


def local_sgd_step(models: list[torch.nn.Module], step: int, window: list[list[float]]) -> None:
    """One plain SGD step of every worker's model on its own batch, each
    loss appended to that worker's election window."""
    for rank, m in enumerate(models):
        m.zero_grad()
        loss = loss_of(m, rank, step)
        loss.backward()
        window[rank].append(float(loss.detach()))
        with torch.no_grad():
            for p in m.parameters():
                p -= LR * p.grad


def reference_compressed(world: int, steps: int, tau: int, c: float, ratio: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    """LSGD with the leader's parameters sent through a top-k compressor with
    error feedback, by definition, in float64: every rank keeps ``ref``
    (identical everywhere); at an election the leader L hands the engine
    ``n (x_L - ref)`` and every other rank zeros, each plus its own residual
    (a non-leader's old residual still goes out); matrices of >= 64 entries
    send their top-k (the rest stays as the residual), other tensors go plain;
    ``ref`` gains the average, and every worker moves ``x <- (1 - c) x + c ref``.
    Returns the workers' final parameters and ``ref``."""
    models = [make_model() for _ in range(world)]
    shapes = [p.shape for p in models[0].parameters()]
    compressed = [len(s) >= 2 and s.numel() >= 64 for s in shapes]
    ref = [p.detach().clone() for p in models[0].parameters()]
    resid = [[torch.zeros(s, dtype=torch.float64) for s in shapes] for _ in range(world)]
    window: list[list[float]] = [[] for _ in range(world)]
    for s in range(steps):
        local_sgd_step(models, s, window)
        if (s + 1) % tau:
            continue
        lead = min((sum(w) / len(w), r) for r, w in enumerate(window))[1]
        window = [[] for _ in range(world)]
        leader = [p.detach().clone() for p in models[lead].parameters()]
        for i, shape in enumerate(shapes):
            sent = []
            for rank in range(world):
                d = world * (leader[i] - ref[i]) if rank == lead else torch.zeros(shape, dtype=torch.float64)
                if not compressed[i]:
                    sent.append(d)
                    continue
                p = (d + resid[rank][i]).reshape(-1)
                kept = topk(p, ratio)
                resid[rank][i] = (p - kept).view(shape)
                sent.append(kept.view(shape))
            ref[i] = ref[i] + sum(sent) / world
        for m in models:
            with torch.no_grad():
                for p, r in zip(m.parameters(), ref):
                    p.copy_((1 - c) * p + c * r)
    return [flat(m) for m in models], torch.cat([r.reshape(-1) for r in ref])


def test_compressed_leader_broadcast_is_the_definition(results: list[dict]) -> None:
    """The compressed run of ``_worker`` (``lsgd:tau=2,c=0.5``, top-k 20%,
    error feedback) against :func:`reference_compressed`: every worker's
    final parameters (four elections) and the shared leader copy."""
    want, ref = reference_compressed(2, STEPS, 2, 0.5, 0.2)
    plain, _ = reference(2, STEPS, 2, 0.5)
    for rank, res in enumerate(results):
        got = (res["compressed"]["first"] + res["compressed"]["straight"])[-1]
        assert close(got, want[rank]), (got - want[rank]).abs().max()
        assert not close(got, plain[rank])  # compression changed the trajectory
    assert close(results[0]["ref_copy"], ref), (results[0]["ref_copy"] - ref).abs().max()
