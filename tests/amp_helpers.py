"""Shared pieces of the loss-scaler tests (``test_review_amp*.py``): test code only, no gradpress code.

:class:`Probe` is the model ``sum(w * G)``: the gradient of ``w`` is the fixed tensor G times the loss's
upstream gradient (the loss scale, exactly). :func:`scaled_steps` is the per-step loop of a run under
``torch.amp.GradScaler`` (or without one), :func:`grown_and_backed_off` the scales such a run must see with
``growth_interval=2`` and one overflow at step 4, :func:`close` the float32-rounding tolerance of an unscaled
average against a float64 reference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import torch.nn as nn
from distributed import run_workers

#: torch 2.2.2 has no device-generic ``torch.amp.GradScaler`` (only CUDA's)
HAS_CPU_SCALER = hasattr(torch.amp, "GradScaler")


class Probe(nn.Module):
    """``forward(G) = sum(w * G)`` (plus ``sum(p * G)`` for each of ``extra`` more parameters): the gradient of
    ``w`` is G times the loss's upstream gradient."""

    def __init__(self, shape: tuple[int, ...], extra: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(shape, dtype=dtype))
        self.extra = nn.ParameterList([nn.Parameter(torch.zeros(shape, dtype=dtype)) for _ in range(extra)])

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return (self.w * g).sum() + sum((p * g).sum() for p in self.extra)


def cpu_scaler(init_scale: float, growth_interval: int = 2) -> Any:
    """``torch.amp.GradScaler("cpu")`` with the given initial scale and growth interval."""
    return torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)


def scaled_steps(model: Probe, ddp: nn.Module, opt: torch.optim.Optimizer, scaler: Any,
                 grad: Callable[[int], torch.Tensor], steps: Iterable[int], plain_step: bool = False) -> dict:
    """Per step: ``ddp(grad(step))`` backward (scaled by ``scaler`` when there is one), then the scaler's step
    and update (or, without a scaler, ``opt.step()`` when ``plain_step``). Returns per step the averaged
    ``w.grad``, the scale of its backward (1.0 without a scaler) and the optimizer's update of ``w``, in
    float64."""
    grads, scales, updates = [], [], []
    for step in steps:
        opt.zero_grad(set_to_none=True)
        before = model.w.detach().double().clone()
        loss = ddp(grad(step))
        (scaler.scale(loss) if scaler is not None else loss).backward()
        grads.append(model.w.grad.double().clone())
        scales.append(scaler.get_scale() if scaler is not None else 1.0)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        elif plain_step:
            opt.step()
        updates.append(model.w.detach().double() - before)
    return {"grads": grads, "scales": scales, "updates": updates}


def grown_and_backed_off(s: float) -> list[float]:
    """The scales of 8 steps from ``s`` with ``growth_interval=2`` and an overflow at step 4: x2 every 2 good
    steps, x0.5 after the overflow."""
    return [s, s, 2 * s, 2 * s, 4 * s, 2 * s, 2 * s, 4 * s]


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to float32 rounding: rtol 1e-5, atol 1e-6 of ``want``'s largest magnitude."""
    return torch.allclose(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


def check_unscaled_averages(run: dict, ref: list[torch.Tensor | None], label: str,
                            detail: Callable[[torch.Tensor, torch.Tensor], str] | None = None) -> None:
    """Each step's averaged ``w.grad`` of ``run`` (:func:`scaled_steps`) divided by the scale of its backward is
    :func:`close` to the float64 reference ``ref``; at a step where ``ref`` is None (the overflow) the average
    is not finite (``nonfinite='propagate'``: every rank's average is NaN, so every scaler skips).
    ``detail(got, want)`` adds to the message."""
    for step, (g, s, want) in enumerate(zip(run["grads"], run["scales"], ref)):
        if want is None:
            assert not bool(torch.isfinite(g).all()), f"{label}: the overflow did not reach the average"
            continue
        got = g / s
        assert close(got, want), (
            f"{label} step {step} (scale {s}): unscaled average differs from the float64 definition by "
            f"{float((got - want).abs().max()):.3g} (max {float(want.abs().max()):.3g})"
            + ("" if detail is None else f"; {detail(got, want)}"))


def run_scaler_workers(fn: Callable[[int, int], Any], world: int) -> list:
    """:func:`distributed.run_workers`, skipped on a torch without a CPU ``GradScaler``."""
    if not HAS_CPU_SCALER:
        pytest.skip("this torch has no torch.amp.GradScaler for CPU")
    return run_workers(fn, world)
