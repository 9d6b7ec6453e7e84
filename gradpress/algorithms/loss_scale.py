"""An algorithm following a loss scaler: fp16 autocast with ``torch.amp.GradScaler``
(``gradpress.algorithms.create(spec, model, optimizer, scaler=scaler)``).

The user's loop is plain AMP's without the scaler's own calls: ``scaler.scale(loss).backward()``, then
``algo.step()``, which does ``unscale_`` / ``step`` / ``update`` itself (:class:`AlgorithmScale`):

* the gradients are unscaled (``scaler.unscale_(optimizer)``) before anything reads them (a gradient
  exchange, SCAFFOLD-like corrections, an algorithm's own Adam), so what the engine exchanges, every
  error-feedback residual and every compressor buffer is in gradient units: a change of the scale
  leaves them as they are (the DDP hook, which exchanges the *scaled* gradient, rescales its residuals
  instead: :mod:`gradpress.ddp.loss_scale`). A caller that already unscaled (to clip) is not unscaled twice.
  For the same reason the engine's ``loss_scaler`` stays False: an ``fp16``/``bf16`` wire keeps its saturating
  bound (a value beyond its range is no loss-scale overflow; lowering the scale would not bring it back).
* where the step exchanges gradients (``postlocalsgd``'s and DiLoCo's synchronous phase,
  :meth:`~gradpress.algorithms.base.Algorithm.ddp_step`; 1-bit Adam's exchanges, 0/1 Adam's variance phase),
  an overflow on one rank
  skips the step on every rank: ``nonfinite='propagate'`` makes every rank's average NaN and the engine's
  :class:`~gradpress.exchange.nonfinite.StepGuard` puts back the residuals and compressor state
  (``keep_on_propagate``); its verdict of the step (``StepGuard.last_bad``, identical on every rank: no
  collective of its own) is OR-ed into the scaler's found-inf flag (:meth:`AlgorithmScale.agree`), so that
  ``scaler.step`` skips and ``scaler.update`` backs off on every rank, as plain AMP with DDP does.
* a local step of a model-averaging or gossip algorithm (local SGD, DiLoCo, Streaming DiLoCo, LSGD, SCAFFOLD,
  D-PSGD, SGP, CHOCO; 0/1 Adam's local phase) is each rank's own: a rank whose gradient overflowed skips its
  local step and halves its own scale, the others step; no agreement is needed, since what is exchanged
  (parameters, their deltas, control variates) is finite fp32 either way and the synchronizations keep
  their steps, and each rank's scale may differ from the others' (each rank saves its own; a resharded
  resume takes the smallest: ``algorithms/base.py``'s fold).
* refused, naming why (``Algorithm.scaler_refusal``): Comprex (step t's exchange is applied at t + s, after
  the scaler had to decide), LGC (its latent exchange does not carry the agreement).

The scaler's state (scale, growth tracker) is in the algorithm's ``state_dict`` (``loss_scaler``), so that
a resume continues bit-identically without saving the scaler apart.

The found-inf flag is the scaler's per-optimizer ``found_inf_per_device`` (written by ``unscale_``, read by
``step`` and ``update``; torch has no public setter): :meth:`AlgorithmScale.agree` fails with a clear error
on a scaler laid out otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from gradpress.exchange.nonfinite import SCALER_NEEDS_PROPAGATE

__all__ = ["AlgorithmScale", "SCALER_METHODS", "check_scaler"]

#: what ``scaler=`` must provide (``torch.amp.GradScaler`` does)
SCALER_METHODS = ("get_scale", "unscale_", "step", "update", "state_dict", "load_state_dict")


def check_scaler(name: str, scaler: Any, nonfinite: str, refusal: str | None) -> None:
    """``ValueError`` naming ``scaler`` unless the algorithm ``name`` takes it (``refusal``: why not) with
    ``nonfinite`` (``propagate``: 'skip' zeroes an overflow, so the scaler never backs off) and ``scaler``
    has :data:`SCALER_METHODS`."""
    if refusal is not None:
        raise ValueError(f"algorithm {name!r}: scaler= is not supported: {refusal}; allowed: scaler=None "
                         "(bf16 autocast needs no scaler)")
    missing = [m for m in SCALER_METHODS if not callable(getattr(scaler, m, None))]
    if missing:
        raise ValueError(f"algorithm {name!r}: scaler must be a torch.amp.GradScaler (an object with "
                         f"{', '.join(SCALER_METHODS)}) or None, got {type(scaler).__name__} {scaler!r} "
                         f"(no {missing[0]})")
    if nonfinite != "propagate":
        raise ValueError(f"algorithm {name!r}: scaler= needs nonfinite='propagate', got nonfinite={nonfinite!r}: "
                         + SCALER_NEEDS_PROPAGATE)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


#: a GradScaler state's fields besides its scale: (the test, what is allowed), as ``torch.amp.GradScaler``'s
#: constructor requires them (growth > 1, backoff < 1, a positive interval) and its tracker counts
FIELDS: dict[str, tuple[Any, str]] = {
    "growth_factor": (lambda x: _number(x) and math.isfinite(x) and x > 1, "a finite number > 1"),
    "backoff_factor": (lambda x: _number(x) and 0 < x < 1, "a number in (0, 1)"),
    "growth_interval": (lambda x: _count(x) and x > 0, "an integer > 0"),
    "_growth_tracker": (lambda x: _count(x) and x >= 0, "an integer >= 0"),
}


class AlgorithmScale:
    """The loss scaler of an algorithm and its optimizer (module doc)."""

    def __init__(self, scaler: Any, optimizer: torch.optim.Optimizer) -> None:
        self.scaler = scaler
        self.optimizer = optimizer
        #: ``GradScaler(enabled=False)`` (``enabled=use_fp16``): ``scale`` and ``unscale_`` do nothing, ``step``
        #: is ``optimizer.step()``; no found-inf flag is recorded, so there is none to agree on
        self.enabled = bool(getattr(scaler, "is_enabled", lambda: True)())

    def _opt_state(self) -> dict[str, Any]:
        states = getattr(self.scaler, "_per_optimizer_states", None)
        if not isinstance(states, Mapping):
            raise RuntimeError(f"scaler {type(self.scaler).__name__}: no per-optimizer state "
                               "(_per_optimizer_states, torch.amp.GradScaler's); the found-inf flag cannot be agreed")
        return states[id(self.optimizer)]

    def unscale(self) -> None:
        """``scaler.unscale_(optimizer)`` unless the caller already did (before clipping)."""
        if not self.enabled:
            return
        stage = self._opt_state().get("stage")
        if getattr(stage, "name", None) != "UNSCALED":
            self.scaler.unscale_(self.optimizer)

    def agree(self, bad: torch.Tensor | None) -> None:
        """OR the step's verdict ``bad`` (a 0-d tensor, the same on every rank; None: nothing flagged) into
        the scaler's found-inf flags, after :meth:`unscale` (no host read)."""
        if bad is None or not self.enabled:
            return
        found = self._opt_state().get("found_inf_per_device")
        if not found:
            raise RuntimeError("scaler: no found-inf flag recorded for the optimizer (unscale_ was not called)")
        for flag in found.values():
            flag.copy_(torch.maximum(flag, bad.to(flag.device, flag.dtype)))

    def found_inf(self) -> bool:
        """Whether the scaler skips this step (after :meth:`unscale`; one host read)."""
        if not self.enabled:
            return False
        return any(bool(v) for v in self._opt_state()["found_inf_per_device"].values())

    def unscaled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` divided by the current scale: what the loop passed to ``scaler.scale`` when ``loss`` is
        the root of its ``scaler.scale(loss).backward()`` (the scale is updated only in ``algo.step()``, after
        the backward). A disabled scaler scales nothing: ``loss`` as it is. One host read."""
        if not self.enabled:
            return loss
        return loss.detach() / self.scaler.get_scale()

    def step(self) -> None:
        """Plain AMP's end of a step: ``scaler.step(optimizer)`` (skipped on an overflow), ``scaler.update()``."""
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def update(self) -> None:
        """``scaler.update()`` for an algorithm that steps the parameters itself (its own Adam), after
        :meth:`unscale`: the scale backs off after an overflow, grows after ``growth_interval`` good steps."""
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        """The scaler's own (plain numbers: scale, factors, interval, growth tracker)."""
        return dict(self.scaler.state_dict())

    def check_state(self, state: Any) -> None:
        """``ValueError`` unless ``state`` is a state of this scaler (every key its own ``state_dict`` has)
        with a finite scale > 0 and every other field of the kind ``torch.amp.GradScaler`` takes
        (:data:`FIELDS`): checked before anything loads, as ``scaler.load_state_dict`` would fail part-way
        (``KeyError``; ``TypeError`` filling its growth tracker) after the algorithm's own state had loaded,
        or take a field that fails the next ``update`` (a factor given as a string)."""
        scale = state.get("scale") if isinstance(state, Mapping) else None
        if not _number(scale) or not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"algorithm state dict: 'loss_scaler' must be a GradScaler state with a finite 'scale' "
                             f"> 0, got {state!r}; nothing was loaded")
        own = self.scaler.state_dict()
        missing = sorted(set(own) - set(state))
        if missing:
            raise ValueError(f"algorithm state dict: 'loss_scaler' lacks {', '.join(map(repr, missing))} (a "
                             f"GradScaler state has {', '.join(map(repr, sorted(own)))}), got "
                             f"{state!r}; nothing was loaded")
        for key, (ok, allowed) in FIELDS.items():
            if key in own and not ok(state[key]):
                raise ValueError(f"algorithm state dict: 'loss_scaler'[{key!r}] must be {allowed}, got "
                                 f"{state[key]!r}; nothing was loaded")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scaler.load_state_dict(dict(state))
