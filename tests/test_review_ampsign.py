"""Sign methods under ``GradScaler``, and compressor state on an overflowed step (the DDP hook; 2 gloo workers,
one launch).

1. Scale-free outputs. ``signsgd`` and ``signum`` decode to +-1 whatever the scale (``scale_degree = 0``), so
   with a loss scaler their average went to the optimizer as +-1 and ``unscale_`` made it +-1/scale: steps
   2^16 times too small at fp16's first scale. The hook now multiplies a degree-0 average by the scale of its
   step. Here the parameters of a run under ``torch.amp.GradScaler("cpu")`` (x2 growth twice, x0.5 after rank
   1's Inf at step 4) equal, bit for bit, those of the run without loss scaling and the float64 reference
   computed here by the definition (majority vote of the ranks' signs, sign(0) = +1 locally, a tie gives 0;
   Signum's momentum m = beta m + (1 - beta) g; the overflowed step leaves everything as it was). With error
   feedback on, a scale-free compressor is refused with a scaler (its residual p - decode mixes units).
2. Compressor state on an overflowed step (``nonfinite='propagate'``, every rank's average NaN, the step skipped):
   DGC's momentum and velocity, Signum's momentum and PowerSGD's warm-start Q, in float64 with rank 1's Inf at
   step 4, give at every other step the average of the float64 reference *without* step 4 (a skipped step
   leaves no trace). Before, the finite rank's DGC and Signum buffers took step 4's gradient in, and PowerSGD's
   Q came out NaN and restarted from a fresh random Q at step 5.

Every gradient is a fixed G (the loss is ``sum(w * G)``, so ``w.grad`` is G times the loss scale, exactly).
"""

from __future__ import annotations

import math

import pytest
import torch
from amp_helpers import HAS_CPU_SCALER, Probe, cpu_scaler, grown_and_backed_off
from distributed import run_workers
from references import dgc_run, powersgd_run, signum_run
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
from gradpress.compress.base import derive_seed

SHAPE = (16, 32)  # 512 entries: compressed (min_numel below)
MIN_NUMEL = 64
STEPS = 8
OVERFLOW = 4  # rank 1's gradient holds an Inf at this step
LR = 2.0 ** -4  # SGD steps of +-LR (or 0 on a tie): exact in float32
INIT_SCALE = 2.0 ** 16  # fp16 AMP's default
BETA = 0.9  # Signum's and DGC's momentum (their defaults)
DGC_RATIO = 0.05
RANK = 2  # PowerSGD's
SIGN_SPECS = ("signsgd", "signum")
STATE_SPECS = (f"dgc:ratio={DGC_RATIO}", "signum", f"powersgd:rank={RANK},start_iter=0")


def _grad(rank: int, step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1000 * step + rank), dtype=torch.float64)
    if rank == 1 and step == OVERFLOW:
        g[3, 5] = math.inf
    return g.to(dtype)


# ------------------------------------------------------------------ the workers
def _sign_run(rank: int, spec: str, scaled: bool) -> dict:
    """SGD(lr=LR) on ``w`` with ``spec``; per step ``w`` (float64) and the scale of its backward. Without a
    scaler the overflowed step is skipped by hand (what the scaler does), with ``nonfinite='skip'`` (the mode for
    that: the compressor's state is put back; ``propagate`` does so only while a scaler is attached)."""
    model = Probe(SHAPE)
    ddp = DDP(model)
    scaler = cpu_scaler(INIT_SCALE) if scaled else None
    hook = gradpress.ddp.register(ddp, spec, min_numel=MIN_NUMEL, scaler=scaler,
                                  nonfinite="propagate" if scaled else "skip")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    params, scales = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = ddp(_grad(rank, step))
        scales.append(scaler.get_scale() if scaler is not None else 1.0)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if not hook.last_step_skipped:
                opt.step()
        params.append(model.w.detach().double().clone())
    hook.close()
    return {"params": params, "scales": scales}


def _refusal() -> str:
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        gradpress.ddp.register(DDP(Probe(SHAPE)), "signsgd", min_numel=MIN_NUMEL, error_feedback=True,
                               scaler=scaler).close()
        return "accepted"
    except ValueError as exc:
        return str(exc)


def _late_refusal() -> dict:
    """``make_hook(spec)`` unbound, a scaler attached, then ``bind``: refused there, and the hook stays unbound
    (it was left bound to the refused engine)."""
    state, _ = gradpress.ddp.make_hook("signsgd", error_feedback=True, min_numel=MIN_NUMEL)
    state.attach_scaler(torch.amp.GradScaler("cpu", init_scale=INIT_SCALE))
    try:
        state.bind(DDP(Probe(SHAPE)))
        return {"message": "accepted", "bound": state.bound}
    except ValueError as exc:
        return {"message": str(exc), "bound": state.bound}


def _state_run(rank: int, spec: str, scaled: bool = True) -> list[torch.Tensor]:
    """float64 averages of ``w.grad`` per step (``nonfinite='propagate'``), no optimizer (G is fixed); with a
    scaler attached at scale 1 (never updated) when ``scaled``: what makes the hook keep the state of an
    overflowed step."""
    model = Probe(SHAPE, dtype=torch.float64)
    ddp = DDP(model)
    scaler = cpu_scaler(1.0, growth_interval=1 << 30) if scaled else None
    hook = gradpress.ddp.register(ddp, spec, min_numel=MIN_NUMEL, scaler=scaler)
    grads = []
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        ddp(_grad(rank, step, torch.float64)).backward()
        grads.append(model.w.grad.detach().clone())
    hook.close()
    return grads


def _workers(rank: int, world: int) -> dict:
    out: dict = {"unscaled": _state_run(rank, STATE_SPECS[0], scaled=False)}
    if HAS_CPU_SCALER:
        out["state"] = {spec: _state_run(rank, spec) for spec in STATE_SPECS}
        out["sign"] = {spec: (_sign_run(rank, spec, True), _sign_run(rank, spec, False)) for spec in SIGN_SPECS}
        out["refusal"] = _refusal()
        out["late_refusal"] = _late_refusal()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_workers, 2)


# -------------------------------------------------------------- float64 references
def _finite(step: int, world: int) -> bool:
    return all(bool(torch.isfinite(_grad(r, step, torch.float64)).all()) for r in range(world))


def _signs(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0).to(torch.float64)


def _sign_reference(spec: str, world: int) -> list[torch.Tensor]:
    """``w`` after each step: w -= LR * sign(sum over ranks of sign(m_r)) (m_r = g_r for signsgd, Signum's
    momentum otherwise); the overflowed step changes nothing."""
    w = torch.zeros(SHAPE, dtype=torch.float64)
    m = [torch.zeros(SHAPE, dtype=torch.float64) for _ in range(world)]
    out = []
    for step in range(STEPS):
        if _finite(step, world):
            gs = [_grad(r, step, torch.float64) for r in range(world)]
            if spec == "signum":
                m = [BETA * m[r] + (1 - BETA) * gs[r] for r in range(world)]
                gs = m
            w = w - LR * torch.sign(sum(_signs(g) for g in gs))
        out.append(w.clone())
    return out


def _grads(step: int) -> list[torch.Tensor]:
    return [_grad(r, step, torch.float64) for r in range(2)]


def _keep(step: int) -> bool:
    return _finite(step, 2)


def _dgc_reference() -> list[torch.Tensor | None]:
    """DGC by the definition (no clipping, no warm-up; references.dgc_run); None at the overflowed step, which
    leaves every buffer as it was."""
    return dgc_run(_grads, STEPS, _keep, DGC_RATIO, BETA)


def _signum_reference() -> list[torch.Tensor | None]:
    """The majority vote of the ranks' momentum signs (the average ``w.grad`` the hook returns)."""
    return signum_run(_grads, STEPS, _keep, BETA)


def _powersgd_reference() -> list[torch.Tensor | None]:
    """Rank-2 PowerSGD with error feedback (its default; references.powersgd_run), the first Q drawn from the
    shared seed of step 0 and key ``w`` (seed 0)."""
    gen = torch.Generator().manual_seed(derive_seed("shared", 0, 0, "w"))
    return powersgd_run(_grads, STEPS, _keep, torch.randn(SHAPE[1], RANK, generator=gen, dtype=torch.float64))


# ---------------------------------------------------------------------- the tests
def test_the_scale_grows_and_backs_off(results: list[dict]) -> None:
    if not HAS_CPU_SCALER:
        pytest.skip("this torch has no torch.amp.GradScaler for CPU")
    want = grown_and_backed_off(INIT_SCALE)
    for res in results:
        assert res["sign"]["signsgd"][0]["scales"] == want


@pytest.mark.parametrize("spec", SIGN_SPECS)
def test_sign_methods_under_a_loss_scaler_step_as_without_one(results: list[dict], spec: str) -> None:
    if not HAS_CPU_SCALER:
        pytest.skip("this torch has no torch.amp.GradScaler for CPU")
    ref = _sign_reference(spec, 2)
    for rank, res in enumerate(results):
        scaled, plain = res["sign"][spec]
        for step in range(STEPS):
            got, want = scaled["params"][step], ref[step]
            assert torch.equal(plain["params"][step], want), f"{spec} rank {rank} step {step}: unscaled run"
            assert torch.equal(got, want), (
                f"{spec} rank {rank} step {step} (scale {scaled['scales'][step]}): parameters differ from the "
                f"float64 reference by {float((got - want).abs().max()):.3g} (its largest step {LR})")


def test_error_feedback_with_a_scale_free_compressor_is_refused_with_a_scaler(results: list[dict]) -> None:
    if not HAS_CPU_SCALER:
        pytest.skip("this torch has no torch.amp.GradScaler for CPU")
    for res in results:
        msg = res["refusal"]
        assert all(word in msg for word in ("scaler", "error_feedback", "signsgd", "scale_degree")), msg


@pytest.mark.skipif(not HAS_CPU_SCALER, reason="torch.amp.GradScaler('cpu') needs torch >= 2.3")
@pytest.mark.parametrize("spec", STATE_SPECS)
def test_an_overflowed_step_leaves_no_trace_in_compressor_state(results: list[dict], spec: str) -> None:
    ref = {STATE_SPECS[0]: _dgc_reference, "signum": _signum_reference, STATE_SPECS[2]: _powersgd_reference}[spec]()
    for rank, res in enumerate(results):
        for step, (got, want) in enumerate(zip(res["state"][spec], ref)):
            if want is None:
                assert not bool(torch.isfinite(got).all()), f"{spec} rank {rank}: the overflow did not reach the average"
                continue
            err = float((got - want).abs().max())
            assert torch.allclose(got, want, rtol=1e-9, atol=1e-12 * float(want.abs().max())), (
                f"{spec} rank {rank} step {step}: differs from the float64 reference without step {OVERFLOW} by "
                f"{err:.3g} (max {float(want.abs().max()):.3g})")


def test_without_a_scaler_an_overflowed_step_takes_no_state_copy(results: list[dict]) -> None:
    """The copy costs more than DGC's encode, so it is taken only while a scaler is attached: without one the
    finite rank's DGC buffers take the NaN step's gradient in (the documented rule), and the step after differs
    from the reference that leaves the step out, while the steps before match it."""
    ref = _dgc_reference()
    got = results[0]["unscaled"]
    for step in range(OVERFLOW):
        assert torch.allclose(got[step], ref[step], rtol=1e-9, atol=1e-12 * float(ref[step].abs().max())), step
    assert not torch.allclose(got[OVERFLOW + 1], ref[OVERFLOW + 1], rtol=1e-6, atol=1e-9)


def test_a_bind_refused_for_a_scale_free_compressor_with_feedback_leaves_the_hook_unbound(
        results: list[dict]) -> None:
    if not HAS_CPU_SCALER:
        pytest.skip("this torch has no torch.amp.GradScaler for CPU")
    for res in results:
        late = res["late_refusal"]
        assert all(word in late["message"] for word in ("scaler", "error_feedback", "signsgd")), late
        assert late["bound"] is False, late
