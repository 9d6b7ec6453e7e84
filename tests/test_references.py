"""Exact float64 references for every strategy, the DDP hook's error
feedback, and the algorithms (gloo, 2 and 3 workers).

Each case runs the exchange engine (``Synchronizer``) on float64 tensors for
a few steps, with ``none`` and with deterministic lossy compressors (``fp16``
summable, ``topk`` non-summable, ``signsgd`` majority vote), and compares
every step's average with a reference this file computes itself from the
methods' definitions (no gradpress code in the references: its own top-k,
fp16 cast, ring schedule, parameter-server roots and residual updates). The
tolerance comes from the dtype: float64 rounding (a few ulps of the
magnitudes summed) or, for fp16 payloads, the fp16 rounding of each partial
sum. "The right scale" is not enough: a sum instead of a mean, a missing
1/N, a residual not added back, a re-compression at the wrong density or a
plain mean instead of a vote all fail.

Error feedback is observed in the results, not only in the stored state:
the references carry the residuals from step to step (a residual that is
stored but not added back changes step 2's average), a gradient that top-k
drops at step t is sent at step t + 1 when the next gradient is zero, and
the telescoping identity holds: over T steps the sum of the averages equals
the mean of the summed gradients minus the final residuals (worker, ring
hop and PS root residuals).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from distributed import worlds_fixture
from references import topk as ref_topk  # the k largest |x| in float64, ties to the lower index

import gradpress
import gradpress.algorithms as algorithms
from gradpress.exchange import Synchronizer

pytestmark = pytest.mark.mutants

STEPS = 3
#: key -> shape; "b" is 1-D (plain allreduce with the NaN flags), "w" and "v" are compressed
SHAPES = {"w": (7, 9), "v": (5, 4), "b": (3,)}
KEYS = list(SHAPES)
MIN_NUMEL = 8
F64 = torch.float64
EPS16 = 2.0**-11  # fp16 unit roundoff
#: float64: a few roundings per step, carried over the steps by the residuals (1000 ulps of 1.0)
TOL64 = 1000 * torch.finfo(F64).eps

#: (strategy, spec, error_feedback or None for the compressor's default)
CASES = [
    ("allreduce", "none", None),
    ("allreduce", "fp16", None),
    ("allreduce", "fp16", True),
    ("allgather", "none", None),
    ("allgather", "topk:ratio=0.2", None),
    ("allgather", "topk:ratio=0.2", False),
    ("allgather", "signsgd", None),
    ("ring", "none", None),
    ("ring", "fp16", True),
    ("ring", "topk:ratio=0.3", None),
    ("ring", "topk:ratio=0.3", False),
    ("ps", "none", None),
    ("ps", "fp16", True),
    ("ps", "topk:ratio=0.2", None),
    ("ps", "topk:ratio=0.2", False),
]


def grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    """Rank- and step-dependent float64 gradients (distinct magnitudes: no top-k ties)."""
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + 5)
    out = {k: torch.randn(s, generator=g, dtype=F64) for k, s in SHAPES.items()}
    if step == 1:
        out["w"] = out["w"] * 0.01  # mostly below what top-k keeps of the residual: feedback shows
    return out


# ------------------------------------------------------------------ workers
def _engine_case(rank: int, world: int, strategy: str, spec: str, ef: bool | None) -> dict:
    engine = Synchronizer(spec, params=[(k, s, F64) for k, s in SHAPES.items()], strategy=strategy,
                          min_numel=MIN_NUMEL, error_feedback=ef, seed=3)
    steps = []
    for step in range(STEPS):
        g = grads(rank, step)
        tensors = [g[k].clone() for k in KEYS]
        engine.sync(KEYS, tensors, step=step)
        steps.append({k: t.clone() for k, t in zip(KEYS, tensors)})
    return {"steps": steps, "residuals": {k: v.clone() for k, v in engine.feedback.residuals.items()},
            "error_feedback": engine.error_feedback, "plan": engine.plan.to_dict()}


class _Grad(torch.nn.Module):
    """``forward(G) = sum(W * G)``: the gradient of W is exactly G."""

    def __init__(self) -> None:
        super().__init__()
        self.W = torch.nn.Parameter(torch.zeros(8, 8, dtype=F64))

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return (self.W * g).sum()


def hook_grads(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    if step == 1:
        return torch.zeros(8, 8, dtype=F64)  # what is sent now is exactly what was dropped before
    return torch.randn(8, 8, generator=g, dtype=F64)


HOOK_STEPS = 4
HOOK_STRATEGIES = ("allgather", "ring", "ps")


def _hook_case(rank: int, world: int, strategy: str) -> dict:
    ddp = torch.nn.parallel.DistributedDataParallel(_Grad())
    hook = gradpress.ddp.register(ddp, "topk:ratio=0.25", strategy=strategy, min_numel=16)
    out = []
    for step in range(HOOK_STEPS):
        ddp.zero_grad()
        ddp(hook_grads(rank, step)).backward()
        out.append(ddp.module.W.grad.clone())
    state = hook.state_dict()
    hook.close()
    return {"grads": out, "residuals": state["feedback"]["residuals"]}


def _worker(rank: int, world: int) -> dict:
    out: dict = {}
    for strategy, spec, ef in CASES:
        out[(strategy, spec, ef)] = _engine_case(rank, world, strategy, spec, ef)
    for strategy in HOOK_STRATEGIES:
        out[("hook", strategy)] = _hook_case(rank, world, strategy)
    if world == 2:
        out["algorithms"] = _algorithms(rank, world)
    dist.barrier()
    return out


world_results = worlds_fixture(_worker)


# --------------------------------------------------------------- references
def ref_fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(F64)


def ref_sign(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0).to(F64)


def codec(spec: str, world: int):  # noqa: ANN201
    """(C, ratio or None): the test's own decode(encode(x))."""
    name = spec.split(":")[0]
    if name == "none":
        return (lambda x: x.clone()), None
    if name == "fp16":
        return ref_fp16, None
    if name == "signsgd":
        return ref_sign, None
    ratio = float(spec.split("ratio=")[1])
    return (lambda x: ref_topk(x, ratio)), ratio


def chunks(numel: int, n: int) -> list[tuple[int, int]]:
    base, extra = divmod(numel, n)
    out, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def fp16_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """Sum fp16 payloads in the given order, rounding to fp16 after every add."""
    acc = parts[0].to(torch.float16)
    for p in parts[1:]:
        acc = acc + p.to(torch.float16)
    return acc.to(F64)


class Reference:
    """One strategy and compressor, float64, all ranks, with every residual."""

    def __init__(self, strategy: str, spec: str, ef: bool, world: int) -> None:
        self.strategy, self.spec, self.ef, self.n = strategy, spec, ef, world
        self.C, self.ratio = codec(spec, world)
        self.summable = spec.split(":")[0] in ("none", "fp16")
        self.worker = [{k: torch.zeros(SHAPES[k], dtype=F64) for k in KEYS} for _ in range(world)]
        self.ring = [{k: torch.zeros(math.prod(SHAPES[k]), dtype=F64) for k in KEYS} for _ in range(world)]
        self.root = {k: torch.zeros(SHAPES[k], dtype=F64) for k in KEYS}
        compressed = [k for k in KEYS if len(SHAPES[k]) > 1]
        self.roots = {k: i % world for i, k in enumerate(compressed)}  # round robin, first appearance

    def step(self, g: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        n = self.n
        out = {"b": sum(g[r]["b"] / n for r in range(n))}
        for k in ("w", "v"):
            p = [g[r][k] + self.worker[r][k] if self.ef else g[r][k] for r in range(n)]
            out[k] = getattr(self, "_" + self.strategy)(k, p)
        return out

    def _residual(self, r: int, k: str, value: torch.Tensor) -> None:
        if self.ef:
            self.worker[r][k] = value

    def _allreduce(self, k: str, p: list[torch.Tensor]) -> torch.Tensor:
        n = self.n
        sent = [self.C(p[r] / n) for r in range(n)]
        for r in range(n):
            self._residual(r, k, (p[r] / n - sent[r]) * n)
        return fp16_sum(sent) if self.spec == "fp16" else sum(sent)

    def _allgather(self, k: str, p: list[torch.Tensor]) -> torch.Tensor:
        sent = [self.C(p[r]) for r in range(self.n)]
        for r in range(self.n):
            self._residual(r, k, p[r] - sent[r])
        total = sum(sent)
        return torch.sign(total) if self.spec == "signsgd" else total / self.n  # majority vote, else the mean

    def _ring(self, k: str, p: list[torch.Tensor]) -> torch.Tensor:
        n = self.n
        flats = [x.reshape(-1) / n for x in p]
        out = torch.zeros_like(flats[0])
        for c, (a, b) in enumerate(chunks(flats[0].numel(), n)):
            if self.summable:
                parts = [self.C(flats[(c + j) % n][a:b]) for j in range(n)]  # own chunk first, then along the ring
                out[a:b] = fp16_sum(parts) if self.spec == "fp16" else sum(parts)
                continue
            acc = None
            for j in range(n):  # chunk c starts at rank c and is re-compressed at every hop
                q = (c + j) % n
                value = flats[q][a:b] if acc is None else acc + flats[q][a:b]
                if self.ef:
                    value = value + self.ring[q][k][a:b]
                acc = ref_topk(value, self.ratio)
                if self.ef:
                    self.ring[q][k][a:b] = value - acc
            out[a:b] = acc
        for r in range(n):
            if self.summable:
                self._residual(r, k, p[r] - torch.cat([self.C(flats[r][a:b]) for a, b in
                                                       chunks(flats[r].numel(), n)]).reshape(p[r].shape) * n)
            else:
                self._residual(r, k, torch.zeros_like(p[r]))  # own values enter exactly: the hop residuals hold the error
        return out.reshape(p[0].shape)

    def _ps(self, k: str, p: list[torch.Tensor]) -> torch.Tensor:
        n = self.n
        if self.summable:
            sent = [self.C(p[r] / n) for r in range(n)]
            for r in range(n):
                self._residual(r, k, (p[r] / n - sent[r]) * n)
            return fp16_sum(sent) if self.spec == "fp16" else sum(sent)
        sent = [self.C(p[r]) for r in range(n)]
        for r in range(n):
            self._residual(r, k, p[r] - sent[r])
        avg = sum(sent) / n
        value = avg + self.root[k] if self.ef else avg
        out = ref_topk(value, min(1.0, self.ratio * n))  # the root keeps up to N k entries of the sum
        if self.ef:
            self.root[k] = value - out
        return out

    def tolerance(self, ref: torch.Tensor, g: list[dict[str, torch.Tensor]], k: str) -> torch.Tensor:
        """Per element: float64 rounding of the magnitudes involved, or fp16
        rounding of every partial sum for fp16 payloads."""
        scale = sum(x[k].abs() for x in g) + ref.abs()
        if self.spec == "fp16" and k != "b":
            return 4 * self.n * EPS16 * scale + 2.0**-14  # fp16's smallest normal as the absolute floor
        return TOL64 * (scale + 1.0)


def run_reference(strategy: str, spec: str, ef: bool, world: int) -> tuple[list[dict], Reference]:
    ref = Reference(strategy, spec, ef, world)
    outs = []
    for step in range(STEPS):
        g = [grads(r, step) for r in range(world)]
        outs.append((ref.step(g), g))
    return outs, ref


# -------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-ef{c[2]}")
def test_strategy_matches_float64_reference(world_results, case) -> None:  # noqa: ANN001
    """Every step's average equals the reference (within the dtype's
    rounding) on every rank, and every rank's residuals equal the
    reference's: worker, ring hop (``ring/``) and PS root (``root/``)."""
    world, res = world_results
    strategy, spec, ef = case
    got0 = res[0][case]
    ef_on = got0["error_feedback"]
    assert ef_on == (ef if ef is not None else spec.startswith("topk"))
    if spec == "signsgd" and world != 3:
        pytest.skip("majority vote is checked on 3 workers, where vote and mean differ")
    outs, ref = run_reference(strategy, spec, ef_on, world)
    for step, (expected, g) in enumerate(outs):
        for k in KEYS:
            tol = ref.tolerance(expected[k], g, k)
            for r in range(world):
                got = res[r][case]["steps"][step][k]
                assert torch.equal(got, res[0][case]["steps"][step][k]), f"{case} step {step} {k}: replicas differ"
            err = (got0["steps"][step][k] - expected[k]).abs()
            assert bool((err <= tol).all()), (case, step, k, float(err.max()), float(expected[k].abs().max()))
    if spec == "signsgd":
        # the vote differs from the mean somewhere, and the result is the vote
        mean = sum(ref_sign(grads(r, 0)["w"]) for r in range(world)) / world
        assert not torch.equal(mean, outs[0][0]["w"])
    for r in range(world):
        stored = res[r][case]["residuals"]
        expect: dict[str, torch.Tensor] = {}
        if ef_on:
            expect.update({k: ref.worker[r][k] for k in ("w", "v")})
            if strategy == "ring" and not ref.summable:
                expect.update({f"ring/{k}": ref.ring[r][k] for k in ("w", "v")})
            if strategy == "ps" and not ref.summable:
                expect.update({f"root/{k}#ps": ref.root[k] for k in ("w", "v") if ref.roots[k] == r})
        assert set(stored) == set(expect), (case, r, sorted(stored), sorted(expect))
        for key, value in expect.items():
            assert torch.allclose(stored[key].reshape(value.shape), value, rtol=0, atol=1e-10), (case, r, key)


@pytest.mark.parametrize("strategy", ["allgather", "ring", "ps"])
def test_feedback_telescopes_over_steps(world_results, strategy: str) -> None:
    """With error feedback, sum_t avg_t = mean_r sum_t g_r,t - (final
    residuals): worker residuals averaged over ranks, ring hop residuals
    summed over ranks (they live on the 1/N-scaled values), the PS root's
    residual as is. Nothing is lost, nothing counted twice."""
    world, res = world_results
    case = (strategy, "topk:ratio=0.3" if strategy == "ring" else "topk:ratio=0.2", None)
    for k in ("w", "v"):
        sent = sum(res[0][case]["steps"][t][k] for t in range(STEPS))
        total = sum(grads(r, t)[k] for r in range(world) for t in range(STEPS)) / world
        lost = torch.zeros_like(total)
        for r in range(world):
            resid = res[r][case]["residuals"]
            lost += resid.get(k, torch.zeros_like(total)).reshape(total.shape) / world
            lost += resid.get(f"ring/{k}", torch.zeros_like(total)).reshape(total.shape)
            lost += resid.get(f"root/{k}#ps", torch.zeros_like(total)).reshape(total.shape)
        assert float(lost.abs().max()) > 1e-3, "nothing was dropped: the identity proves nothing"
        assert torch.allclose(sent, total - lost, rtol=0, atol=1e-10), (case, k, float((sent - total + lost).abs().max()))


@pytest.mark.parametrize("strategy", HOOK_STRATEGIES)
def test_hook_error_feedback_is_observed(world_results, strategy: str) -> None:
    """Through DDP: W.grad after each step equals the float64 reference of
    top-k with error feedback on every rank; at step 1 every gradient is zero,
    so what arrives is exactly what top-k dropped at step 0 (non-zero)."""
    world, res = world_results
    case = ("hook", strategy)
    ref = HookReference(strategy, world)
    for step in range(HOOK_STEPS):
        expected = ref.step([hook_grads(r, step) for r in range(world)])
        for r in range(world):
            got = res[r][case]["grads"][step]
            assert torch.allclose(got, expected, rtol=0, atol=1e-12), (case, step, r, float((got - expected).abs().max()))
    assert float(res[0][case]["grads"][1].abs().max()) > 0.01, "nothing was fed back at step 1"


class HookReference(Reference):
    """The hook's single 8 x 8 tensor ("W") through one strategy, top-k 0.25 with feedback."""

    def __init__(self, strategy: str, world: int) -> None:
        super().__init__(strategy, "topk:ratio=0.25", True, world)
        self.worker = [{"W": torch.zeros(8, 8, dtype=F64)} for _ in range(world)]
        self.ring = [{"W": torch.zeros(64, dtype=F64)} for _ in range(world)]
        self.root = {"W": torch.zeros(8, 8, dtype=F64)}
        self.roots = {"W": 0}

    def step(self, g: list[torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        p = [g[r] + self.worker[r]["W"] for r in range(self.n)]
        return getattr(self, "_" + self.strategy)("W", p)


# --------------------------------------------------------------- algorithms
ALGO_LR = 0.1
ALGO_STEPS = 8
ALGO_RATIO = 0.1
ALGO_SPECS = ("localsgd:period=2", "postlocalsgd:period=2,switch=3,warmup=0",
              "diloco:period=3,outer_lr=0.7,outer_momentum=0.9")


def algo_model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3)).double()


def algo_loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 6, generator=g, dtype=F64)
    return torch.nn.functional.mse_loss(model(x), torch.sin(x[:, :3] * 2.0))


def _algorithms(rank: int, world: int) -> dict:
    out = {}
    for spec in ALGO_SPECS:
        for compressor in ("none", f"topk:ratio={ALGO_RATIO}"):
            model = algo_model()
            if rank == 1:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)
            opt = torch.optim.SGD(model.parameters(), lr=ALGO_LR)
            algo = algorithms.create(spec, model, opt, compressor=compressor, min_numel=64, strategy="allgather")
            params = []
            for step in range(ALGO_STEPS):
                opt.zero_grad()
                algo_loss(model, rank, step).backward()
                algo.step()
                params.append([p.detach().clone() for p in model.parameters()])
            out[(spec, compressor)] = {"params": params,
                                       "residuals": algo.state_dict()["exchange"]["feedback"]["residuals"]}
    return out


class Exchange:
    """What the engine does to one exchange of per-rank tensor lists:
    compressed (2-D, >= 64 elements: top-k with error feedback per key, mean
    of the ranks' decoded packets) or plain (mean)."""

    def __init__(self, compressor: str, world: int) -> None:
        self.topk = compressor != "none"
        self.n = world
        self.resid: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]

    def mean(self, keys: list[str], per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        out = []
        for i, key in enumerate(keys):
            xs = [per_rank[r][i] for r in range(self.n)]
            if not self.topk or xs[0].dim() < 2 or xs[0].numel() < 64:
                out.append(sum(x / self.n for x in xs))
                continue
            sent = []
            for r, x in enumerate(xs):
                p = x + self.resid[r].get(key, torch.zeros_like(x))
                c = ref_topk(p, ALGO_RATIO)
                self.resid[r][key] = p - c
                sent.append(c)
            out.append(sum(sent) / self.n)
        return out


def ref_algorithm(spec: str, compressor: str, world: int) -> tuple[list[list[list[torch.Tensor]]], Exchange]:
    """Local SGD (periodic averaging of the parameter change since the last
    average), post-local SGD (gradient averaging for ``switch`` steps first,
    keys ``grad:<name>``) and DiLoCo (outer Nesterov SGD on the averaged
    theta - x), by their definitions, with the exchange above."""
    name, _, rest = spec.partition(":")
    kv = dict(item.split("=") for item in rest.split(",")) if rest else {}
    period, switch = int(kv.get("period", 8)), int(kv.get("switch", 0)) if name == "postlocalsgd" else 0
    models = [algo_model() for _ in range(world)]
    names = [n for n, _ in models[0].named_parameters()]
    ex = Exchange(compressor, world)
    anchor = [p.detach().clone() for p in models[0].parameters()]
    lr_out, mu = float(kv.get("outer_lr", 0.7)), float(kv.get("outer_momentum", 0.9))
    buf: list[torch.Tensor | None] = [None] * len(anchor)
    history = []
    since = 0
    for step in range(ALGO_STEPS):
        for r, m in enumerate(models):
            m.zero_grad()
            algo_loss(m, r, step).backward()
        with torch.no_grad():
            if step < switch:
                means = ex.mean(["grad:" + n for n in names], [[p.grad for p in m.parameters()] for m in models])
                for m in models:
                    for p, g in zip(m.parameters(), means):
                        p -= ALGO_LR * g
                if step + 1 == switch:
                    anchor = [p.detach().clone() for p in models[0].parameters()]
            else:
                for m in models:
                    for p in m.parameters():
                        p -= ALGO_LR * p.grad
                since += 1
                if name == "diloco" and (step + 1) % period == 0:
                    deltas = ex.mean(names, [[a - p for a, p in zip(anchor, m.parameters())] for m in models])
                    for i, d in enumerate(deltas):
                        buf[i] = d.clone() if buf[i] is None else mu * buf[i] + d
                        anchor[i] = anchor[i] - lr_out * (d + mu * buf[i])
                    for m in models:
                        for p, a in zip(m.parameters(), anchor):
                            p.copy_(a)
                elif name != "diloco" and since >= period:
                    since = 0
                    deltas = ex.mean(names, [[p - a for a, p in zip(anchor, m.parameters())] for m in models])
                    anchor = [a + d for a, d in zip(anchor, deltas)]
                    for m in models:
                        for p, a in zip(m.parameters(), anchor):
                            p.copy_(a)
        history.append([[p.detach().clone() for p in m.parameters()] for m in models])
    return history, ex


@pytest.mark.parametrize("compressor", ["none", f"topk:ratio={ALGO_RATIO}"])
@pytest.mark.parametrize("spec", ALGO_SPECS)
def test_algorithm_matches_float64_reference(world_results, spec: str, compressor: str) -> None:
    """Every rank's parameters after every step equal the reference's, and
    the engine's residuals (keyed by parameter name, ``grad:`` for
    post-local SGD's synchronous phase) equal the reference's: error
    feedback of the algorithms observed in the parameters."""
    world, res = world_results
    if world != 2:
        pytest.skip("algorithms are checked on 2 workers")
    history, ex = ref_algorithm(spec, compressor, world)
    for r in range(world):
        got = res[r]["algorithms"][(spec, compressor)]
        for step in range(ALGO_STEPS):
            for a, b in zip(got["params"][step], history[step][r]):
                assert torch.allclose(a, b, rtol=0, atol=1e-11), (spec, compressor, step, r, float((a - b).abs().max()))
        stored = got["residuals"]
        if compressor == "none":
            assert not stored
            continue
        assert set(stored) == set(ex.resid[r]), (sorted(stored), sorted(ex.resid[r]))
        assert any(float(v.abs().max()) > 0 for v in stored.values())
        for key, value in ex.resid[r].items():
            assert torch.allclose(stored[key], value, rtol=0, atol=1e-11), (spec, key)


@pytest.mark.parametrize("beta, gamma", [(1.0, 1.0), (0.5, 1.0), (2.0, 1.0), (1.0, 0.25), (0.9, 3.0)])
def test_feedback_compensates_with_beta_and_gamma(beta: float, gamma: float) -> None:
    """``p = beta * e + gamma * g`` (Karimireddy et al.'s general form), for
    beta below, at and above 1: the store's one formula, in process."""
    from gradpress.exchange.feedback import Feedback

    fb = Feedback(beta=beta, gamma=gamma)
    g = torch.arange(6, dtype=F64).reshape(2, 3) - 2.5
    e = torch.linspace(-1, 1, 6, dtype=F64).reshape(2, 3)
    assert torch.equal(fb.compensate("k", g), gamma * g)  # no residual yet
    fb.stage("k", e.clone())
    fb.commit()
    p = fb.compensate("k", g)
    assert torch.allclose(p, beta * e + gamma * g, rtol=0, atol=1e-15)
    assert p is not g and torch.equal(g, torch.arange(6, dtype=F64).reshape(2, 3) - 2.5)  # the caller's g untouched
