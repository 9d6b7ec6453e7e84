"""Comprex (issue 19) on 2-3 gloo workers: staleness 0 is DDP with the
gradpress hook bit for bit; staleness s applies exactly the averaged update
of step t - s, against float64 references this file computes by the
paper's formulas (top-k by torch.topk, error feedback, clipping, momentum
before compression, the ratio schedule); replicas identical after every
step; a checkpoint between steps resumes bit-identically; a dead or stuck
peer during the background exchange raises a clear error, not a hang."""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import pytest
import torch
from distributed import fault_entry, run_until_rank0_reports, run_workers
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
import gradpress.algorithms as algorithms

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


def train(algo, model, opt, rank: int, steps: range) -> list[torch.Tensor]:  # noqa: ANN001
    out = []
    for step in steps:
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        algo.step()
        out.append(flat(model))
    return out


# ------------------------------------------------------------ the references
def ratio_at(t: int, start: float, target: float, warmup: int) -> float:
    """The exponential schedule by its formula (continuous)."""
    if warmup == 0 or t >= warmup:
        return target
    f = t / warmup
    return start ** (1 - f) * target ** f


def reference(world: int, steps: int, *, staleness: int, mode: str, clip: float, ratio: float | None,
              start: float = 1.0, warmup: int = 0, momentum: float = 0.9) -> list[torch.Tensor]:
    """Comprex by its definition in float64, all workers in one process.

    Every worker computes its gradient at the common parameters x_t on its
    own batch; clips it to ``clip`` (total 2-norm, torch's formula);
    ``mode='comprex'``: m <- momentum m + LR g, p = m + e, sent = top-k(p)
    (k = ceil(ratio_t d), ratio_t of the exponential schedule), e <- p - sent,
    and x <- x - mean(sent) applied at step t + staleness; ``mode='sgd'``:
    x <- x - LR mean(g) applied at step t + staleness. 1-D tensors and tensors
    below MIN_NUMEL travel uncompressed (the engine's rule); ``ratio`` None: no
    compression at all."""
    model = make_model()
    params = list(model.parameters())
    m = [[torch.zeros_like(p) for p in params] for _ in range(world)]
    e = [[torch.zeros_like(p) for p in params] for _ in range(world)]
    queue: list[list[torch.Tensor]] = []
    history = []
    for t in range(steps):
        sent_all = []
        for r in range(world):
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
                m[r][i] = momentum * m[r][i] + LR * g
                if ratio is None or p.dim() < 2 or p.numel() < MIN_NUMEL:
                    sent.append(m[r][i].clone())
                    continue
                q = (m[r][i] + e[r][i]).reshape(-1)
                k = min(q.numel(), max(1, math.ceil(ratio_at(t, start, ratio, warmup) * q.numel())))
                idx = torch.topk(q.abs(), k).indices
                s = torch.zeros_like(q)
                s[idx] = q[idx]
                e[r][i] = (q - s).reshape(p.shape)
                sent.append(s.reshape(p.shape))
            sent_all.append(sent)
        queue.append([sum(s[i] for s in sent_all) / world for i in range(len(params))])
        if len(queue) > staleness:
            update = queue.pop(0)
            with torch.no_grad():
                for p, u in zip(params, update):
                    p -= u
        history.append(flat(model))
    return history


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
    "stale1-comprex-topk": ("comprex:staleness=1,clip=1.0,schedule=exponential,start_ratio=1.0,warmup=4",
                            "topk:ratio=0.1", {"staleness": 1, "mode": "comprex", "clip": 1.0, "ratio": 0.1,
                                               "start": 1.0, "warmup": 4}),
    "stale2-comprex-topk": ("comprex:staleness=2,clip=0", "topk:ratio=0.2",
                            {"staleness": 2, "mode": "comprex", "clip": 0.0, "ratio": 0.2}),
    "stale0-comprex-none": ("comprex:staleness=0,clip=2.0,momentum=0.5", "none",
                            {"staleness": 0, "mode": "comprex", "clip": 2.0, "ratio": None, "momentum": 0.5}),
    "stale1-sgd-none": ("comprex:staleness=1,update=optimizer,clip=0", "none",
                        {"staleness": 1, "mode": "sgd", "clip": 0.0, "ratio": None}),
}
REF_STEPS = 7


def _against_reference(rank: int, world: int) -> dict:
    out = {}
    for name, (spec, compressor, _) in CASES.items():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        algo = algorithms.create(spec, model, opt, compressor=compressor, strategy="collective", min_numel=MIN_NUMEL)
        densities = []
        hist = []
        for step in range(REF_STEPS):
            hist += train(algo, model, opt, rank, range(step, step + 1))
            densities.append(algo.stats["density"])
        out[name] = {"history": hist, "densities": densities, "stats": algo.stats}
        algo.close()
    return out


def _replicas_and_resume(rank: int, world: int) -> dict:
    out: dict = {}
    # replicas: staleness 2 over the compressed ring, BatchNorm, re-broadcast every 3 steps
    model = make_model(bn=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    algo = algorithms.create("comprex:staleness=2,rebroadcast_every=3", model, opt, compressor="topk:ratio=0.1",
                             strategy="ring", min_numel=MIN_NUMEL)
    out["replicas"] = train(algo, model, opt, rank, range(6))  # the last step re-broadcasts
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
        straight = train(a, m, o, rank, range(8))
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
        resumed = train(a, m, o, rank, range(4, 8))
        out[name] = {"straight": straight[4:], "resumed": resumed, "in_flight": in_flight,
                     "stats": (a.stats["bytes_sent"], a.stats["exchanges"])}
        a.close()
    return out


def _two_workers(rank: int, world: int) -> dict:
    return {**_ddp_vs_staleness0(rank, world), **_replicas_and_resume(rank, world)}


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
    ref = reference(3, REF_STEPS, **kw)
    for rank, r in enumerate(ref_results):
        got = r[name]["history"]
        for step, (a, b) in enumerate(zip(got, ref)):
            assert torch.allclose(a, b, rtol=0, atol=1e-12), \
                f"{name}: rank {rank} step {step} off the reference by {(a - b).abs().max():.3g}"
        assert torch.equal(got[-1], ref_results[0][name]["history"][-1]), f"{name}: replicas differ"
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


def test_replicas_identical_after_every_step(state_results: list[dict]) -> None:
    a, b = state_results
    for step, (x, y) in enumerate(zip(a["replicas"], b["replicas"])):
        assert torch.equal(x, y), f"replicas differ after step {step}"
    assert torch.equal(a["buffers_after_rebroadcast"], b["buffers_after_rebroadcast"]), "rebroadcast left buffers apart"
    assert a["replica_stats"]["rebroadcasts"] == 2


@pytest.mark.parametrize("name", ["comprex-ring", "adam-stale1"])
def test_checkpoint_between_steps_resumes_bit_identically(state_results: list[dict], name: str) -> None:
    for r in state_results:
        run = r[name]
        assert run["in_flight"] >= 1, "the checkpoint should have been taken with exchanges in flight"
        for step, (x, y) in enumerate(zip(run["straight"], run["resumed"])):
            assert torch.equal(x, y), f"{name}: resumed step {4 + step} differs by {(x - y).abs().max():.3g}"


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
