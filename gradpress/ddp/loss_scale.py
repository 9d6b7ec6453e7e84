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

Every rank follows a scaler, or none does (ranks with and without one keep their residuals in different
scales, and the average is silently wrong). Whether one is attached is part of the configuration the ranks
agree on when the hook binds (``register``, ``bind``); an ``attach_scaler`` between binding and the first
step is checked once, at that step's first bucket (:func:`check_presence`: one small allreduce in the
communication thread, never again; its bytes count in the step's stats, as ``uncompressed``; a plan that
compresses nothing keeps no state in the gradient's units, so the check waits for one that does); after the first step attaching or detaching is refused (no rank could
learn of it without a collective every step), replacing one scaler by another is not.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["LossScale", "check_scaler", "check_mode", "check_kept", "presence_error", "check_presence",
           "EVERY_RANK", "framework_scaler"]

#: what to do when ranks disagree on following a scaler
EVERY_RANK = ("every rank's hook must follow its own loss scaler, or none: ranks with and without one keep their "
              "residuals in different scales and the average is wrong; give the scaler on every rank before the "
              "first step (register(..., scaler=) or hook.attach_scaler(scaler); gradpress.lightning and "
              "gradpress.accelerate attach the framework's own)")


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


def framework_scaler(given: Any, framework: Any, nonfinite: str | None, where: str, source: str) -> Any:
    """The scaler a hook made by a framework integration follows: ``given`` (the user's) when there is one
    (a warning when the framework scales the loss with another, ``framework``), else ``framework`` (None:
    the framework has no scaler). ``ValueError`` naming ``source`` (the framework's scaler) and
    ``nonfinite`` when the framework has a scaler and ``nonfinite`` is not ``propagate``."""
    if framework is None:
        return given
    if given is not None:
        if given is not framework:
            warnings.warn(f"{where}: the hook follows the scaler it was given, not {source}, which scales the loss; "
                          "unless the two always hold the same scale, give the hook none (gradpress then follows "
                          f"{source}) or the same object", stacklevel=3)
        return given
    if nonfinite is not None and nonfinite != "propagate":
        raise ValueError(
            f"{where}: nonfinite={nonfinite!r} cannot be used with {source}: a loss scaler needs "
            "nonfinite='propagate' ('skip' zeroes an overflowed step, so the scaler never lowers the scale; 'raise' "
            "fails on the overflows that dynamic loss scaling causes by design); use nonfinite='propagate' (the "
            "default) or a precision without a loss scaler (bf16)")
    return framework


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def presence_error(attached: Sequence[bool]) -> str | None:
    """The error when some ranks (``attached[r]``) follow a scaler and others do not; None when all agree."""
    yes = [r for r, a in enumerate(attached) if a]
    no = [r for r, a in enumerate(attached) if not a]
    if not yes or not no:
        return None
    return f"scaler: a loss scaler is attached (attach_scaler) on {_ranks(yes)} but not on {_ranks(no)}; {EVERY_RANK}"


def check_presence(attached: bool, group: dist.ProcessGroup, device: torch.device,
                   account: Callable[[int, float], None]) -> None:
    """Collective (the hook's communication thread, at its first step): ``ValueError`` on every rank alike
    unless every rank of ``group`` has a scaler attached or none has. One allreduce of one float32 flag per
    rank (on ``device``, the parameters': NCCL reduces CUDA tensors), handed to ``account`` (bytes, seconds)
    first: the engine's stats count every byte handed to a collective."""
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.float32, device=device)
    flags[dist.get_rank(group)] = float(attached)
    start = time.perf_counter()
    dist.all_reduce(flags, group=group)
    attached_on = [bool(f) for f in flags.tolist()]
    account(flags.numel() * flags.element_size(), time.perf_counter() - start)
    error = presence_error(attached_on)
    if error is not None:
        raise ValueError(f"gradpress hook, first step: {error}")


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
