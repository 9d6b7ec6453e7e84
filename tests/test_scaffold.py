"""SCAFFOLD (Karimireddy et al., ICML 2020) on 3 gloo workers with non-IID
data, against float64 references this test computes by the paper's formulas
(no gradpress code in the references): parameters, the server control
variate c and every worker's c_i after several periods; the first period with
zero control variates is local SGD (K = 1: synchronous SGD); replicas
bit-identical after each synchronization; resume through
``torch.load(weights_only=True)`` bit-identical; bad parameters named."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import checkpoint, restore, run_workers, value_errors
from test_algorithms import make_model, mse_grads_at

import gradpress.algorithms as algorithms

WORLD = 3
LR = 0.1


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-IID on purpose: each rank's inputs and targets are shifted by its rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 6, generator=g, dtype=torch.float64) + rank
    return x, torch.sin(x[:, :3] * 2.0) + 0.5 * rank


def grads_at(params: list[torch.Tensor], rank: int, step: int) -> list[torch.Tensor]:
    """The loss gradient of ``rank``'s batch at ``step``, at ``params`` (float64)."""
    return mse_grads_at(params, *batch(rank, step))


def group_lr(step: int, i: int, schedule: bool) -> float:
    """The lr of parameter ``i`` at ``step``: LR, or with ``schedule`` a decaying lr per step and the
    second layer's group at half of the first's."""
    if not schedule:
        return LR
    return LR * 0.9 ** step * (1.0 if i < 2 else 0.5)


def reference(period: int, steps: int, global_lr: float = 1.0, schedule: bool = False,
              momentum: float = 0.0) -> list[dict]:
    """SCAFFOLD by the paper's formulas, option II, all workers participating;
    one entry per synchronization: x, c and each worker's c_i. With a
    constant lr the denominator is the paper's K * lr; with ``schedule`` (lr
    changing per step and per group) it is the sum of the K steps' lrs.
    ``momentum``: each worker's local steps are heavy-ball SGD on the
    corrected gradient (torch's: b = mu b + g, y -= lr b; b kept across
    periods) and c_i+ is the mean of the period's gradients g (control=gradients)."""
    x = [p.detach().clone() for p in make_model().parameters()]
    c = [torch.zeros_like(t) for t in x]
    ci = [[torch.zeros_like(t) for t in x] for _ in range(WORLD)]
    bufs: list[list[torch.Tensor] | None] = [None] * WORLD
    out, step = [], 0
    while step < steps:
        ys = [[t.clone() for t in x] for _ in range(WORLD)]
        gsum = [[torch.zeros_like(t) for t in x] for _ in range(WORLD)]
        for k in range(period):
            for r in range(WORLD):
                g = grads_at(ys[r], r, step + k)
                gsum[r] = [a + b for a, b in zip(gsum[r], g)]
                corrected = [gi - cr + cc for gi, cr, cc in zip(g, ci[r], c)]
                if momentum:
                    old = bufs[r]
                    bufs[r] = corrected if old is None else [momentum * b + d for b, d in zip(old, corrected)]
                    corrected = bufs[r]
                ys[r] = [y - group_lr(step + k, i, schedule) * d for i, (y, d) in enumerate(zip(ys[r], corrected))]
        denom = [period * LR if not schedule else sum(group_lr(step + k, i, True) for k in range(period))
                 for i in range(len(x))]
        if momentum:
            new_ci = [[gs / period for gs in gsum[r]] for r in range(WORLD)]
        else:
            new_ci = [[cr - cc + (xx - y) / d for cr, cc, xx, y, d in zip(ci[r], c, x, ys[r], denom)]
                      for r in range(WORLD)]
        x = [xx + global_lr * sum(ys[r][i] - xx for r in range(WORLD)) / WORLD for i, xx in enumerate(x)]
        c = [cc + sum(new_ci[r][i] - ci[r][i] for r in range(WORLD)) / WORLD for i, cc in enumerate(c)]
        ci = new_ci
        step += period
        out.append({"x": x, "c": c, "ci": ci})
    return out


def make_opt(model: torch.nn.Module, schedule: bool, momentum: float = 0.0) -> torch.optim.Optimizer:
    if not schedule:
        return torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    first, second = model[0], model[2]
    return torch.optim.SGD([{"params": first.parameters(), "lr": LR}, {"params": second.parameters(), "lr": LR / 2}],
                           lr=LR, momentum=momentum)


def build(rank: int, spec: str, schedule: bool = False, momentum: float = 0.0, **kw):  # noqa: ANN003,ANN201
    model = make_model()
    if rank == 1:  # other initial weights: the algorithm must start every rank from rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = make_opt(model, schedule, momentum)
    return model, opt, algorithms.create(spec, model, opt, **kw)


def train(rank: int, model, opt, algo, start: int, stop: int, schedule: bool = False) -> list[dict]:  # noqa: ANN001
    """Steps ``start..stop-1``; after each synchronization: parameters, c, c_i (copies)."""
    synced = []
    for step in range(start, stop):
        if schedule:  # as a scheduler would: set before the step, per group (the second group at half)
            for j, group in enumerate(opt.param_groups):
                group["lr"] = LR * 0.9 ** step * (1.0 if j == 0 else 0.5)
        opt.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        algo.step()
        if algo.since == 0:
            synced.append({"step": step, "x": [p.detach().clone() for p in model.parameters()],
                           "c": [t.clone() for t in algo.c], "ci": [t.clone() for t in algo.c_local]})
    return synced


def _worker(rank: int, world: int) -> dict:
    out: dict = {}
    for name, spec, schedule, steps, momentum in (
            ("paper", "scaffold:period=3", False, 9, 0.0),
            ("global_lr", "scaffold:period=2,global_lr=1.5", False, 6, 0.0),
            ("schedule", "scaffold:period=3", True, 6, 0.0),
            ("gradients", "scaffold:period=3,control=gradients", False, 9, 0.0),
            ("schedule_gradients", "scaffold:period=3,control=gradients", True, 6, 0.0),
            ("momentum", "scaffold:period=3", False, 9, 0.9),
            ("k1", "scaffold:period=1", False, 2, 0.0)):
        model, opt, algo = build(rank, spec, schedule, momentum)
        out[name] = train(rank, model, opt, algo, 0, steps, schedule)
        out[name + "/stats"] = algo.stats
    model, opt, algo = build(rank, "localsgd:period=3,optimizer_state=local")
    out["localsgd"] = train_plain(rank, model, opt, algo, 9)
    out["localsgd/stats"] = algo.stats
    out["straight"], out["resumed"], algo = straight_and_resumed(rank, "scaffold:period=3")
    out["resumed/stats"] = algo.stats

    def with_optimizer(case: dict) -> None:
        model = make_model()
        algorithms.create("scaffold", model, torch.optim.SGD(model.parameters(), lr=LR, **case))

    out["errors"] = value_errors(with_optimizer, {"maximize": {"maximize": True}, "plain": {}})
    model, opt, algo = build(rank, "scaffold:period=3")
    state = algo.state_dict()
    del state["extra"]["c"]
    try:
        algo.load_state_dict(state)
        out["load"] = None
    except ValueError as exc:
        out["load"] = str(exc)
    dist.barrier()
    return out


def straight_and_resumed(rank: int, spec: str) -> tuple[list[dict], list[dict], algorithms.Algorithm]:
    """``spec`` resumed mid-period, with momentum, a compressor (its residuals)
    and nonfinite=skip (its copies): steps 4-9 straight on, and again from a
    checkpoint taken after step 3 (weights_only) in fresh objects; the
    resumed run's algorithm."""
    kw = {"compressor": "topk:ratio=0.1", "min_numel": 64, "nonfinite": "skip"}
    model, opt, algo = build(rank, spec, momentum=0.9, **kw)
    train(rank, model, opt, algo, 0, 4)
    saved = checkpoint(algo=algo, model=model, opt=opt)
    straight = train(rank, model, opt, algo, 4, 10)
    model, opt, algo = build(rank, spec, momentum=0.9, **kw)
    restore(saved, model=model, opt=opt, algo=algo)
    return straight, train(rank, model, opt, algo, 4, 10), algo


def train_plain(rank: int, model, opt, algo, steps: int) -> list[torch.Tensor]:  # noqa: ANN001
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        algo.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


def close(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert len(a) == len(b), what
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.allclose(u, v, rtol=0, atol=1e-10), f"{what}[{i}]: max diff {(u - v).abs().max().item():.3g}"


@pytest.mark.parametrize("case,period,steps,global_lr,schedule,momentum", [
    ("paper", 3, 9, 1.0, False, 0.0), ("global_lr", 2, 6, 1.5, False, 0.0), ("schedule", 3, 6, 1.0, True, 0.0),
    ("gradients", 3, 9, 1.0, False, 0.0), ("schedule_gradients", 3, 6, 1.0, True, 0.0),
    ("momentum", 3, 9, 1.0, False, 0.9)])
def test_matches_the_papers_formulas_on_non_iid_data(results: list[dict], case: str, period: int, steps: int,
                                                     global_lr: float, schedule: bool, momentum: float) -> None:
    """x, c and every c_i after each of several periods, parameter by
    parameter, against the float64 reference (per-group lrs changing every
    step: the sum of the period's lrs in place of K * lr). ``gradients``:
    control=gradients on plain SGD gives option II's values (the identity
    x - y_i = sum lr (g - c_i + c)), also with per-group lrs changing every
    step (``schedule_gradients``: the lr-weighted mean); ``momentum``: auto
    takes the gradients' mean with momentum SGD."""
    want = reference(period, steps, global_lr, schedule, momentum)
    for rank, res in enumerate(results):
        got = res[case]
        assert [s["step"] for s in got] == [period * (n + 1) - 1 for n in range(len(want))]
        for n, (g, w) in enumerate(zip(got, want)):
            close(g["x"], w["x"], f"{case} rank {rank} sync {n} x")
            close(g["c"], w["c"], f"{case} rank {rank} sync {n} c")
            close(g["ci"], w["ci"][rank], f"{case} rank {rank} sync {n} c_{rank}")
    # non-IID: the control variates differ between workers and are far from zero
    assert max(t.abs().max().item() for t in want[-1]["c"]) > 0.05
    assert max((a - b).abs().max().item() for a, b in zip(want[-1]["ci"][0], want[-1]["ci"][1])) > 0.05


def test_period_one_first_step_is_synchronous_sgd(results: list[dict]) -> None:
    """K = 1, c = c_i = 0: y_i = x - lr g_i(x), so x+ = x - lr mean_i g_i(x)
    (synchronous SGD), c_i+ = (x - y_i) / lr = g_i(x) and c+ = mean_i g_i(x).
    (The second period is no longer SGD: its gradients are corrected by
    c - c_i = mean g(x0) - g_i(x0).)"""
    x0 = [p.detach().clone() for p in make_model().parameters()]
    g = [grads_at(x0, r, 0) for r in range(WORLD)]
    mean = [sum(gr[i] for gr in g) / WORLD for i in range(len(x0))]
    for rank, res in enumerate(results):
        first = res["k1"][0]
        close(first["x"], [x - LR * m for x, m in zip(x0, mean)], f"rank {rank} x after step 1")
        close(first["c"], mean, f"rank {rank} c after step 1")
        close(first["ci"], g[rank], f"rank {rank} c_i after step 1")


def test_first_period_is_local_sgd(results: list[dict]) -> None:
    """With zero control variates the first period's steps are uncorrected:
    SCAFFOLD's first average is local SGD's (global_lr = 1)."""
    for res in results:
        local = train_plain_reference(3)
        close(res["paper"][0]["x"], local, "first period")


def train_plain_reference(period: int) -> list[torch.Tensor]:
    """Local SGD's first period by its definition (float64, one process)."""
    x = [p.detach().clone() for p in make_model().parameters()]
    ys = []
    for r in range(WORLD):
        y = [t.clone() for t in x]
        for k in range(period):
            y = [a - LR * b for a, b in zip(y, grads_at(y, r, k))]
        ys.append(y)
    return [sum(y[i] for y in ys) / WORLD for i in range(len(x))]


def test_replicas_and_c_identical_after_every_sync(results: list[dict]) -> None:
    for case in ("paper", "global_lr", "schedule", "gradients", "momentum", "k1", "straight"):
        for n, s0 in enumerate(results[0][case]):
            for rank, res in enumerate(results[1:], 1):
                s = res[case][n]
                assert all(torch.equal(a, b) for a, b in zip(s0["x"], s["x"])), (case, n, rank)
                assert all(torch.equal(a, b) for a, b in zip(s0["c"], s["c"])), (case, n, rank)


def test_resume_is_bit_identical(results: list[dict]) -> None:
    for res in results:
        assert [s["step"] for s in res["straight"]] == [5, 8]
        for a, b in zip(res["straight"], res["resumed"]):
            for key in ("x", "c", "ci"):
                assert all(torch.equal(u, v) for u, v in zip(a[key], b[key])), key
    assert results[0]["resumed/stats"]["steps"] == 10


def test_sends_twice_local_sgds_bytes(results: list[dict]) -> None:
    """The model change and the control change, each a model's worth: 2x
    local SGD's bytes for the same steps and period (no buffers here)."""
    for res in results:
        ours, theirs = res["paper/stats"], res["localsgd/stats"]
        assert ours["exchanges"] == theirs["exchanges"] == 3
        assert ours["bytes_sent"] == 2 * theirs["bytes_sent"] > 0
        assert ours["dense_bytes"] == theirs["dense_bytes"]


def test_bad_parameters_are_named() -> None:
    cases = {"scaffold:period=0": "parameter 'period' got 0; allowed: integer >= 1",
             "scaffold:global_lr=0": "parameter 'global_lr' got 0.0; allowed: number > 0",
             "scaffold:global_lr=-1": "parameter 'global_lr' got -1.0; allowed: number > 0",
             "scaffold:global_lr=inf": "parameter 'global_lr' got inf; allowed: number > 0",
             "scaffold:warmup=-1": "parameter 'warmup' got -1; allowed: integer >= 0",
             "scaffold:period=2.5": "parameter 'period' got '2.5'",
             "scaffold:lr=1": "unknown parameter 'lr'; allowed parameters: period, global_lr, warmup, control",
             "scaffold:control=mean": "parameter 'control' got 'mean'; allowed: auto, displacement or gradients"}
    for spec, says in cases.items():
        with pytest.raises(ValueError, match="algorithm 'scaffold': " + says.replace(".", r"\.")):
            algorithms.parse(spec)


def test_bad_optimizer_and_state_are_named(results: list[dict]) -> None:
    for res in results:
        assert res["errors"]["plain"] is None
        assert "algorithm 'scaffold': optimizer param_groups[0] has maximize=True" in res["errors"]["maximize"]
        assert "allowed: maximize=False" in res["errors"]["maximize"]
        assert res["load"] is not None and "scaffold state: 'c' missing" in res["load"]


def _faults_and_warmup(rank: int, world: int) -> dict:
    """nonfinite=skip and raise with an Inf gradient on rank 1 in the second
    period; warm-up against postlocalsgd's schedule (switch=0)."""
    out: dict = {}
    for mode in ("skip", "raise"):
        model, opt, algo = build(rank, "scaffold:period=2", momentum=0.9, nonfinite=mode)
        synced: list[dict] = []
        try:
            for step in range(6):
                opt.zero_grad()
                x, y = batch(rank, step)
                torch.nn.functional.mse_loss(model(x), y).backward()
                if rank == 1 and step == 2:
                    next(model.parameters()).grad[0, 0] = float("inf")
                algo.step()
                if algo.since == 0:
                    synced.append({"x": [p.detach().clone() for p in model.parameters()],
                                   "c": [t.clone() for t in algo.c], "ci": [t.clone() for t in algo.c_local]})
            out[mode] = {"synced": synced, "skipped": algo.stats["skipped_steps"],
                         "momentum_finite": all(bool(torch.isfinite(st["momentum_buffer"]).all())
                                                for st in opt.state.values())}
        except Exception as exc:  # noqa: BLE001 - the type and message are what the test checks
            out[mode] = {"raised": f"{type(exc).__name__}: {exc}", "synced": synced}
    for control in ("displacement", "gradients"):  # a constant gradient: the loss is linear in w
        w = torch.nn.Linear(3, 2, bias=False).double()
        opt = torch.optim.SGD(w.parameters(), lr=LR, momentum=0.9)
        algo = algorithms.create(f"scaffold:period=8,control={control}", w, opt)
        for _ in range(8):
            opt.zero_grad()
            (w.weight * (rank + 1.0)).sum().backward()
            algo.step()
        out[control] = algo.c[0].clone()
    for spec in ("scaffold:period=4,warmup=8", "postlocalsgd:period=4,switch=0,warmup=8"):
        model, opt, algo = build(rank, spec)
        steps = []
        for step in range(12):
            opt.zero_grad()
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            algo.step()
            if algo.since == 0:
                steps.append(step)
        out[spec.split(":")[0]] = steps
    return out


@pytest.fixture(scope="module")
def faults() -> list[dict]:
    return run_workers(_faults_and_warmup, 2)


def test_skip_drops_the_period_and_keeps_the_control_variates(faults: list[dict]) -> None:
    """The Inf gradient of rank 1 at step 3 (second period) drops that
    synchronization on both ranks: parameters back at the first period's x,
    c and c_i unchanged, rank 1's momentum restored; the third goes through."""
    for rank, res in enumerate(faults):
        got = res["skip"]
        assert got["skipped"] == 1 and len(got["synced"]) == 3
        first, dropped, third = got["synced"]
        for key in ("x", "c", "ci"):
            assert all(torch.equal(a, b) for a, b in zip(first[key], dropped[key])), (rank, key)
        assert all(torch.isfinite(t).all() for key in ("x", "c", "ci") for t in third[key])
        assert not torch.equal(third["x"][0], first["x"][0])
        assert got["momentum_finite"]
    assert all(torch.equal(a, b) for a, b in zip(faults[0]["skip"]["synced"][2]["c"], faults[1]["skip"]["synced"][2]["c"]))


def test_raise_fails_every_rank_at_that_synchronization(faults: list[dict]) -> None:
    for res in faults:
        assert "FloatingPointError" in res["raise"]["raised"] and len(res["raise"]["synced"]) == 1


def test_warmup_synchronizes_at_postlocalsgds_steps(faults: list[dict]) -> None:
    for res in faults:
        assert res["scaffold"] == res["postlocalsgd"] == [0, 1, 3, 6, 10]  # periods 1, 1, 2, 3, 4: 1 + 3 * min(s, 8) // 8 at the s-th step


def test_option_two_inflates_c_under_momentum_and_gradients_does_not(faults: list[dict]) -> None:
    """A constant gradient g (mean over 2 ranks: 1.5) and momentum 0.9, from
    a zero buffer, K = 8: the displacement is lr g sum_k (1 - mu^k) / (1 - mu),
    so option II's c_i+ is g times that sum over K (3.59); the gradients'
    mean is g (why auto takes it for any optimizer but plain SGD)."""
    mu, k = 0.9, 8
    factor = sum((1 - mu ** j) / (1 - mu) for j in range(1, k + 1)) / k
    assert 3.5 < factor < 3.7
    for res in faults:
        assert torch.allclose(res["displacement"], torch.full((2, 3), 1.5 * factor, dtype=torch.float64),
                              rtol=0, atol=1e-12)
        assert torch.allclose(res["gradients"], torch.full((2, 3), 1.5, dtype=torch.float64), rtol=0, atol=1e-12)


def test_registered_and_described() -> None:
    row = {r["name"]: r for r in algorithms.describe()}["scaffold"]
    assert [p["name"] for p in row["params"]] == ["period", "global_lr", "warmup", "control"]
    assert "control variates" in row["summary"]
