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

A compressor whose output is scale-free (``Compressor.scale_degree == 0``: ``signsgd``, ``signum`` decode to +-1
whatever the scale) would hand the optimizer +-1, which ``unscale_`` makes +-1/scale: the read scale is also the
engine's ``output_scale``, by which it multiplies such averages (after aggregation: a majority vote is the sign
of a sum), so that they carry the gradient's scale like every other. Error feedback on such a compressor is
refused with a scaler (:func:`check_engine`): its residual ``p - decode`` would subtract +-1 from a scaled ``p``.
The engine also puts that scale in every encode Context (``Context.loss_scale``), by which a compressor multiplies
its constants in gradient units (``threshold``'s ``tau``, DGC's ``clip``), so they apply to the unscaled gradient,
and ``Context.loss_scaler`` (the engine's ``loss_scaler``, True while a scaler is attached, whatever the scale): a
codec of fixed range (``fp16``, ``bf16``) then lets an overflow of the scaled gradient, or of its 16-bit sum, be Inf
instead of saturating, so that the scaler skips the step and lowers the scale, as in plain fp16 AMP.

Invariant: after a step's first bucket, the state is in the scale of that step's backward (:attr:`kept`),
which goes into the hook's state dict (``loss_scale``) so that a resume continues bit-identically.
An overflow step (``nonfinite='propagate'``: every rank's average is NaN, so every scaler skips) leaves
the residuals and the compressor's and strategies' own state as they were (the engine puts back its copy
taken at the step's start: :class:`gradpress.exchange.nonfinite.StepGuard`), in the overflowed step's scale;
the next step's read sees the halved scale.

Every rank follows a scaler, or none does (ranks with and without one keep their residuals in different
scales, and the average is silently wrong). Whether one is attached is part of the configuration the ranks
agree on when the hook binds (``register``, ``bind``), so a scaler is attached before it (``register(...,
scaler=)``, or ``make_hook(spec)``, ``attach_scaler``, ``bind``); after binding, attaching or detaching one is
refused (no other rank could learn of it without a collective), replacing one scaler by another is not. Nothing
is sent for it at any step.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Protocol

from gradpress.exchange.nonfinite import SCALER_NEEDS_PROPAGATE

__all__ = ["LossScale", "check_scaler", "check_mode", "check_kept", "check_feedback", "check_engine", "check_attach",
           "EVERY_RANK", "framework_scaler"]

#: what to do when ranks disagree on following a scaler
EVERY_RANK = ("every rank's hook must follow its own loss scaler, or none: ranks with and without one keep their "
              "residuals in different scales and the average is wrong; give the scaler on every rank before the "
              "hook binds (register(..., scaler=), or hook.attach_scaler(scaler) before bind; gradpress.lightning and "
              "gradpress.accelerate attach the framework's own)")


class _Engine(Protocol):
    output_scale: float
    loss_scaler: bool
    nonfinite: str
    error_feedback: bool
    compressor: Any
    guard: Any

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
            f"scaler: a loss scaler needs nonfinite='propagate', got nonfinite={nonfinite!r}: "
            + SCALER_NEEDS_PROPAGATE)


def check_feedback(compressor: Any, error_feedback: bool) -> None:
    """``ValueError`` when error feedback is on for a compressor whose output is scale-free
    (``scale_degree == 0``): under a loss scale its residual ``p - decode`` mixes the scaled ``p`` with +-1;
    and for a compressor of no scale degree (``None``: a constant it does not relate to ``ctx.loss_scale``,
    such as docs/authoring.md's TBQ with a fixed tau), whose average the loss scale would change by more
    than the scale, whatever the error feedback."""
    if getattr(compressor, "scale_degree", 1) is None:
        raise ValueError(
            f"scaler: compressor {compressor.spec()!r} declares scale_degree=None (decode(encode(s x)) is not "
            "s**k decode(encode(x)): a constant of it applies to the scaled gradient), so a loss scaler would "
            "change what it sends; allowed with a scaler: a compressor of scale_degree 0 or 1 (one that compares "
            "its constants with |x| / ctx.loss_scale declares 1, as threshold does), or no scaler (bf16 autocast)")
    if error_feedback and getattr(compressor, "scale_degree", 1) == 0:
        raise ValueError(
            f"scaler: compressor {compressor.spec()!r} decodes to a scale-free output (scale_degree=0: +-1 whatever "
            "the loss scale), so its error-feedback residual p - decode would subtract +-1 from the scaled gradient; "
            "got error_feedback=True; allowed with a scaler: error_feedback=False (its default), or a compressor of "
            "scale_degree 1 such as efsignsgd (signs times their mean magnitude, with error feedback)")


def check_engine(engine: _Engine) -> None:
    """What a scaler needs of a bound engine: :func:`check_mode` and :func:`check_feedback`."""
    check_mode(engine.nonfinite)
    check_feedback(engine.compressor, engine.error_feedback)


def check_attach(new: Any, old: Any, started: bool, engine: _Engine | None, nonfinite: str | None) -> None:
    """``ValueError`` unless ``attach_scaler(new)`` may replace ``old``: a scaler (or None), what a scaler needs
    of the bound ``engine`` (:func:`check_engine`) or of the hook's ``nonfinite`` before binding, and no
    attaching or detaching once the hook is bound (``started``: bound, or a bucket handed over; the ranks agreed
    on the scaler at binding and no other rank could learn of the change)."""
    check_scaler(new)
    if new is not None and engine is not None:
        check_engine(engine)
    elif new is not None and nonfinite is not None:
        check_mode(nonfinite)
    if started and (new is None) != (old is None):
        raise ValueError(f"attach_scaler({'None' if new is None else type(new).__name__}): the hook is bound (or its "
                         "first step has run) " + ("with" if new is None else "without") + " a loss scaler; attaching "
                         "or detaching one after binding is refused (the other ranks could not learn of it); give it "
                         "to register(model, spec, scaler=scaler) on every rank, or attach it before the hook binds "
                         "(make_hook(spec), attach_scaler, bind)")


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
        """At the first bucket of hook step ``step``: read the scale (once per step), bring the
        engine's state into it and make it the engine's ``output_scale`` (1 without a scaler)."""
        engine.guard.keep_on_propagate = self.scaler is not None  # an overflowed step leaves no trace
        engine.loss_scaler = self.scaler is not None  # an fp16/bf16 wire's overflow reaches the scaler as Inf
        if self.scaler is None:
            engine.output_scale = 1.0  # none attached (or detached): scale-free averages stay as decoded
            if self.kept is not None:  # a loaded state kept in a loss scale, resumed without one: back to 1
                engine.rescale(1.0 / self.kept)
                self.kept = None
            return
        if step == self._read_at:
            return
        new = self.scaler.get_scale()
        if not _finite_positive(new):
            raise ValueError(f"scaler.get_scale() returned {new!r} at step {step}; allowed: a finite number > 0")
        new = float(new)
        if self.kept is not None and new != self.kept:
            engine.rescale(new / self.kept)
        self.kept, self._read_at = new, step
        engine.output_scale = new

    def restore(self, kept: float | None) -> None:
        """The scale of a loaded state; the next step reads the scaler again, or, when none is attached
        then, brings the state back to scale 1 (a run resumed without loss scaling). A state kept in no
        scale (None) loaded under a scaler is taken as kept in the first scale read: a state of a run that
        scaled its loss without telling the hook (before the integrations attached the framework's scaler)
        holds scaled residuals, and cannot be told from one of a run without loss scaling."""
        self.kept, self._read_at = kept, None
