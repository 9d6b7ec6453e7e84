"""The NaN/Inf protocol: every rank does the same thing with a step in which
some rank's gradient is not finite.

Modes (``nonfinite=``):

* ``propagate``: the affected tensors become NaN on every rank (so every
  rank's GradScaler skips the same step); residuals stay as they were. While
  a loss scaler is attached to the DDP hook (``keep_on_propagate``), the
  compressor's and strategies' own state (DGC's momentum and velocity,
  Signum's momentum, PowerSGD's Q, an estimator's threshold...) also stays as
  it was on every rank, also on those whose own gradient was finite (the
  snapshot below): a skipped step leaves no trace, the next one is that of a
  run without it. Without a scaler no copy is taken (DGC's at 4M elements,
  one thread: 3-5 ms alone, about 10 ms inside a step of 30-40 ms;
  docs/bench.md): a NaN step then reaches the model anyway; whoever skips
  such steps by hand wants ``skip``.
* ``skip``: every rank zeroes the affected call's tensors, residuals and the
  compressor's and strategies' own state stay as they were (a snapshot taken
  at the start of the step is restored), the step counts in
  ``stats["skipped_steps"]``; check ``last_step_skipped`` before
  ``optimizer.step()``.

A dropped step (``skip``, and ``propagate`` while ``keep_on_propagate``)
does not count in the step compressors draw from (``StepGuard.dropped``,
subtracted from the caller's step in every Context, :meth:`StepGuard.counted`
through ``Synchronizer.context``, also in an algorithm's own codec): after a
dropped step k the next step draws what a run without it draws at step k, as
the optimizer's step count does not advance in plain AMP. A call encoded
ahead (``Synchronizer.prepare``) is not while a step may be dropped
(:attr:`StepGuard.may_drop`): its count is known only at its sync.
* ``raise``: every rank raises ``FloatingPointError`` naming the tensors.

How every rank learns the same thing: one flag per tensor (1 where this
rank's tensor is not finite) rides in the plain allreduce of the call, so the
sums tell every rank which tensors are bad anywhere. When nothing is
compressed, a NaN/Inf survives the plain sum, so the result itself tells.
Finite inputs whose exchange overflows give a non-finite average that is
identical on every rank (every rank decodes the same bytes): the averages
of compressed tensors are checked too (one ``aminmax`` read each) and such
a step is treated like a bad input. Without a loss scaler, fp16/bf16 bound
their summands so that their 16-bit sums saturate instead
(``Compressor.bound_summand``; a guarantee up to 2,046 fp16 / 255 bf16
summands), and their cast saturates: this check is what is left for codecs
that do not, and beyond those counts. While a loss scaler is attached
(``Context.loss_scaler``) they do neither: an overflow of the scaled
gradient's cast or of its 16-bit sum is Inf, as in plain fp16 AMP with an
fp16 wire, this check sees it, and ``propagate`` hands it to every rank's
scaler, which skips the step and lowers the scale (saturating would hide it:
the scale would never back off and every update beyond the range would be
clipped unseen).
Flags stay tensors on the hot path (no host sync) except in ``skip`` and
``raise`` modes, which must branch: one sync per call there. With a
compressor or strategy that keeps state, ``skip`` (and ``propagate`` with a
scaler) copy it at
the start of every step (into buffers kept from step to step, :attr:`StepGuard.kept`,
where the compressor gives ``live_state``; else ``state_dict``: one copy where it declares
``state_dict_copies``, or a deep copy of it) and put it back at its end when
some rank saw a NaN/Inf: one read of the step's flag then (a host sync on an
accelerator), and the copy costs what that state weighs (DGC: two buffers per
tensor). A call encoded ahead (``Synchronizer.prepare``: its state moved
before the verdict, as its residuals) takes no copy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from gradpress.compress.base import all_finite
from gradpress.exchange.feedback import Feedback
from gradpress.exchange.stats import ExchangeStats

__all__ = ["NONFINITE_MODES", "SCALER_NEEDS_PROPAGATE", "StepGuard", "local_flags", "nonfinite_gradient_error"]

#: why a loss scaler needs ``nonfinite='propagate'`` (the DDP hook's, the algorithms' and ``--precision fp16``'s
#: refusals of another mode end with it)
SCALER_NEEDS_PROPAGATE = ("'skip' zeroes an overflowed step's gradients, so the scaler never sees the overflow and "
                          "never lowers the scale; 'raise' fails on the overflows that dynamic loss scaling causes "
                          "by design")

NONFINITE_MODES = ("propagate", "skip", "raise")


def nonfinite_gradient_error(names: list[str], where: str) -> FloatingPointError:
    """``nonfinite='raise'``'s error for the gradients ``names`` at ``where``
    (``"step 3"``): the same on every rank, which all saw the same flags."""
    return FloatingPointError(f"gradpress: non-finite gradient (NaN/Inf) in {', '.join(repr(k) for k in names)} at "
                              f"{where} on at least one rank (nonfinite='raise'; use 'skip' to drop such steps)")


def local_flags(tensors: list[torch.Tensor], flat: torch.Tensor | None) -> torch.Tensor:
    """One flag per tensor, 1 where this rank's tensor is not finite, in a
    floating dtype of the call (they are summed with the plain tensors)."""
    ref = flat if flat is not None else tensors[0]
    dtype = ref.dtype if ref.is_floating_point() else torch.float32
    return torch.stack([~all_finite(t) for t in tensors]).to(dtype)


def zeroer(tensors: list[torch.Tensor], flat: torch.Tensor | None) -> Callable[[], None]:
    """A function that zeroes a call's tensors (``flat``, their buffer,
    when given): what :class:`StepGuard` runs on a dropped bucket."""
    def zero() -> None:
        if flat is not None:
            flat.zero_()
        else:
            for t in tensors:
                t.zero_()
    return zero


class StepGuard:
    """Tracks the NaN/Inf outcome of the step in flight and applies the mode.

    ``snapshot``/``restore`` save and put back the compressor's and
    strategies' own state (``skip``; ``propagate`` with ``keep_on_propagate``:
    a dropped or NaN-propagated step leaves none of it behind)."""

    def __init__(self, mode: str, snapshot: Callable[[], Mapping[str, Any] | None],
                 restore: Callable[[Mapping[str, Any]], None], stats: ExchangeStats) -> None:
        self.mode = mode
        self._snapshot_fn = snapshot
        self._restore_fn = restore
        self._stats = stats
        self._started = False
        self._snapshot: Mapping[str, Any] | None = None
        # OR over the calls of the step in flight: did any rank see a NaN/Inf? (tensor: no host sync)
        self._step_bad: torch.Tensor | None = None
        self._last_skipped: torch.Tensor | None = None
        #: the last ended step's verdict (0-d bool tensor, True: some rank saw a NaN/Inf; None: no call checked),
        #: the same on every rank: what an algorithm's loss scaler agrees on (gradpress.algorithms.loss_scale)
        self.last_bad: torch.Tensor | None = None
        #: ``propagate`` also puts the state back (set by the DDP hook while a loss scaler is attached, and by an
        #: algorithm given one: gradpress.algorithms.loss_scale)
        self.keep_on_propagate = False
        #: the steps dropped so far (``skip``, or ``propagate`` with ``keep_on_propagate``: the state put back, the
        #: step left no trace): the engine's Context step is the caller's step less these, so a random compressor
        #: draws after a dropped step k what a run without it draws at step k (in the engine's state dict)
        self.dropped = 0
        #: the buffers the engine's snapshots are copied into, kept from step to step while the mode takes them
        self.kept: Any = None

    def counted(self, step: int) -> int:
        """The step a caller's ``step`` counts as: less the steps dropped so far (the step every Context the
        engine or an algorithm builds carries; :meth:`Synchronizer.context`)."""
        return step - self.dropped

    def check_counted(self, counted: int | None, step: int) -> None:
        """``RuntimeError`` unless a call encoded ahead at counted step ``counted`` (``Encoded.counted``) is
        synced at a ``step`` that still counts as that (no step dropped, no state loaded in between)."""
        if counted != self.counted(step):
            raise RuntimeError(f"sync(prepared=): the call was encoded at counted step {counted}, but step {step} "
                               f"now counts as {self.counted(step)} (a step was dropped, or a state loaded, between "
                               "prepare and sync); encode it again (prepare) or sync without prepared=")

    @property
    def may_drop(self) -> bool:
        """Whether a step may still be dropped (``skip``, or ``propagate`` while ``keep_on_propagate``): the
        count of a later step is known only once the calls before it have ended."""
        return self.mode == "skip" or (self.mode == "propagate" and self.keep_on_propagate)

    def begin_call(self, snapshot: bool = True) -> None:
        """The start of a call; at the step's first, the state's copy (``snapshot``: False for a call encoded
        ahead, whose state already moved and may be moving again in the caller's thread)."""
        if not self._started:
            self._started = True
            if not (self.mode == "skip" or (self.mode == "propagate" and self.keep_on_propagate)):
                self.kept = None  # the mode takes no copy (a scaler detached): the kept buffers go
            elif snapshot:
                self._snapshot = self._snapshot_fn()

    def _note(self, bad: torch.Tensor) -> None:
        self._step_bad = bad if self._step_bad is None else (self._step_bad | bad)

    def observe(self, flags: torch.Tensor, keys: list[str], step: int, zero: Callable[[], None]) -> bool:
        """Given the per-tensor flags summed over ranks (True: bad on some
        rank), apply the mode; True when the call is dropped."""
        self._note(flags.any())
        if self.mode != "propagate" and bool(flags.any()):  # one host sync per call, in these modes only
            self._drop([k for k, b in zip(keys, flags.tolist()) if b], step, zero)
            return True
        return False

    def observe_dense(self, any_bad: torch.Tensor, keys: list[str], tensors: list[torch.Tensor], step: int,
                      zero: Callable[[], None]) -> None:
        """The same after a call where nothing was compressed."""
        self._note(any_bad)
        if self.mode != "propagate" and bool(any_bad):
            self._drop([k for k, t in zip(keys, tensors) if not bool(all_finite(t))], step, zero)

    def observe_results(self, flags: torch.Tensor, keys: list[str], step: int, zero: Callable[[], None]) -> bool:
        """Given per-tensor flags of averages that came out non-finite from
        finite inputs (an overflow in the exchange: fp16 sums near 65504),
        identical on every rank (every rank decoded the same bytes), apply
        the mode as for a bad input; True when the call is dropped."""
        self._note(flags.any())
        if self.mode != "propagate" and bool(flags.any()):
            if self.mode == "raise":
                names = ", ".join(repr(k) for k, b in zip(keys, flags.tolist()) if b)
                raise FloatingPointError(
                    f"gradpress: non-finite average (NaN/Inf) of finite gradients in {names} at step {step}: the "
                    "exchange overflowed (e.g. an fp16 sum beyond 65504; nonfinite='raise'; use 'skip' to drop such "
                    "steps, or a compressor with more range)"
                )
            zero()
            return True
        return False

    @staticmethod
    def not_finite(t: torch.Tensor) -> torch.Tensor:
        return ~all_finite(t)

    @staticmethod
    def any_bad(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([~all_finite(t) for t in tensors]).any()

    def _drop(self, names: list[str], step: int, zero: Callable[[], None]) -> None:
        """``raise``: fail (on every rank: all saw the same flags); ``skip``:
        every rank zeroes the call's tensors."""
        if self.mode == "raise":
            raise nonfinite_gradient_error(names, f"step {step}")
        zero()

    def end_step(self, feedback: Feedback) -> None:
        """Commit the step's staged residuals unless some rank saw a NaN/Inf;
        then also put back the state the step's calls advanced (when a copy was taken)."""
        bad, self._step_bad = self._step_bad, None
        self.last_bad = bad
        self._started = False
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is not None and bad is not None and bool(bad):
            self._restore_fn(snapshot)
        if bad is None:
            feedback.commit(True)
            self._last_skipped = None
            return
        feedback.commit(~bad)
        self._stats.flag_step(bad)
        self._last_skipped = bad if self.mode == "skip" else None
        if (self.mode == "skip" or self.keep_on_propagate and self.mode == "propagate") and bool(bad):
            self.dropped += 1  # skip read the flag already; a scaler's hook reads the scale (a sync) per step

    @property
    def last_skipped(self) -> bool:
        flag = self._last_skipped
        return bool(flag) if flag is not None else False
