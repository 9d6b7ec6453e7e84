"""The algorithms layer: registry, the shared contract, and local SGD
against a float64 reference the test computes itself (no gradpress code in
the reference)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import checkpoint, restore, run_workers

import gradpress.algorithms as algorithms

WORLD = 2
LR = 0.1
STEPS = 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3)).double()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 6, generator=g, dtype=torch.float64)
    return x, torch.sin(x[:, :3] * 2.0)


def loss_of(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def mse_grads_at(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The gradient of :func:`make_model`'s MSE loss on ``(x, y)`` at the
    parameter values ``params`` (float64; a fresh model, nothing shared)."""
    model = make_model()
    with torch.no_grad():
        for p, v in zip(model.parameters(), params):
            p.copy_(v)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def reference(period: int, steps: int) -> list[torch.Tensor]:
    """Local SGD by its definition, float64, one process: each worker takes
    plain SGD steps on its own batches; every ``period`` steps all workers
    take the mean of their parameters."""
    models = [make_model() for _ in range(WORLD)]
    for step in range(steps):
        for rank, m in enumerate(models):
            m.zero_grad()
            loss_of(m, rank, step).backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= LR * p.grad
        if (step + 1) % period == 0:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in models)):
                    mean = sum(p.clone() for p in ps) / WORLD
                    for p in ps:
                        p.copy_(mean)
    return [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]


def _train(rank: int, spec: str, compressor: str | None, steps: int, **kw) -> dict:  # noqa: ANN003
    model = make_model()
    if rank == 1:  # other initial weights: the algorithm must start every rank from rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    algo = algorithms.create(spec, model, opt, compressor=compressor, **kw)
    history = []
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        algo.step()
        history.append(algo.stats)
    return {"algo": algo, "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "history": history, "model": model, "opt": opt}


def _worker(rank: int, world: int) -> dict:
    out: dict = {}
    for period in (1, 4):
        run = _train(rank, f"localsgd:period={period}", None, STEPS)
        out[("none", period)] = {"params": run["params"], "stats": run["algo"].stats,
                                 "describe": run["algo"].describe()}
    # compressed delta with error feedback; then a resume that must continue exactly
    run = _train(rank, "localsgd:period=2", "topk:ratio=0.1", 4, min_numel=64)
    saved = checkpoint(algo=run["algo"], model=run["model"], opt=run["opt"])
    cont = []
    for step in range(4, 8):
        run["opt"].zero_grad()
        loss_of(run["model"], rank, step).backward()
        run["algo"].step()
        cont.append(torch.cat([p.detach().reshape(-1) for p in run["model"].parameters()]))
    model = make_model()
    restore(saved, model=model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    restore(saved, opt=opt)
    algo = algorithms.create("localsgd:period=2", model, opt, compressor="topk:ratio=0.1", min_numel=64)
    restore(saved, algo=algo)
    resumed = []
    for step in range(4, 8):
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        algo.step()
        resumed.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    out["topk"] = {"cont": cont, "resumed": resumed, "stats": algo.stats,
                   "residuals": {k: v.abs().sum().item() for k, v in saved["algo"]["exchange"]["feedback"]["residuals"].items()}}
    # another configuration on one rank fails on every rank, naming the field
    try:
        algorithms.create(f"localsgd:period={2 + rank}", make_model(), torch.optim.SGD(make_model().parameters(), lr=LR))
        out["mismatch"] = None
    except ValueError as exc:
        out["mismatch"] = str(exc)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


def test_period_one_is_synchronous_sgd(results: list[dict]) -> None:
    """H = 1, no compression: the parameters of synchronous SGD on the
    mean gradient (float64, to rounding)."""
    ref = reference(1, STEPS)
    for rank, res in enumerate(results):
        got = res[("none", 1)]["params"]
        assert torch.allclose(got, ref[rank], rtol=0, atol=1e-12), (got - ref[rank]).abs().max()


def test_period_four_matches_local_sgd_and_replicas_agree(results: list[dict]) -> None:
    ref = reference(4, STEPS)
    for rank, res in enumerate(results):
        assert torch.allclose(res[("none", 4)]["params"], ref[rank], rtol=0, atol=1e-12)
    assert torch.equal(results[0][("none", 4)]["params"], results[1][("none", 4)]["params"])


def test_stats_speak_the_hooks_vocabulary(results: list[dict]) -> None:
    params = list(make_model().parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in params)
    flags = len(params) * params[0].element_size()  # optimizer_state=auto: who holds state, a flag per parameter
    for res in results:
        one, four = res[("none", 1)]["stats"], res[("none", 4)]["stats"]
        for s, period in ((one, 1), (four, 4)):
            assert s["steps"] == STEPS and s["exchanges"] == STEPS // period
            assert s["dense_bytes"] == STEPS * model_bytes  # what DDP would have sent for the same steps
            # dense exchange: the parameters and the flags (one fused plain allreduce per exchange), nothing else
            assert s["bytes_sent"] == (STEPS // period) * (model_bytes + flags)
        assert four["ratio"] == pytest.approx(4.0 * model_bytes / (model_bytes + flags))
        assert res[("none", 4)]["describe"] == {"algorithm": "localsgd:period=4,optimizer_state=auto", "compressor": "none",
                                               "strategy": "allreduce", "error_feedback": False}


def test_compressed_delta_keeps_residuals_and_resumes_exactly(results: list[dict]) -> None:
    for res in results:
        r = res["topk"]
        assert any(v > 0 for v in r["residuals"].values()), "top-k dropped nothing: the test proves nothing"
        for a, b in zip(r["cont"], r["resumed"]):
            assert torch.equal(a, b)
        assert r["stats"]["ratio"] > 2.0, r["stats"]
    for a, b in zip(results[0]["topk"]["cont"][1::2], results[1]["topk"]["cont"][1::2]):
        assert torch.equal(a, b)  # after every synchronization the replicas are bit-identical


def test_configuration_mismatch_fails_on_every_rank(results: list[dict]) -> None:
    for res in results:
        assert res["mismatch"] is not None and "differs between ranks" in res["mismatch"]
        assert "localsgd:period=3" in res["mismatch"] and "localsgd:period=2" in res["mismatch"]


def test_registry_lists_and_validates() -> None:
    assert "localsgd" in algorithms.names()
    row = {r["name"]: r for r in algorithms.describe()}["localsgd"]
    assert row["params"][0]["name"] == "period" and row["params"][0]["default"] == 8
    with pytest.raises(ValueError, match="unknown algorithm 'gossip'.*localsgd"):
        algorithms.parse("gossip")
    with pytest.raises(ValueError, match="algorithm 'localsgd': parameter 'period' got 0"):
        algorithms.parse("localsgd:period=0")
    with pytest.raises(ValueError, match="unknown parameter 'perod'"):
        algorithms.parse("localsgd:perod=2")
    with pytest.raises(ValueError, match="do not compose"):
        algorithms.parse("localsgd>localsgd")


def _through_the_training_adapter(rank: int, world: int) -> dict:
    """The two providers the training loop builds (``gradpress.train``'s
    algorithm adapter): ``ddp`` (DistributedDataParallel + the hook) and
    ``localsgd:period=1``, on the same float64 data."""
    from gradpress.train.algorithm import create

    out = {}
    for spec in ("ddp", "localsgd:period=1"):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        algo = create(spec, model, opt, compressor="none", strategy="collective")
        for step in range(STEPS):
            opt.zero_grad()
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(algo.model(x), y).backward()
            algo.step()
        out[spec] = torch.cat([p.detach().reshape(-1) for p in algo.eval_model().parameters()])
        algo.close()
    return out


def test_training_adapter_localsgd_period_one_equals_ddp_sgd() -> None:
    res = run_workers(_through_the_training_adapter, WORLD)
    for r in res:
        assert torch.allclose(r["ddp"], r["localsgd:period=1"], rtol=0, atol=1e-12), \
            (r["ddp"] - r["localsgd:period=1"]).abs().max()
    assert torch.equal(res[0]["localsgd:period=1"], res[1]["localsgd:period=1"])


def _optimizer_state_and_consensus(rank: int, world: int) -> dict:
    out = {}
    for mode in ("auto", "local"):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        algo = algorithms.create(f"localsgd:period=3,optimizer_state={mode}", model, opt)
        for step in range(5):  # a sync after step 3, then two local steps
            opt.zero_grad()
            loss_of(model, rank, step).backward()
            algo.step()
            if step == 2:
                out[(mode, "momentum")] = torch.cat([s["momentum_buffer"].reshape(-1) for s in opt.state.values()])
        out[(mode, "local")] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out[(mode, "eval")] = torch.cat([p.detach().reshape(-1) for p in algo.eval_model().parameters()])
    return out


def test_optimizer_state_averaged_when_uncompressed_and_consensus_evaluated() -> None:
    res = run_workers(_optimizer_state_and_consensus, WORLD)
    assert torch.equal(res[0][("auto", "momentum")], res[1][("auto", "momentum")])  # averaged at the sync
    assert not torch.equal(res[0][("local", "momentum")], res[1][("local", "momentum")])  # the papers' form
    for mode in ("auto", "local"):
        assert not torch.equal(res[0][(mode, "local")], res[1][(mode, "local")])  # mid-period: replicas differ
        mean = (res[0][(mode, "local")] + res[1][(mode, "local")]) / 2
        for r in res:
            assert torch.allclose(r[(mode, "eval")], mean, rtol=0, atol=1e-12)  # evaluated: their average
