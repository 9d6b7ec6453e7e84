"""Review of 1-bit Adam and 0/1 Adam edge cases (session 14, reviewer C).

A freeze at step 0 leaves no exact-Adam step to estimate the variance from:
1-bit Adam then masks every momentum (``v == 0`` everywhere) and no
parameter ever moves; 0/1 Adam enters its local phase without an anchor and
crashes at its first synchronization. Both are refused at parsing, naming
the field, the value and what is allowed. A trainable parameter held by
the optimizer but not by the model is refused too: the algorithm never
calls ``optimizer.step()``, so it would silently never be trained. The NaN/Inf protocol (``nonfinite``)
holds on the steps that average the gradient exactly, not only on the
compressed ones."""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers, value_errors
from test_algorithms import batch, make_model
from test_compressed_adam import grads_at

import gradpress.algorithms as algorithms


@pytest.mark.parametrize("spec,field", [("onebit_adam:freeze_step=0", "freeze_step"),
                                        ("zeroone_adam:var_freeze_step=0", "var_freeze_step")])
def test_freeze_at_step_zero_is_refused(spec: str, field: str) -> None:
    with pytest.raises(ValueError, match=f"parameter '{field}' got 0; allowed: integer >= 1"):
        algorithms.parse(spec)


@pytest.mark.parametrize("spec", ["onebit_adam:freeze_step=1", "zeroone_adam:var_freeze_step=1"])
def test_freeze_after_one_step_is_allowed(spec: str) -> None:
    algorithms.parse(spec)


def _extra_param_worker(rank: int, world: int) -> dict:
    def build(case: str) -> object:
        model = make_model()
        extra = [torch.nn.Parameter(torch.ones(3, dtype=torch.float64))]  # a learnable loss weight, say
        if case == "frozen":
            extra[0].requires_grad_(False)  # never stepped by torch's Adam either: allowed
        opt = torch.optim.Adam(list(model.parameters()) + extra, lr=0.01)
        return algorithms.create("onebit_adam:freeze_step=2", model, opt)

    return value_errors(build, {"trainable": "trainable", "frozen": "frozen"})


def test_optimizer_parameter_outside_the_model_is_refused() -> None:
    """The algorithm steps the model's parameters itself and never calls
    ``optimizer.step()``: a trainable parameter that only the optimizer
    holds would silently never be trained, so construction refuses it."""
    for errors in run_workers(_extra_param_worker, 2):
        msg = errors["trainable"]
        assert msg is not None, "an optimizer parameter outside the model was silently never trained"
        for words in ("optimizer param_groups[0]", "shape (3,)", "not a trainable parameter of the model"):
            assert words in msg, (words, msg)
        assert errors["frozen"] is None


# ------------------------------------------------- nonfinite on exact-average steps
NAN_STEP = 2  # rank 1's gradient is NaN at this (0-based) step, an exact-average step for both algorithms
B1, B2, EPS, LR = 0.9, 0.999, 1e-8, 0.01


def _adam_reference(batches: list[int]) -> torch.Tensor:
    """torch's Adam on the exact average of the 2 workers' gradients, float64,
    by its formula, over the given batch indices (a skipped step: absent)."""
    params = [p.detach().clone() for p in make_model().parameters()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, step in enumerate(batches, start=1):
        per_rank = [grads_at(params, r, step) for r in range(2)]
        for i, p in enumerate(params):
            g = (per_rank[0][i] + per_rank[1][i]) / 2
            m[i] = B1 * m[i] + (1 - B1) * g
            v[i] = B2 * v[i] + (1 - B2) * g * g
            p -= LR / (1 - B1 ** t) * m[i] / ((v[i] / (1 - B2 ** t)).sqrt() + EPS)
    return torch.cat([p.reshape(-1) for p in params])


def _nonfinite_worker(rank: int, world: int, spec: str, mode: str, steps: int, compressor: str = "none",
                      nan_step: int = NAN_STEP) -> dict:
    """Rank 1's gradient is NaN at the 0-based ``nan_step``; per step the
    parameters and momenta (``history``) and whether the replicas were
    synchronized (``synced``)."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR, betas=(B1, B2), eps=EPS)
    algo = algorithms.create(spec, model, opt, compressor=compressor, nonfinite=mode, min_numel=64)
    history, synced = [], []
    try:
        for step in range(steps):
            opt.zero_grad()
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            if step == nan_step and rank == 1:
                model[0].weight.grad[0, 0] = float("nan")
            algo.step()
            history.append((torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                            torch.cat([m.reshape(-1) for m in algo.exp_avg])))
            synced.append(getattr(algo, "_synced", True))  # 0/1 Adam only: every other step synchronizes
    except FloatingPointError as exc:
        return {"raised": str(exc)}
    return {"params": history[-1][0], "history": history, "synced": synced, "raised": None}


#: both run exact Adam on the averaged gradient on these steps (1-bit Adam's warm-up, 0/1 Adam's T_v steps)
EXACT_SPECS = ["onebit_adam:freeze_step=100", "zeroone_adam:var_update_scaler=1000"]


@pytest.mark.parametrize("spec", EXACT_SPECS)
def test_skip_drops_a_nonfinite_exact_average_step(spec: str) -> None:
    """``nonfinite='skip'``: the step whose gradient is NaN on one rank is
    dropped on every rank, as if it never happened (0/1 Adam let the NaN
    into m and v on its exact-average steps: every parameter NaN for good)."""
    steps = 5
    want = _adam_reference([s for s in range(steps) if s != NAN_STEP])
    for res in run_workers(_nonfinite_worker, 2, spec, "skip", steps):
        assert res["raised"] is None
        assert torch.allclose(res["params"], want, rtol=1e-9, atol=1e-12), (res["params"] - want).abs().max()


@pytest.mark.parametrize("spec", EXACT_SPECS)
def test_raise_names_a_nonfinite_exact_average_step(spec: str) -> None:
    """``nonfinite='raise'``: every rank raises FloatingPointError naming the
    tensor (both algorithms propagated the NaN silently on these steps)."""
    for res in run_workers(_nonfinite_worker, 2, spec, "raise", NAN_STEP + 2):
        msg = res["raised"]
        assert msg is not None, "a NaN gradient passed silently under nonfinite='raise'"
        assert "'0.weight'" in msg and "nonfinite='raise'" in msg, msg


def test_zeroone_skip_drops_a_nonfinite_compressed_variance_phase_step() -> None:
    """0/1 Adam's variance phase between T_v steps (here t = 3: T_v is 1, 2,
    4, 8 with kappa = 1) averages the gradient compressed; under
    ``nonfinite='skip'`` the engine drops that call on every rank, and the
    step must not happen: neither m nor the parameters change (it decayed
    m by b1 and stepped the parameters with the zeroed gradient)."""
    spec = "zeroone_adam:var_update_scaler=1"
    for res in run_workers(_nonfinite_worker, 2, spec, "skip", NAN_STEP + 2, "efsignsgd"):
        (p_before, m_before), (p_skip, m_skip), (p_next, _) = res["history"][NAN_STEP - 1:NAN_STEP + 2]
        assert torch.equal(m_skip, m_before)
        assert torch.equal(p_skip, p_before)
        assert torch.isfinite(p_next).all() and not torch.equal(p_next, p_skip)


#: 0/1 Adam past its variance freeze: t = 1, 2 exact, then local steps synchronized at t = 3, 4, 6, 8 (H = 1, then 2)
LOCAL_SPEC = "zeroone_adam:var_freeze_step=2,local_step_scaler=1,local_step_clipper=2"


def test_zeroone_skip_returns_a_local_phase_to_the_last_synchronization() -> None:
    """A NaN gradient on one rank during a local step (t = 5) reaches the
    synchronization at t = 6 as a NaN change; under ``nonfinite='skip'``
    the engine drops it on every rank, and the docs promise that every
    replica returns to the parameters of the previous synchronization
    (t = 4) with a zero momentum, identical on both ranks; training then
    goes on finite (t = 7 local, t = 8 synchronized)."""
    runs = run_workers(_nonfinite_worker, 2, LOCAL_SPEC, "skip", 8, "none", 4)
    for res in runs:
        hist = res["history"]
        assert res["synced"] == [True, True, True, True, False, True, False, True]
        (p_sync, _), (p_local, _), (p_skip, m_skip) = hist[3], hist[4], hist[5]
        assert torch.equal(p_skip, p_sync), "the dropped synchronization did not return to the previous one"
        assert torch.equal(m_skip, torch.zeros_like(m_skip))
        assert not torch.equal(p_local, p_sync)  # the local step had moved it
        assert torch.isfinite(hist[7][0]).all() and not torch.equal(hist[7][0], p_skip)
    assert torch.equal(runs[0]["history"][5][0], runs[1]["history"][5][0])
    assert torch.equal(runs[0]["history"][7][0], runs[1]["history"][7][0])
