"""The compressing unit under ``hierarchical`` (4 gloo workers as 2 hosts x 2, one launch, about 15 s).

Under ``hierarchical`` the compressor runs at each host's leader on the host mean ``m_h = S_h / L`` (L = 2
workers per host, H = 2 hosts), and the leaders average what they send. References here, in float64:

* ``threshold:tau=T`` with error feedback at the leaders under ``GradScaler`` (the DDP hook, pipelined and
  not): per host ``p = e_h + m_h`` of the unscaled gradients, send p where |p| > T, ``e_h = p - sent``; the
  average is the mean over hosts; the overflow step (rank 1's Inf) is NaN and leaves every residual as it was.
  So the step's loss scale must reach the leader's encode context (tau in gradient units).
* ``dgc:ratio=1,momentum=0,clip=C`` (everything sent every step: what arrives is the clipped input itself):
  each leader clips ``m_h`` to ``C sqrt(H)``, the paper's local clipping per compressing unit, which bounds
  the mean update at about C (Lin et al. Alg. 1 clips the gradient already divided by N to C / sqrt(N); the
  derivation is in ``gradpress/compress/dgc.py``); under ``GradScaler`` too (clip in gradient units). Flat on
  the 4 workers, every worker clips its gradient to ``C sqrt(4)``.
* ``powersgd:rank=1,start_iter=0`` between the leaders on a rank-1 mean: one power iteration recovers the
  mean exactly (Q's sum over the H leaders divided by H, not by the 4 workers).
* ``Context.unit_workers`` other than an integer >= 1 is refused naming the field.
"""

from __future__ import annotations

import math

import pytest
import torch
from amp_helpers import Probe, check_unscaled_averages, close, cpu_scaler, run_scaler_workers, scaled_steps
from references import error_feedback_run
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
from gradpress.exchange.engine import Synchronizer

WORLD, PER_HOST = 4, 2
HOSTS = WORLD // PER_HOST
SHAPE = (16, 32)  # 512 entries: compressed (min_numel below), and DGC's sample is the whole tensor
MIN_NUMEL = 64
STEPS = 8
OVERFLOW = 4  # rank 1's gradient holds an Inf at this step (host 0's mean then does too)
TAU = 1.0
CLIP = 1.0  # ||m_h|| is about 16, ||g_k|| about 23: clipping is active at every step, flat and hierarchical
INIT_SCALE = 2.0**16
HIER = f"hierarchical:workers_per_host={PER_HOST}"
#: (name, spec, strategy): hook runs under GradScaler; chunk=0 is the unpipelined path, the default pipelines
AMP_RUNS = (
    ("threshold", f"threshold:tau={TAU}", HIER),
    ("threshold_chunk0", f"threshold:tau={TAU}", HIER + ",chunk=0"),
    ("dgc", f"dgc:ratio=1.0,momentum=0.0,clip={CLIP}", HIER),
    ("dgc_chunk0", f"dgc:ratio=1.0,momentum=0.0,clip={CLIP}", HIER + ",chunk=0"),
)
LOW_RANK = (64, 48)


def _grad(rank: int, step: int) -> torch.Tensor:
    g = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1000 * step + rank + 29))
    if rank == 1 and step == OVERFLOW:
        g[3, 5] = math.inf
    return g


def _host_mean(host: int, step: int) -> torch.Tensor:
    """m_h in float64: the mean of the host's L workers' gradients."""
    return sum(_grad(host * PER_HOST + j, step).double() for j in range(PER_HOST)) / PER_HOST


def _clip(x: torch.Tensor, bound: float) -> torch.Tensor:
    """DGC's local clipping by its formula: x * min(1, bound / (||x|| + 1e-6))."""
    return x * min(1.0, bound / (float(x.norm()) + 1e-6))


def _hook_run(rank: int, spec: str, strategy: str) -> dict:
    model = Probe(SHAPE)
    ddp = DDP(model)
    scaler = cpu_scaler(INIT_SCALE)
    hook = gradpress.ddp.register(ddp, spec, strategy=strategy, min_numel=MIN_NUMEL, scaler=scaler,
                                  error_feedback=True if spec.startswith("threshold") else None,
                                  nonfinite="propagate")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    out = scaled_steps(model, ddp, opt, scaler, lambda step: _grad(rank, step), range(STEPS))
    hook.close()
    return out


def _engine_run(rank: int, spec: str, strategy: str, grads, steps: int) -> list[torch.Tensor]:  # noqa: ANN001
    shape = grads(rank, 0).shape
    eng = Synchronizer(spec, params=[("w", shape, torch.float32)], strategy=strategy, min_numel=MIN_NUMEL)
    outs = []
    for step in range(steps):
        t = grads(rank, step)
        eng.sync(["w"], [t], step=step)
        outs.append(t.double().clone())
    return outs


def _finite_grad(rank: int, step: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(1000 * step + rank + 29))


def _low_rank(rank: int, step: int) -> torch.Tensor:
    """(rank + 1) u v^T: every mean of these is rank 1."""
    gen = torch.Generator().manual_seed(step + 5)
    return torch.randn(LOW_RANK[0], 1, generator=gen) @ torch.randn(1, LOW_RANK[1], generator=gen) * (rank + 1.0)


def _workers(rank: int, world: int) -> dict:
    out: dict = {name: _hook_run(rank, spec, strategy) for name, spec, strategy in AMP_RUNS}
    dgc = f"dgc:ratio=1.0,momentum=0.0,clip={CLIP}"
    out["flat_dgc"] = _engine_run(rank, dgc, "allgather", _finite_grad, 2)
    out["hier_dgc"] = _engine_run(rank, dgc, HIER + ",chunk=0", _finite_grad, 2)
    out["powersgd"] = _engine_run(rank, "powersgd:rank=1,start_iter=0", HIER, _low_rank, 2)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_scaler_workers(_workers, WORLD)


def _host_reference(send) -> list[torch.Tensor | None]:  # noqa: ANN001
    """Per step the mean over the hosts' leaders of what each sends for ``p = e_h + m_h`` (error feedback at
    the leader), None at the overflow step."""
    return error_feedback_run(_host_mean, HOSTS, STEPS, send)


@pytest.mark.parametrize("name", ["threshold", "threshold_chunk0"])
def test_threshold_at_the_leaders_in_gradient_units_under_a_loss_scale(results: list[dict], name: str) -> None:
    ref = _host_reference(lambda p: torch.where(p.abs() > TAU, p, torch.zeros_like(p)))
    for step, want in enumerate(ref):  # the reference keeps part of each tensor: the test can tell
        if want is not None:
            assert 0 < int((want != 0).sum()) < want.numel(), step
    for rank, res in enumerate(results):
        assert res[name]["scales"][0] == INIT_SCALE and len(set(res[name]["scales"])) > 1  # grows and backs off
        check_unscaled_averages(res[name], ref, f"{name} rank {rank}", lambda got, want: (
            f"entries sent {int((got != 0).sum())}, by the definition {int((want != 0).sum())}"))


@pytest.mark.parametrize("name", ["dgc", "dgc_chunk0"])
def test_dgc_clips_each_host_mean_per_compressing_unit_under_a_loss_scale(results: list[dict], name: str) -> None:
    bound = CLIP * math.sqrt(HOSTS)  # the mean of the H host means bounded at about CLIP
    ref = [None if step == OVERFLOW else sum(_clip(_host_mean(h, step), bound) for h in range(HOSTS)) / HOSTS
           for step in range(STEPS)]
    for step in range(STEPS):  # clipping is active for every candidate bound: C sqrt(H) is told from C sqrt(N)
        if step != OVERFLOW:
            assert min(float(_host_mean(h, step).norm()) for h in range(HOSTS)) > CLIP * math.sqrt(WORLD)
    for rank, res in enumerate(results):
        check_unscaled_averages(res[name], ref, f"{name} rank {rank}")


def test_dgc_clip_flat_and_hierarchical_without_a_scaler(results: list[dict]) -> None:
    for step in range(2):
        flat = sum(_clip(_finite_grad(r, step).double(), CLIP * math.sqrt(WORLD)) for r in range(WORLD)) / WORLD
        hier = sum(_clip(sum(_finite_grad(h * PER_HOST + j, step).double() for j in range(PER_HOST)) / PER_HOST,
                         CLIP * math.sqrt(HOSTS)) for h in range(HOSTS)) / HOSTS
        for rank, res in enumerate(results):
            for got, want, label in ((res["flat_dgc"][step], flat, "flat"), (res["hier_dgc"][step], hier, "hier")):
                assert close(got, want), (f"{label} rank {rank} step {step}: {float((got - want).abs().max()):.3g} "
                                          f"off (max {float(want.abs().max()):.3g})")


def test_powersgd_between_leaders_averages_over_the_hosts(results: list[dict]) -> None:
    for step in range(2):
        want = sum(_low_rank(r, step).double() for r in range(WORLD)) / WORLD
        for rank, res in enumerate(results):
            got = res["powersgd"][step]
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())), (
                f"rank {rank} step {step}: {float((got - want).abs().max()):.3g} off "
                f"(max {float(want.abs().max()):.3g}); ratio of norms {float(got.norm() / want.norm()):.3g}")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_a_context_unit_workers_that_is_not_an_integer_of_at_least_one_is_refused(bad: object) -> None:
    from gradpress.compress import Context

    with pytest.raises(ValueError, match=r"Context: unit_workers must be an integer >= 1"):
        Context(key="t", unit_workers=bad)
