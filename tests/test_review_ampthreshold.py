"""Absolute constants in gradient units under ``GradScaler`` (fp16 AMP with the DDP hook; 2 gloo workers, one
launch, about 10 s).

``threshold:tau=T`` keeps the entries with |g| > T, and DGC's ``clip`` bounds ||g||_2 by clip * sqrt(N): both
are in the gradient's units. Under a loss scale s the hook sees s * g, so the compressor must compare with
T * s (and clip to clip * s * sqrt(N)): ``register(..., scaler=)`` hands it the step's scale in its encode
Context (``Context.loss_scale``, 1 without a scaler).

Every gradient is a fixed tensor G (the loss is ``sum(w * G)``: ``w.grad`` is G times the loss scale, exactly),
rank 1's holding an Inf at one step, where the scaler skips the step and halves the scale; the scale starts at
2**16 (fp16's default) and grows x2 twice and backs off once.

* ``threshold:tau=T`` with error feedback: the unscaled averages equal the float64 definition without loss
  scaling (``p = e + G``, send p where |p| > T, ``e = p - sent``; the overflow step leaves every residual as it
  was), up to float32 rounding;
* ``threshold`` through ``ring`` and ``ps`` (hop and root contexts), and ``dgc:clip=1`` (clipping active at
  every step): the scaled run's unscaled averages equal the same run without loss scaling;
* in one process: ``Context.loss_scale`` other than a finite number > 0 is refused naming the field, and it
  enters no seed (the random stream is the same whatever the scale).
"""

from __future__ import annotations

import math

import pytest
import torch
from amp_helpers import (
    Probe,
    check_unscaled_averages,
    close,
    cpu_scaler,
    grown_and_backed_off,
    run_scaler_workers,
    scaled_steps,
)
from references import error_feedback_run
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress

SHAPE = (16, 32)  # 512 entries: compressed (min_numel below)
MIN_NUMEL = 64
STEPS = 8
OVERFLOW = 4  # rank 1's gradient holds an Inf at this step
TAU = 1.0  # keeps about a third of N(0, 1) entries (more with the residual added)
THRESHOLD = f"threshold:tau={TAU}"
INIT_SCALE = 2.0**16
#: (spec, strategy): the scaled run's unscaled averages against the run without loss scaling
EQUIVARIANT = (
    (THRESHOLD, "ring"),
    (THRESHOLD, "ps"),
    ("dgc:ratio=0.05,clip=1.0", "collective"),
)


def _grad(rank: int, step: int) -> torch.Tensor:
    g = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1000 * step + rank + 17))
    if rank == 1 and step == OVERFLOW:
        g[3, 5] = math.inf
    return g


def _train(rank: int, spec: str, strategy: str, scaled: bool) -> dict:
    """Per step the averaged ``w.grad`` in float64 and the scale of its backward."""
    model = Probe(SHAPE)
    ddp = DDP(model)
    scaler = cpu_scaler(INIT_SCALE) if scaled else None
    # without a scaler the overflowed step is dropped with nonfinite='skip' (every state of the step put back)
    hook = gradpress.ddp.register(ddp, spec, strategy=strategy, min_numel=MIN_NUMEL, scaler=scaler,
                                  error_feedback=True if spec == THRESHOLD else None,
                                  nonfinite="propagate" if scaled else "skip")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # w stays 0: the gradients are the fixed G times the scale
    out = scaled_steps(model, ddp, opt, scaler, lambda step: _grad(rank, step), range(STEPS))
    hook.close()
    return out


def _workers(rank: int, world: int) -> dict:
    out: dict = {"threshold": _train(rank, THRESHOLD, "collective", True)}
    for spec, strategy in EQUIVARIANT:
        out[(spec, strategy)] = (_train(rank, spec, strategy, True), _train(rank, spec, strategy, False))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_scaler_workers(_workers, 2)


def _threshold_reference(world: int) -> list[torch.Tensor | None]:
    """Error-feedback ``threshold`` by the definition, in float64, without any loss scale: per step the mean
    over ranks of what each sends (p = e + G, sent = p where |p| > TAU, e = p - sent); None at the overflow step,
    which leaves every residual as it was."""
    return error_feedback_run(_grad, world, STEPS, lambda p: torch.where(p.abs() > TAU, p, torch.zeros_like(p)))


def test_the_scale_sequence_grows_and_backs_off(results: list[dict]) -> None:
    want = grown_and_backed_off(INIT_SCALE)  # x2 every 2 good steps, x0.5 after the overflow
    for res in results:
        assert res["threshold"]["scales"] == want, res["threshold"]["scales"]


def test_threshold_tau_applies_in_gradient_units_under_a_loss_scale(results: list[dict]) -> None:
    ref = _threshold_reference(2)
    for step, want in enumerate(ref):  # the reference keeps part of each tensor: the test can tell
        if want is not None:
            assert 0 < int((want != 0).sum()) < want.numel(), step
    for rank, res in enumerate(results):
        check_unscaled_averages(res["threshold"], ref, f"rank {rank}", lambda got, want: (
            f"entries sent {int((got != 0).sum())}, by the definition {int((want != 0).sum())}"))


@pytest.mark.parametrize(("spec", "strategy"), EQUIVARIANT)
def test_absolute_constants_follow_the_scale(results: list[dict], spec: str, strategy: str) -> None:
    for rank, res in enumerate(results):
        scaled, plain = res[(spec, strategy)]
        for step in range(STEPS):
            if step == OVERFLOW:
                continue
            got, want = scaled["grads"][step] / scaled["scales"][step], plain["grads"][step]
            assert close(got, want), (f"{spec} {strategy} rank {rank} step {step}: differs from the run without "
                                       f"loss scaling by {float((got - want).abs().max()):.3g} "
                                       f"(max {float(want.abs().max()):.3g})")


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, True, "2", None])
def test_a_context_loss_scale_that_is_not_a_finite_positive_number_is_refused(bad: object) -> None:
    from gradpress.compress import Context

    with pytest.raises(ValueError, match=r"Context: loss_scale must be a finite number > 0, got "):
        Context(key="t", loss_scale=bad)


def test_the_loss_scale_enters_no_seed() -> None:
    from gradpress.compress import Context

    one, scaled = Context(key="t", step=3, rank=1, seed=9), Context(key="t", step=3, rank=1, seed=9, loss_scale=2.0**16)
    assert (one.shared_seed, one.private_seed) == (scaled.shared_seed, scaled.private_seed)
