"""Post-local SGD, DiLoCo and Streaming DiLoCo on 2 gloo workers, against
float64 references the test computes itself from the papers' definitions
(no gradpress code in the references); replicas after every sync;
compressed outer gradients keep their residuals; bit-identical resume."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from distributed import checkpoint, restore, run_workers, value_errors
from test_algorithms import LR, WORLD, loss_of, make_model

import gradpress.algorithms as algorithms

STEPS = 12


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def make_opt(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=LR)


# ------------------------------------------------------------------ references
class Workers:
    """WORLD float64 replicas of the test model, each with its own optimizer."""

    def __init__(self, kind: str = "sgd") -> None:
        self.models = [make_model() for _ in range(WORLD)]
        self.opts = [make_opt(m, kind) for m in self.models]

    def grads(self, step: int) -> None:
        for rank, m in enumerate(self.models):
            m.zero_grad()
            loss_of(m, rank, step).backward()

    def params(self) -> list[list[torch.Tensor]]:
        """Per parameter, the tensors of every worker."""
        return [list(ps) for ps in zip(*(m.parameters() for m in self.models))]

    def flats(self) -> list[torch.Tensor]:
        return [flat(m) for m in self.models]


def ref_postlocal(steps: int, switch: int, period: int, warmup: int) -> list[torch.Tensor]:
    """Lin et al.: mini-batch (gradient-averaged) Adam for ``switch`` steps,
    then local Adam with parameter averaging, the period growing linearly from
    1 to H over ``warmup`` steps."""
    w = Workers("adam")
    since = 0
    for s in range(steps):
        t = s + 1
        w.grads(s)
        if t <= switch:
            with torch.no_grad():
                for ps in w.params():
                    mean = sum(p.grad.clone() for p in ps) / WORLD
                    for p in ps:
                        p.grad.copy_(mean)
        for o in w.opts:
            o.step()
        if t <= switch:
            continue
        since += 1
        current = period if not warmup else 1 + (period - 1) * min(t - switch, warmup) // warmup
        if since >= current:
            since = 0
            with torch.no_grad():
                for ps in w.params():
                    mean = sum(p.clone() for p in ps) / WORLD
                    for p in ps:
                        p.copy_(mean)
    return w.flats()


def ref_diloco(steps: int, period: int, lr: float, mu: float, nesterov: bool, fragments: list[list[int]] | None = None,
               overlap: int = 0, alpha: float = 0.0) -> list[torch.Tensor]:
    """DiLoCo (Douillard et al. 2023) with plain SGD inside: every H steps
    theta <- theta - lr * (Delta + mu * v) (Nesterov; v <- mu v + Delta,
    v = Delta at the first step) with Delta = mean_i(theta - x_i); workers
    restart from theta. ``fragments``: Streaming DiLoCo (Douillard et al.
    2025): fragment f's Delta is taken at t % H == (f + 1) H // F and applied
    ``overlap`` steps later, the worker's fragment becoming
    alpha * x + (1 - alpha) * theta."""
    w = Workers("sgd")
    theta = [p.detach().clone() for p in w.models[0].parameters()]
    buf: list[torch.Tensor | None] = [None] * len(theta)
    frags = fragments or [list(range(len(theta)))]
    offsets = {((f + 1) * period // len(frags)) % period: f for f in range(len(frags))}
    pending: list[tuple[int, int, list[torch.Tensor]]] = []
    for s in range(steps):
        t = s + 1
        w.grads(s)
        for o in w.opts:
            o.step()
        params = w.params()
        if t % period in offsets:
            f = offsets[t % period]
            deltas = [sum(theta[i] - p.detach() for p in params[i]) / WORLD for i in frags[f]]
            pending.append((t + overlap, f, deltas))
        while pending and pending[0][0] <= t:
            _, f, deltas = pending.pop(0)
            with torch.no_grad():
                for i, d in zip(frags[f], deltas):
                    if mu:
                        buf[i] = d.clone() if buf[i] is None else mu * buf[i] + d
                        step = d + mu * buf[i] if nesterov else buf[i]
                    else:
                        step = d
                    theta[i] = theta[i] - lr * step
                    for p in params[i]:
                        p.copy_(alpha * p + (1 - alpha) * theta[i])
    return w.flats()


def _ref_localsgd_sgd(steps: int, period: int) -> list[torch.Tensor]:
    w = Workers("sgd")
    for s in range(steps):
        w.grads(s)
        for o in w.opts:
            o.step()
        if (s + 1) % period == 0:
            with torch.no_grad():
                for ps in w.params():
                    mean = sum(p.clone() for p in ps) / WORLD
                    for p in ps:
                        p.copy_(mean)
    return w.flats()


# ------------------------------------------------------------------ workers
def build(rank: int, spec: str, kind: str = "sgd", **kw):  # noqa: ANN003, ANN201
    model = make_model()
    if rank == 1:  # other initial weights: the algorithm must start every rank from rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = make_opt(model, kind)
    return model, opt, algorithms.create(spec, model, opt, **kw)


def train(rank: int, model, opt, algo, start: int, stop: int) -> list[torch.Tensor]:  # noqa: ANN001
    out = []
    for step in range(start, stop):
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        algo.step()
        out.append(flat(model))
    return out


def resumed(rank: int, spec: str, cut: int, steps: int, kind: str = "sgd", **kw) -> dict:  # noqa: ANN003
    """Train ``steps`` straight, and ``cut`` steps then through a
    weights_only checkpoint (fresh model, optimizer and algorithm)."""
    model, opt, algo = build(rank, spec, kind, **kw)
    straight = train(rank, model, opt, algo, 0, cut)
    saved = checkpoint(algo=algo, model=model, opt=opt)
    straight += train(rank, model, opt, algo, cut, steps)
    algo.close()  # waits for the exchanges in flight
    stats = algo.stats
    model, opt, algo = build(rank, spec, kind, **kw)
    restore(saved, model=model, opt=opt, algo=algo)  # after building: building takes rank 0's parameters
    again = train(rank, model, opt, algo, cut, steps)
    algo.close()
    return {"straight": straight[cut:], "again": again, "stats": stats, "stats_again": algo.stats,
            "saved": saved["algo"]}


def _worker(rank: int, world: int) -> dict:
    out: dict = {}
    # post-local SGD with Adam: synchronous (gradients averaged) for 5 steps, then local with a warm-up
    model, opt, algo = build(rank, "postlocalsgd:period=4,switch=5,warmup=4,optimizer_state=local", "adam")
    out["postlocal"] = train(rank, model, opt, algo, 0, 5)
    out["postlocal_adam"] = torch.cat([st["exp_avg_sq"].reshape(-1) for st in opt.state_dict()["state"].values()])
    out["postlocal"] += train(rank, model, opt, algo, 5, STEPS)
    out["postlocal_stats"] = algo.stats
    # DiLoCo with outer lr 1, no momentum, is local SGD
    model, opt, algo = build(rank, "diloco:period=4,outer_lr=1,outer_momentum=0,nesterov=false")
    out["diloco_as_local"] = train(rank, model, opt, algo, 0, STEPS)
    # DiLoCo with the paper's outer Nesterov
    model, opt, algo = build(rank, "diloco:period=3,outer_lr=0.7,outer_momentum=0.9")
    out["diloco"] = train(rank, model, opt, algo, 0, STEPS)
    out["diloco_stats"] = algo.stats
    # compressed outer gradient: residuals across syncs, replicas after every sync, resume
    out["diloco_topk"] = resumed(rank, "diloco:period=3", 7, STEPS, compressor="topk:ratio=0.1", min_numel=64)
    residuals = []
    model, opt, algo = build(rank, "diloco:period=3", compressor="topk:ratio=0.1", min_numel=64)
    for k in range(3):
        train(rank, model, opt, algo, 3 * k, 3 * k + 3)
        residuals.append({n: r.clone() for n, r in algo.state_dict()["exchange"]["feedback"]["residuals"].items()})
    out["residuals"] = residuals
    # Streaming DiLoCo: staggered fragments, overlap 1, mixing 0.5; F=1, T=0, A=0 is DiLoCo
    model, opt, algo = build(rank, "streaming-diloco:period=4,fragments=2,overlap=1,alpha=0.5")
    out["streaming"] = train(rank, model, opt, algo, 0, STEPS)
    out["streaming_frags"] = algo.frags
    out["streaming_anchor"] = [torch.cat([a.reshape(-1) for a in algo.anchor])]
    algo.drain()  # step 12's exchange done, not merged (a checkpoint drains so)
    out["streaming_stats"] = algo.stats
    algo.close()
    model, opt, algo = build(rank, "streaming-diloco:period=3,fragments=1,overlap=0,alpha=0")
    out["streaming_as_diloco"] = train(rank, model, opt, algo, 0, STEPS)
    out["streaming_qsgd"] = resumed(rank, "streaming-diloco:period=4,fragments=2,overlap=1", 6, STEPS,
                                    compressor="qsgd:levels=7,bucket=64", min_numel=64)
    out["postlocal_resume"] = resumed(rank, "postlocalsgd:period=3,switch=4,warmup=3,optimizer_state=local", 3, STEPS, "adam",
                                      compressor="topk:ratio=0.2", min_numel=64)
    # configuration errors, on every rank
    out["errors"] = value_errors(lambda spec: build(rank, spec), {s: s for s in (
        "diloco:outer_momentum=0", "streaming-diloco:period=2,fragments=3",
        "streaming-diloco:period=4,overlap=4", "streaming-diloco:fragments=5")})
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=0, atol=1e-10)


def test_postlocal_sgd_is_ddp_then_local_sgd_with_warmup(results: list[dict]) -> None:
    ref = ref_postlocal(STEPS, 5, 4, 4)
    for rank, res in enumerate(results):
        assert close(res["postlocal"][-1], ref[rank]), (res["postlocal"][-1] - ref[rank]).abs().max()
    for t in range(5):  # synchronous phase: bit-identical parameters and Adam state
        assert torch.equal(results[0]["postlocal"][t], results[1]["postlocal"][t])
    assert torch.equal(results[0]["postlocal_adam"], results[1]["postlocal_adam"])
    # warm-up: the period at the s-th local step is 1 + 3 * s // 4: an average after step 6 (s=1: 1),
    # none at 7, 8, 9 (periods 2, 3, 4), then after step 10 (4 local steps)
    for t in (6, 10):
        assert torch.equal(results[0]["postlocal"][t - 1], results[1]["postlocal"][t - 1]), t
    for t in (7, 8, 9, 11):
        assert not torch.equal(results[0]["postlocal"][t - 1], results[1]["postlocal"][t - 1]), t
    s = results[0]["postlocal_stats"]
    assert s["steps"] == STEPS and s["dense_bytes"] == STEPS * sum(p.numel() * 8 for p in make_model().parameters())


def test_diloco_with_unit_outer_lr_and_no_momentum_is_local_sgd(results: list[dict]) -> None:
    ref = _ref_localsgd_sgd(STEPS, 4)
    for rank, res in enumerate(results):
        assert close(res["diloco_as_local"][-1], ref[rank])


def test_diloco_outer_nesterov_matches_reference_and_replicas_agree_after_every_sync(results: list[dict]) -> None:
    ref = ref_diloco(STEPS, 3, 0.7, 0.9, True)
    for rank, res in enumerate(results):
        assert close(res["diloco"][-1], ref[rank]), (res["diloco"][-1] - ref[rank]).abs().max()
    for t in range(3, STEPS + 1, 3):
        assert torch.equal(results[0]["diloco"][t - 1], results[1]["diloco"][t - 1])
    s = results[0]["diloco_stats"]
    assert s["exchanges"] == STEPS // 3 and s["ratio"] == pytest.approx(3.0)


def test_compressed_outer_gradient_keeps_residuals_across_syncs_and_resumes_bit_identically(results) -> None:
    for res in results:
        first, second, third = res["residuals"]
        assert first and all(v.abs().sum() > 0 for v in first.values()), "top-k dropped nothing"
        assert all(not torch.equal(first[k], second[k]) for k in first)  # updated by each sync, kept between
        r = res["diloco_topk"]
        assert any(v.abs().sum() > 0 for v in r["saved"]["exchange"]["feedback"]["residuals"].values())
        for a, b in zip(r["straight"], r["again"]):
            assert torch.equal(a, b)
        assert r["stats"]["bytes_sent"] == r["stats_again"]["bytes_sent"]
        assert r["stats"]["ratio"] > 5
    for t in (9, 12):  # after the syncs following the resume, replicas agree
        assert torch.equal(results[0]["diloco_topk"]["again"][t - 8], results[1]["diloco_topk"]["again"][t - 8])


def test_streaming_diloco_matches_reference_with_staggered_fragments_and_overlap(results: list[dict]) -> None:
    frags = results[0]["streaming_frags"]
    assert frags == [[0], [1, 2, 3]]  # 240 weights alone; 40 + 120 + 3 (largest first into the lightest)
    ref = ref_diloco(STEPS, 4, 0.7, 0.9, True, fragments=frags, overlap=1, alpha=0.5)
    for rank, res in enumerate(results):
        assert close(res["streaming"][-1], ref[rank]), (res["streaming"][-1] - ref[rank]).abs().max()
    assert torch.equal(results[0]["streaming_anchor"][0], results[1]["streaming_anchor"][0])
    for a, b in zip(results[0]["streaming_as_diloco"], results[0]["diloco"]):
        assert torch.equal(a, b)


def test_streaming_stats_count_the_merged_exchanges_only(results: list[dict]) -> None:
    """period 4, 2 fragments, overlap 1, 12 steps: fragment 0 (240 float64
    weights) launches at steps 2, 6, 10, fragment 1 (40 + 120 + 3) at 4, 8,
    12, each merged one step later; the exchange of step 12 has finished
    (drained) but is not merged yet, so ``exchanges`` is 5 and ``bytes_sent``
    the dense bytes of the five merged ones, whatever the exchange thread
    has sent."""
    for res in results:
        s = res["streaming_stats"]
        assert s["exchanges"] == 5, s["exchanges"]
        assert s["bytes_sent"] == 3 * 240 * 8 + 2 * (40 + 120 + 3) * 8, s["bytes_sent"]


def test_streaming_resume_with_an_exchange_in_flight_is_bit_identical(results: list[dict]) -> None:
    for res in results:
        r = res["streaming_qsgd"]
        pending = r["saved"]["extra"]["pending"]
        assert len(pending) == 1 and pending[0]["due"] == 7 and pending[0]["fragment"] == 0
        for a, b in zip(r["straight"], r["again"]):
            assert torch.equal(a, b)
        assert r["stats"]["bytes_sent"] == r["stats_again"]["bytes_sent"]
        p = res["postlocal_resume"]
        for a, b in zip(p["straight"], p["again"]):
            assert torch.equal(a, b)


def test_configuration_errors_name_the_field(results: list[dict]) -> None:
    for res in results:
        e = res["errors"]
        assert "'nesterov' is true but 'outer_momentum' is 0" in e["diloco:outer_momentum=0"]
        assert "'fragments' got 3" in e["streaming-diloco:period=2,fragments=3"]
        assert "'overlap' got 4" in e["streaming-diloco:period=4,overlap=4"]
        assert "4 parameter tensors" in e["streaming-diloco:fragments=5"]


def test_registry_lists_the_new_algorithms() -> None:
    rows = {r["name"]: r for r in algorithms.describe()}
    assert {"diloco", "streaming-diloco", "postlocalsgd", "lsgd"} <= set(rows)
    assert [p["name"] for p in rows["diloco"]["params"]] == [
        "period", "outer_lr", "outer_momentum", "nesterov", "residual_decay", "keep_residual", "evaluate",
        "select", "switch", "switch_exchange", "inner_state"]
    assert rows["diloco"]["params"][1]["default"] == 0.7 and rows["diloco"]["params"][2]["default"] == 0.9
    with pytest.raises(ValueError, match="'outer_momentum' got 1.0"):
        algorithms.parse("diloco:outer_momentum=1")
    with pytest.raises(ValueError, match="'alpha' got 2.0"):
        algorithms.parse("streaming-diloco:alpha=2")
    assert math.isclose(algorithms.parse("diloco:outer_lr=1")[1]["outer_lr"], 1.0)


def _rows(out) -> list[dict]:  # noqa: ANN001
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("spec", ["streaming-diloco:period=4,fragments=2,overlap=1",
                                  "lsgd:tau=3,c=0.5", "scaffold:period=3"])
def test_train_runs_the_algorithm_and_resumes_exactly(tmp_path, spec: str) -> None:  # noqa: ANN001
    """Through ``gradpress train`` on 2 workers: a checkpoint taken mid-period
    (streaming: with the exchange launched at step 8 in flight, merged at 9;
    lsgd: mid-window) resumes to the same losses, metrics and bytes."""
    import json

    from gradpress.cli import main as cli

    common = ["train", "--nproc", "2", "--workload", "digits-mlp", "--hidden", "16", "--samples", "256",
              "--batch-size", "16", "--epochs", "2", "--algorithm", spec, "--compressor", "topk:ratio=0.1",
              "--strategy", "allgather", "--min-numel", "64", "--log-every", "1", "--no-progress"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert cli([*common, "--out", str(full)]) == 0
    s = json.loads((full / "summary.json").read_text())
    assert s["steps"] == 16 and s["compression_ratio"] > 2 and s["algorithm"].startswith(spec.split(":")[0])
    assert cli([*common, "--out", str(part), "--steps", "8"]) == 0
    assert cli([*common, "--out", str(part), "--resume"]) == 0
    assert [r["loss"] for r in _rows(full)] == [r["loss"] for r in _rows(part)]
    assert [r.get("metric") for r in _rows(full)] == [r.get("metric") for r in _rows(part)]
    assert json.loads((part / "summary.json").read_text())["bytes_total"] == s["bytes_total"]
