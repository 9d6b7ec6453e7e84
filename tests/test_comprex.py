"""Comprex (issue 19) on 2-3 gloo workers: staleness 0 is DDP with the
gradpress hook bit for bit; staleness s applies exactly the averaged update
of step t - s, against float64 references this file computes by the
paper's formulas (top-k by torch.topk, error feedback, clipping, momentum
before compression, the ratio schedule); replicas identical after every
step; a checkpoint between steps resumes bit-identically; a dead or stuck
peer during the background exchange raises a clear error, not a hang."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable

import pytest
import torch
from distributed import fault_entry, run_until_rank0_reports, run_workers
from references import topk_dense
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
import gradpress.algorithms as algorithms
from gradpress.cli import main as cli

LR = 0.05
MIN_NUMEL = 64


def make_model(bn: bool = False) -> torch.nn.Module:
    torch.manual_seed(3)
    layers = [torch.nn.Linear(6, 24), torch.nn.Tanh(), torch.nn.Linear(24, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)]
    if bn:
        layers.insert(1, torch.nn.BatchNorm1d(24))
    return torch.nn.Sequential(*layers).double()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randn(10, 6, generator=g, dtype=torch.float64) * 2.0
    return x, torch.sin(x[:, :3] * 1.5) * 3.0


def loss_of(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def shared(algo) -> torch.Tensor:  # noqa: ANN001
    """The shared weights x (the model holds the look-ahead's prediction)."""
    return torch.cat([w.detach().reshape(-1).clone() for w in algo.weights()])


def train(algo, model, opt, rank: int, steps: range, record: list | None = None,  # noqa: ANN001
          data_rank: int | None = None) -> list[torch.Tensor]:
    """Run ``steps``; returns the model's parameters after each step (and
    appends the shared weights to ``record``)."""
    out = []
    for step in steps:
        opt.zero_grad()
        loss_of(model, rank if data_rank is None else data_rank, step).backward()
        algo.step()
        out.append(flat(model))
        if record is not None:
            record.append(shared(algo))
    return out


# ------------------------------------------------------------ the references
def ratio_at(t: int, start: float, target: float, warmup: int) -> float:
    """The exponential schedule by its formula (continuous)."""
    if warmup == 0 or t >= warmup:
        return target
    f = t / warmup
    return start ** (1 - f) * target ** f


def reference(world: int, steps: int, *, staleness: int, mode: str, clip: float, ratio: float | None,
              start: float = 1.0, warmup: int = 0, momentum: float = 0.9, wd: float = 0.0,
              lookahead: bool = False) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Comprex by its definition in float64, all workers in one process.

    Every worker computes its gradient at the common parameters x_t on its
    own batch; clips it to ``clip`` (total 2-norm, torch's formula);
    ``mode='comprex'``: m <- momentum m + LR (g + wd x) (x: the shared
    weights, also under the look-ahead), p = m + e, sent = top-k(p)
    (k = ceil(ratio_t d), ratio_t of the exponential schedule), e <- p - sent,
    and x <- x - mean(sent) applied at step t + staleness; ``mode='sgd'``:
    x <- x - LR mean(g) applied at step t + staleness. 1-D tensors and tensors
    below MIN_NUMEL travel uncompressed (the engine's rule); ``ratio`` None: no
    compression at all.

    ``lookahead``: worker r computes its gradient at x minus its own momentum
    buffers m_r as they were when each exchange still in flight was launched
    (SpecTrain's weight prediction), not at x.

    Returns the shared weights x after every step and, per worker, the
    weights its model holds after every step (x, or the prediction)."""
    model = make_model()
    params = list(model.parameters())
    x = [p.detach().clone() for p in params]
    m = [[torch.zeros_like(p) for p in params] for _ in range(world)]
    e = [[torch.zeros_like(p) for p in params] for _ in range(world)]
    queue: list[list[torch.Tensor]] = []
    stand_ins: list[list[list[torch.Tensor]]] = []  # per exchange in flight, per worker: m_r at its launch
    history = []
    held: list[list[torch.Tensor]] = [[] for _ in range(world)]

    def forward_point(r: int) -> list[torch.Tensor]:
        if not lookahead:
            return [xi.clone() for xi in x]
        return [xi - sum((s[r][i] for s in stand_ins), torch.zeros_like(xi)) for i, xi in enumerate(x)]

    for t in range(steps):
        sent_all = []
        for r in range(world):
            with torch.no_grad():
                for p, v in zip(params, forward_point(r)):
                    p.copy_(v)
            model.zero_grad()
            loss_of(model, r, t).backward()
            grads = [p.grad.clone() for p in params]
            if clip > 0:
                total = math.sqrt(sum(float((g * g).sum()) for g in grads))
                coef = min(1.0, clip / (total + 1e-6))
                grads = [g * coef for g in grads]
            if mode == "sgd":
                sent_all.append([LR * g for g in grads])
                continue
            sent = []
            for i, (g, p) in enumerate(zip(grads, params)):
                m[r][i] = momentum * m[r][i] + LR * (g + wd * x[i])
                if ratio is None or p.dim() < 2 or p.numel() < MIN_NUMEL:
                    sent.append(m[r][i].clone())
                    continue
                q = (m[r][i] + e[r][i]).reshape(-1)
                k = min(q.numel(), max(1, math.ceil(ratio_at(t, start, ratio, warmup) * q.numel())))
                s = topk_dense(q, k)
                e[r][i] = (q - s).reshape(p.shape)
                sent.append(s.reshape(p.shape))
            sent_all.append(sent)
        queue.append([sum(s[i] for s in sent_all) / world for i in range(len(params))])
        stand_ins.append([[mi.clone() for mi in m[r]] for r in range(world)])
        if len(queue) > staleness:
            update = queue.pop(0)
            stand_ins.pop(0)
            x = [xi - u for xi, u in zip(x, update)]
        history.append(torch.cat([xi.reshape(-1) for xi in x]))
        for r in range(world):
            held[r].append(torch.cat([v.reshape(-1) for v in forward_point(r)]))
    return history, held


# ------------------------------------------------------------------- workers
def _ddp_vs_staleness0(rank: int, world: int) -> dict:
    """Staleness 0 (update=optimizer, no clipping) against DDP with the hook."""
    out = {}
    for spec, strategy in (("topk:ratio=0.1", "collective"), ("topk:ratio=0.1", "ring"), ("qsgd:levels=4", "collective")):
        model = make_model()
        ddp = DDP(model)
        gradpress.ddp.register(ddp, spec, strategy=strategy, min_numel=MIN_NUMEL, seed=5)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        hook_run = []
        for step in range(6):
            opt.zero_grad()
            loss_of(ddp, rank, step).backward()
            opt.step()
            hook_run.append(flat(model))
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        algo = algorithms.create("comprex:staleness=0,update=optimizer,clip=0", model, opt, compressor=spec,
                                 strategy=strategy, min_numel=MIN_NUMEL, seed=5)
        out[(spec, strategy)] = {"hook": hook_run, "comprex": train(algo, model, opt, rank, range(6))}
        algo.close()
    # a configuration that differs between ranks fails on every rank, naming the field
    try:
        model = make_model()
        algorithms.create(f"comprex:staleness={rank}", model, torch.optim.SGD(model.parameters(), lr=LR))
        out["mismatch"] = None
    except ValueError as exc:
        out["mismatch"] = str(exc)
    try:
        model = make_model()
        algorithms.create("comprex:schedule=linear,warmup=10", model, torch.optim.SGD(model.parameters(), lr=LR),
                          compressor="qsgd")
        out["no_ratio"] = None
    except ValueError as exc:
        out["no_ratio"] = str(exc)
    return out


CASES = {
    # name: (spec, compressor, reference keywords)
    "stale1-comprex-topk": ("comprex:staleness=1,clip=1.0,schedule=exponential,start_ratio=1.0,warmup=4,"
                            "lookahead=off",
                            "topk:ratio=0.1", {"staleness": 1, "mode": "comprex", "clip": 1.0, "ratio": 0.1,
                                               "start": 1.0, "warmup": 4}),
    "stale2-comprex-topk": ("comprex:staleness=2,clip=0,lookahead=off", "topk:ratio=0.2",
                            {"staleness": 2, "mode": "comprex", "clip": 0.0, "ratio": 0.2}),
    "stale1-lookahead-topk": ("comprex:staleness=1,clip=1.0", "topk:ratio=0.1",
                              {"staleness": 1, "mode": "comprex", "clip": 1.0, "ratio": 0.1, "lookahead": True}),
    "stale2-lookahead-topk": ("comprex:staleness=2,clip=0,momentum=0.5", "topk:ratio=0.2",
                              {"staleness": 2, "mode": "comprex", "clip": 0.0, "ratio": 0.2, "momentum": 0.5,
                               "lookahead": True}),
    "stale1-lookahead-wd": ("comprex:staleness=1,clip=1.0", "topk:ratio=0.1",
                            {"staleness": 1, "mode": "comprex", "clip": 1.0, "ratio": 0.1, "lookahead": True,
                             "wd": 0.05}),
    "stale0-comprex-none": ("comprex:staleness=0,clip=2.0,momentum=0.5", "none",
                            {"staleness": 0, "mode": "comprex", "clip": 2.0, "ratio": None, "momentum": 0.5}),
    "stale1-sgd-none": ("comprex:staleness=1,update=optimizer,clip=0", "none",
                        {"staleness": 1, "mode": "sgd", "clip": 0.0, "ratio": None}),
}
REF_STEPS = 7


def _against_reference(rank: int, world: int) -> dict:
    out = {}
    for name, (spec, compressor, kw) in CASES.items():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR, weight_decay=kw.get("wd", 0.0))
        algo = algorithms.create(spec, model, opt, compressor=compressor, strategy="collective", min_numel=MIN_NUMEL)
        densities = []
        hist: list[torch.Tensor] = []
        held = []
        for step in range(REF_STEPS):
            held += train(algo, model, opt, rank, range(step, step + 1), record=hist)
            densities.append(algo.stats["density"])
        algo.close()
        out[name] = {"history": hist, "held": held, "densities": densities, "stats": algo.stats,
                     "after_close": flat(model), "lookahead_on": algo.lookahead_on, "shadow": algo.look is not None}
    return out


def _replicas_and_resume(rank: int, world: int) -> dict:
    out: dict = {}
    # replicas: staleness 2 over the compressed ring, BatchNorm, re-broadcast every 3 steps
    model = make_model(bn=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    algo = algorithms.create("comprex:staleness=2,rebroadcast_every=3", model, opt, compressor="topk:ratio=0.1",
                             strategy="ring", min_numel=MIN_NUMEL)
    out["replicas"] = []
    train(algo, model, opt, rank, range(6), record=out["replicas"])  # the last step re-broadcasts
    evaluated = algo.eval_model()
    out["evaluated"] = torch.cat([p.detach().reshape(-1) for p in evaluated.parameters()])
    out["buffers_after_rebroadcast"] = torch.cat([b.reshape(-1).double() for b in model.buffers()
                                                  if b.is_floating_point()])
    out["replica_stats"] = algo.stats
    algo.close()
    # checkpoint between steps, with exchanges in flight
    for name, spec, opt_name in (("comprex-ring", "comprex:staleness=2,schedule=exponential,warmup=6", "sgd"),
                                 ("adam-stale1", "comprex:staleness=1,update=optimizer", "adam")):
        def build(spec: str = spec, opt_name: str = opt_name) -> tuple:
            m = make_model()
            o = (torch.optim.Adam(m.parameters(), lr=0.01) if opt_name == "adam"
                 else torch.optim.SGD(m.parameters(), lr=LR))
            a = algorithms.create(spec, m, o, compressor="topk:ratio=0.1", strategy="ring", min_numel=MIN_NUMEL)
            return m, o, a
        m, o, a = build()
        straight_x: list[torch.Tensor] = []
        straight = train(a, m, o, rank, range(8), record=straight_x)
        a.close()
        m, o, a = build()
        train(a, m, o, rank, range(4))
        buf = io.BytesIO()
        torch.save({"model": m.state_dict(), "opt": o.state_dict(), "algo": a.state_dict()}, buf)
        in_flight = a.stats["in_flight"]
        a.close()
        m, o, a = build()
        state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        m.load_state_dict(state["model"])
        o.load_state_dict(state["opt"])
        a.load_state_dict(state["algo"])
        resumed_x: list[torch.Tensor] = []
        resumed = train(a, m, o, rank, range(4, 8), record=resumed_x)
        out[name] = {"straight": straight[4:] + straight_x[4:], "resumed": resumed + resumed_x, "in_flight": in_flight,
                     "stats": (a.stats["bytes_sent"], a.stats["exchanges"])}
        a.close()
    return out


def heavy_ball(steps: int, momentum: float = 0.9) -> list[torch.Tensor]:
    """Synchronous heavy ball by its formula in float64 on rank 0's data:
    m <- momentum m + LR g(x), x <- x - m; the iterates x_1 .. x_steps+1."""
    model = make_model()
    params = list(model.parameters())
    m = [torch.zeros_like(p) for p in params]
    out = []
    for t in range(steps + 1):
        model.zero_grad()
        loss_of(model, 0, t).backward()
        with torch.no_grad():
            for i, p in enumerate(params):
                m[i] = momentum * m[i] + LR * p.grad
                p -= m[i]
        out.append(flat(model))
    return out


def _lookahead_is_heavy_ball(rank: int, world: int) -> dict:
    """Every rank on rank 0's data, no compression: the stand-ins are exact."""
    out = {}
    for name, spec in (("on", "comprex:staleness=1,clip=0"), ("off", "comprex:staleness=1,clip=0,lookahead=off")):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        algo = algorithms.create(spec, model, opt, compressor="none", strategy="collective", min_numel=MIN_NUMEL)
        shared_x: list[torch.Tensor] = []
        out[name] = {"held": train(algo, model, opt, rank, range(6), record=shared_x, data_rank=0),
                     "shared": shared_x}
        algo.close()
    try:
        model = make_model()
        algorithms.create("comprex:lookahead=on,update=optimizer", model, torch.optim.SGD(model.parameters(), lr=LR))
        out["lookahead_optimizer"] = None
    except ValueError as exc:
        out["lookahead_optimizer"] = str(exc)
    return out


def _ahead_vs_serial(rank: int, world: int) -> dict:
    """Compression ahead (engine.prepare in the training thread) against the
    same run with every exchange compressed on the background thread."""
    out = {}
    for spec in ("topk:ratio=0.1", "qsgd:levels=4"):
        for mode in ("ahead", "serial"):
            model = make_model()
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            algo = algorithms.create("comprex:staleness=1", model, opt, compressor=spec, strategy="allgather",
                                     min_numel=MIN_NUMEL, seed=5)
            real, calls = algo.engine.prepare, []

            def counting(*args, real=real, calls=calls, **kw):  # noqa: ANN002, ANN003, ANN202
                encoded = real(*args, **kw)
                calls.append(encoded is not None)
                return encoded

            algo.engine.prepare = counting if mode == "ahead" else (lambda *args, **kw: None)
            shared_x: list[torch.Tensor] = []
            train(algo, model, opt, rank, range(6), record=shared_x)
            algo.close()
            out[(spec, mode)] = {"shared": shared_x, "calls": calls, "bytes": algo.stats["bytes_sent"],
                                 "residuals": {k: v.clone() for k, v in algo.engine.feedback.residuals.items()}}
    return out


def _two_workers(rank: int, world: int) -> dict:
    return {**_ddp_vs_staleness0(rank, world), **_replicas_and_resume(rank, world),
            "heavy_ball": _lookahead_is_heavy_ball(rank, world), "ahead": _ahead_vs_serial(rank, world)}


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "qsgd:levels=4"])
def test_compression_ahead_is_bit_identical_to_compression_on_the_thread(two_results: list[dict], spec: str) -> None:
    for r in two_results:
        ahead, serial = r["ahead"][(spec, "ahead")], r["ahead"][(spec, "serial")]
        assert ahead["calls"] and all(ahead["calls"]), "allgather exchanges should be encoded ahead"
        for step, (a, b) in enumerate(zip(ahead["shared"], serial["shared"])):
            assert torch.equal(a, b), f"{spec}: step {step} differs by {(a - b).abs().max():.3g}"
        assert ahead["residuals"].keys() == serial["residuals"].keys()
        assert bool(ahead["residuals"]) == spec.startswith("topk")  # error feedback: auto is off for QSGD
        assert all(torch.equal(ahead["residuals"][k], serial["residuals"][k]) for k in ahead["residuals"])
        assert ahead["bytes"] == serial["bytes"]


@pytest.fixture(scope="module")
def two_results() -> list[dict]:
    """One 2-worker run for everything that needs two (a spawn costs seconds)."""
    return run_workers(_two_workers, 2)


@pytest.fixture(scope="module")
def sync_results(two_results: list[dict]) -> list[dict]:
    return two_results


@pytest.fixture(scope="module")
def ref_results() -> list[dict]:
    return run_workers(_against_reference, 3)


@pytest.fixture(scope="module")
def state_results(two_results: list[dict]) -> list[dict]:
    return two_results


# --------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", [("topk:ratio=0.1", "collective"), ("topk:ratio=0.1", "ring"),
                                  ("qsgd:levels=4", "collective")])
def test_staleness_zero_is_the_synchronous_hook_bit_for_bit(sync_results: list[dict], case: tuple) -> None:
    for r in sync_results:
        run = r[case]
        for step, (a, b) in enumerate(zip(run["hook"], run["comprex"])):
            assert torch.equal(a, b), f"{case}: step {step} differs from DDP + hook by {(a - b).abs().max():.3g}"
    assert not torch.equal(sync_results[0][case]["comprex"][0], sync_results[0][case]["comprex"][-1])


def test_configuration_errors_name_the_field(sync_results: list[dict]) -> None:
    for r in sync_results:
        assert r["mismatch"] is not None and "staleness" in r["mismatch"], r["mismatch"]
        assert r["no_ratio"] is not None and "schedule" in r["no_ratio"] and "ratio" in r["no_ratio"], r["no_ratio"]


@pytest.mark.parametrize("name", list(CASES))
def test_staleness_applies_the_averaged_update_of_step_t_minus_s(ref_results: list[dict], name: str) -> None:
    kw = CASES[name][2]
    ref, ref_held = reference(3, REF_STEPS, **kw)
    for rank, r in enumerate(ref_results):
        got = r[name]["history"]
        for step, (a, b) in enumerate(zip(got, ref)):
            assert torch.allclose(a, b, rtol=0, atol=1e-12), \
                f"{name}: rank {rank} step {step} off the reference by {(a - b).abs().max():.3g}"
        for step, (a, b) in enumerate(zip(r[name]["held"], ref_held[rank])):
            assert torch.allclose(a, b, rtol=0, atol=1e-12), \
                f"{name}: rank {rank}'s model after step {step} off the reference by {(a - b).abs().max():.3g}"
        assert torch.equal(got[-1], ref_results[0][name]["history"][-1]), f"{name}: replicas differ"
        assert torch.equal(r[name]["after_close"], got[-1]), f"{name}: close() did not leave the shared weights"
    # on by default with the Comprex update and staleness >= 1 only (at staleness 0 it would hold a useless copy)
    assert r[name]["lookahead_on"] is r[name]["shadow"] is bool(kw.get("lookahead")), name
    if kw.get("lookahead"):  # the prediction is rank-local: the models differ while the shared weights do not
        assert not torch.equal(ref_results[0][name]["held"][-1], ref_results[1][name]["held"][-1])
    s = kw["staleness"]
    first = ref_results[0][name]["history"]
    initial = flat(make_model())
    for step in range(s):  # nothing applied during the first s steps
        assert torch.equal(first[step], initial), f"{name}: an update was applied at step {step} < staleness {s}"


def test_schedule_moves_the_density_every_rank_alike(ref_results: list[dict]) -> None:
    dens = [r["stale1-comprex-topk"]["densities"] for r in ref_results]
    want = [ratio_at(t, 1.0, 0.1, 4) for t in range(REF_STEPS)]
    for d in dens:
        assert d == pytest.approx(want, rel=1e-12)
    stats = ref_results[0]["stale1-comprex-topk"]["stats"]
    assert stats["steps"] == REF_STEPS and stats["exchanges"] == REF_STEPS - 1 and stats["in_flight"] == 1
    for key in ("overlap", "hidden_s", "exposed_s", "exchange_s"):
        assert key in stats


def test_lookahead_without_compression_evaluates_at_the_heavy_ball_iterates(two_results: list[dict]) -> None:
    hb = heavy_ball(6)
    for r in two_results:
        run = r["heavy_ball"]
        for t, (held, want) in enumerate(zip(run["on"]["held"], hb)):  # after step t the model holds x_{t+1}
            assert torch.allclose(held, want, rtol=0, atol=1e-12), \
                f"step {t}: the look-ahead's prediction is {(held - want).abs().max():.3g} off heavy ball"
        for t, (x, want) in enumerate(zip(run["on"]["shared"][1:], hb)):  # the shared weights lag one step
            assert torch.allclose(x, want, rtol=0, atol=1e-12), f"step {t + 1}: shared weights off heavy ball"
        # without the look-ahead the stale gradient is taken elsewhere: the same check fails
        assert not torch.allclose(run["off"]["held"][-1], hb[5], rtol=0, atol=1e-6)
        assert "lookahead" in r["heavy_ball"]["lookahead_optimizer"] and "update" in r["heavy_ball"]["lookahead_optimizer"]


def test_replicas_identical_after_every_step(state_results: list[dict]) -> None:
    a, b = state_results
    for step, (x, y) in enumerate(zip(a["replicas"], b["replicas"])):
        assert torch.equal(x, y), f"replicas differ after step {step}"
    assert torch.equal(a["evaluated"], b["evaluated"]), "the evaluated models differ"
    assert torch.equal(a["evaluated"], a["replicas"][-1]), "eval_model() does not hold the shared weights"
    assert torch.equal(a["buffers_after_rebroadcast"], b["buffers_after_rebroadcast"]), "rebroadcast left buffers apart"
    assert a["replica_stats"]["rebroadcasts"] == 2


@pytest.mark.parametrize("name", ["comprex-ring", "adam-stale1"])
def test_checkpoint_between_steps_resumes_bit_identically(state_results: list[dict], name: str) -> None:
    for r in state_results:
        run = r[name]
        assert run["in_flight"] >= 1, "the checkpoint should have been taken with exchanges in flight"
        for step, (x, y) in enumerate(zip(run["straight"], run["resumed"])):
            assert torch.equal(x, y), f"{name}: resumed step {4 + step} differs by {(x - y).abs().max():.3g}"


def test_train_resume_with_lookahead_is_exact(tmp_path) -> None:  # noqa: ANN001
    """``gradpress train`` with the look-ahead: two epochs straight == one
    epoch, stop, resume: bit-identical losses and accuracy. The checkpoint
    holds each rank's own prediction (the models differ) and the shared
    weights (identical)."""
    common = ["train", "--nproc", "2", "--workload", "mnist1d-cnn", "--hidden", "8", "--samples", "256",
              "--batch-size", "16", "--epochs", "2", "--algorithm", "comprex:staleness=1",
              "--compressor", "topk:ratio=0.05", "--strategy", "allgather", "--min-numel", "64",
              "--log-every", "1", "--no-progress"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert cli([*common, "--out", str(full)]) == 0
    assert cli([*common, "--out", str(part), "--steps", "8"]) == 0
    ckpt = torch.load(part / "checkpoint.pt", weights_only=True)
    extra = [ckpt["ranks"][r]["algorithm"]["extra"] for r in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(extra[0]["shared_weights"], extra[1]["shared_weights"]))
    models = [ckpt["ranks"][r]["model"] for r in range(2)]
    assert any(not torch.equal(models[0][k], models[1][k]) for k in models[0])
    assert len(extra[0]["pending"]) == 1 and "proxy" in extra[0]["pending"][0]
    assert cli([*common, "--out", str(part), "--resume"]) == 0
    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (full, part)]
    assert [r["loss"] for r in rows[0]] == [r["loss"] for r in rows[1]]
    assert [r.get("metric") for r in rows[0]] == [r.get("metric") for r in rows[1]]


# -------------------------------------------------------------------- faults
TIMEOUT = 5.0
FAULT_STEP = 3


def _fault_setup(rank: int) -> Callable[[int], None]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    algo = algorithms.create("comprex:staleness=1", model, opt, strategy="ring", min_numel=MIN_NUMEL,
                             timeout=TIMEOUT)

    def step(i: int) -> None:
        opt.zero_grad()
        loss_of(model, rank, i).backward()
        algo.step()

    return step


@pytest.mark.parametrize("how", ["exit", "stuck"])
def test_dead_or_stuck_peer_during_background_exchange_raises(how: str) -> None:
    result, waited = run_until_rank0_reports(fault_entry, 2, (how, _fault_setup, (), FAULT_STEP, FAULT_STEP + 3), 60.0)
    assert result is not None, f"rank 0 neither finished nor raised within {waited:.0f} s (peer {how})"
    assert result["error"] is not None, f"rank 0 finished {result.get('steps')} steps without its peer"
    assert "BackgroundError" in result["error"] and "background exchange of step" in result["error"], result["error"]
    assert "peer" in result["error"], result["error"]
    assert result["elapsed"] < TIMEOUT + 25, f"rank 0 raised only after {result['elapsed']:.1f} s"
