"""The DDP hook following a loss scaler (fp16 autocast with ``torch.amp.GradScaler``).

Under loss scaling DDP hands the hook the *scaled* gradient, so every residual (and every compressor
buffer in the gradient's units: ``Compressor.gradient_state``) is kept in the scale of its step. When the
scaler changes the scale (x2 growth every ``growth_interval`` good steps, x0.5 after an overflow), that
state would be fed back off by new/old once. :class:`LossScale` reads the scale once per step, before the
step's first bucket is averaged, and multiplies that state by new/old first
(:meth:`gradpress.exchange.state.EngineState.rescale`: one fused pass), so the unscaled exchange is the
one of a run without loss scaling.

The read is ``scaler.get_scale()`` in the hook's communication thread; on CUDA it waits for the GPU
(a host sync), which that thread does after every bucket anyway; the training thread does not wait.
During a backward the scale is the one ``scaler.scale(loss)`` used (the scaler updates it after
``backward()`` returns, and DDP's backward waits for every bucket).

Invariant: after a step's first bucket, the state is in the scale of that step's backward (:attr:`kept`),
which goes into the hook's state dict (``loss_scale``) so that a resume continues bit-identically.
An overflow step (``nonfinite='propagate'``: every rank's average is NaN, so every scaler skips) leaves
the residuals as they were, in the overflowed step's scale; the next step's read sees the halved scale.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

__all__ = ["LossScale", "check_scaler", "check_mode", "check_kept"]


class _Engine(Protocol):
    def rescale(self, factor: float) -> None: ...


def check_scaler(scaler: Any) -> None:
    """``ValueError`` unless ``scaler`` is None or has ``get_scale()`` (a ``torch.amp.GradScaler``)."""
    if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
        raise ValueError(f"scaler must be a torch.amp.GradScaler (an object with get_scale()) or None, got "
                         f"{type(scaler).__name__} {scaler!r}")


def check_mode(nonfinite: str) -> None:
    """``ValueError`` unless ``nonfinite`` lets a scaler see overflows (``propagate``)."""
    if nonfinite != "propagate":
        raise ValueError(
            f"scaler: a loss scaler needs nonfinite='propagate', got nonfinite={nonfinite!r}: 'skip' zeroes an "
            "overflowed step's gradients, so the scaler never sees the overflow and never lowers the scale; "
            "'raise' fails on the overflows that dynamic loss scaling causes by design")


def _finite_positive(value: Any) -> bool:
    """A real number (not a bool), finite and > 0: what a loss scale is."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def check_kept(value: Any) -> float | None:
    """A state dict's ``loss_scale``: None or a finite number > 0 (as float); ``ValueError`` otherwise."""
    if value is None:
        return None
    if not _finite_positive(value):
        raise ValueError(f"gradpress hook state dict: 'loss_scale' must be None or a finite number > 0, got "
                         f"{value!r}; nothing was loaded")
    return float(value)


class LossScale:
    """The hook's scaler (None: none attached) and the scale its engine's state is kept in (``kept``;
    None until a step with a scaler, or after loading a state that had none)."""

    def __init__(self) -> None:
        self.scaler: Any = None
        self.kept: float | None = None
        self._read_at: int | None = None  # the hook step whose scale was read last

    def follow(self, engine: _Engine, step: int) -> None:
        """At the first bucket of hook step ``step``: read the scale (once per step) and bring the
        engine's state into it."""
        if self.scaler is None or step == self._read_at:
            return
        new = self.scaler.get_scale()
        if not _finite_positive(new):
            raise ValueError(f"scaler.get_scale() returned {new!r} at step {step}; allowed: a finite number > 0")
        new = float(new)
        if self.kept is not None and new != self.kept:
            engine.rescale(new / self.kept)
        self.kept, self._read_at = new, step

    def restore(self, kept: float | None) -> None:
        """The scale of a loaded state; the next step reads the scaler again."""
        self.kept, self._read_at = kept, None
