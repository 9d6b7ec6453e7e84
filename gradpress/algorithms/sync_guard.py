"""The ``nonfinite`` protocol around one synchronization of a
model-averaging algorithm (local SGD, DiLoCo, Streaming DiLoCo, SCAFFOLD,
and the synchronous phase's :meth:`~gradpress.algorithms.base.Algorithm.ddp_step`),
in one place: :class:`SyncGuard`.

The engine checks what a synchronization sends; the optimizer state and
floating buffers the local steps changed are the algorithm's to cover, with
its :attr:`~gradpress.algorithms.base.Algorithm.restart`
(:class:`~gradpress.algorithms.restart.LocalCopy`, ``nonfinite='skip'``) and
:attr:`~gradpress.algorithms.base.Algorithm.alarm`
(:class:`~gradpress.algorithms.alarm.StateAlarm`, ``nonfinite='raise'``),
both None in the other modes. Around every synchronization the steps are the
same:

1. before the exchange (:meth:`SyncGuard.before`): ``skip``: a state tensor
   or buffer newly non-finite on this rank makes one element of its outgoing
   deltas NaN (:meth:`LocalCopy.flag_into`), so the engine's verdict drops
   the synchronization on every rank; ``raise``: this rank's per-tensor
   flags (:meth:`StateAlarm.flags`);
2. the flags ride in the synchronization's own exchange
   (:meth:`SyncGuard.riding`, under
   :data:`~gradpress.algorithms.alarm.STATE_FLAGS_KEY`; :attr:`SyncGuard.extra`
   for :func:`~gradpress.algorithms.presence.sync_agreeing`);
3. right after it, before anything is applied (:meth:`SyncGuard.check`):
   ``raise``: every rank raises the same ``FloatingPointError`` naming the
   tensor; the result says whether the engine dropped the exchange;
4. the algorithm applies the average (its own business: a dropped
   synchronization puts the parameters back at the agreed point and leaves
   the algorithm's own state as it was);
5. :meth:`SyncGuard.settle`: a dropped synchronization puts this rank's
   optimizer state and buffers back to its copy (:meth:`LocalCopy.restore`:
   the period never happened); otherwise the buffers (and whatever else is
   averaged plain) are averaged and the copy is refreshed
   (:meth:`LocalCopy.take`).

What a synchronization covers (``idx``: the parameters whose optimizer
state it checks, default all; ``buffers``: whether it checks, restores and
refreshes the buffers) is given once, to :meth:`SyncGuard.before`. Streaming
DiLoCo uses steps 1-3 only: its merge restores every fragment and refreshes
only the finite part of its copy (:mod:`gradpress.algorithms.streaming`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from gradpress.algorithms.alarm import STATE_FLAGS_KEY, riding

if TYPE_CHECKING:
    from gradpress.algorithms.exchange_helpers import ExchangeHelpers

__all__ = ["SyncGuard"]


class SyncGuard:
    """``algo``'s ``nonfinite`` protocol around one synchronization that
    covers the optimizer state of the parameters ``idx`` (None: all) and,
    with ``buffers``, the floating buffers. Build it with :meth:`before`."""

    def __init__(self, algo: ExchangeHelpers, idx: Iterable[int] | None = None, buffers: bool = True) -> None:
        self.algo = algo
        self.idx = None if idx is None else list(idx)
        self.buffers = buffers
        #: this rank's ``nonfinite='raise'`` flags (None in the other modes, or with nothing to check)
        self.flags: torch.Tensor | None = None

    @classmethod
    @torch.no_grad()
    def before(cls, algo: ExchangeHelpers, deltas: Sequence[torch.Tensor], idx: Iterable[int] | None = None,
               buffers: bool = True) -> SyncGuard:
        """Step 1, before the exchange: with ``skip``, make this rank's
        outgoing ``deltas`` non-finite where its covered state or buffers
        newly are (in place); with ``raise``, take this rank's flags (on
        ``deltas[0]``'s device, in its dtype). No host read."""
        guard = cls(algo, idx, buffers)
        if algo.restart is not None:
            algo.restart.flag_into(deltas, guard.idx, buffers)
        if algo.alarm is not None:
            guard.flags = algo.alarm.flags(deltas[0], guard.idx, buffers)
        return guard

    def riding(self, keys: Sequence[str], tensors: Sequence[torch.Tensor]) -> tuple[list[str], list[torch.Tensor]]:
        """Step 2: the synchronization's engine keys and tensors with the
        flags riding in them (unchanged without flags)."""
        return riding(keys, tensors, self.flags)

    @property
    def extra(self) -> list[tuple[str, torch.Tensor]]:
        """Step 2 for :func:`~gradpress.algorithms.presence.sync_agreeing`'s
        ``extra``: the flags as a (key, tensor) pair, or nothing."""
        return [] if self.flags is None else [(STATE_FLAGS_KEY, self.flags)]

    @property
    def skipped(self) -> bool:
        """Whether the engine dropped the last exchange (``nonfinite='skip'``)."""
        engine = self.algo.engine
        return engine is not None and engine.last_step_skipped

    def check(self, where: str) -> bool:
        """Step 3, right after the exchange and before anything is applied:
        with ``raise``, every rank raises the same ``FloatingPointError``
        when the averaged flags mark a covered tensor not finite on some
        rank (``where``: the step, in the message). Returns :attr:`skipped`."""
        if self.algo.alarm is not None:
            self.algo.alarm.check(self.flags, where, self.idx, self.buffers)
        return self.skipped

    @torch.no_grad()
    def settle(self, plain: list[torch.Tensor]) -> bool:
        """Step 5, once the average is applied: a dropped synchronization
        puts this rank's covered optimizer state and buffers back to its copy
        (``skip``); otherwise ``plain`` (the buffers, and what else the
        synchronization averages uncompressed) is averaged and the copy
        refreshed. Returns whether the synchronization went through."""
        restart = self.algo.restart
        if self.skipped and restart is not None:
            restart.restore(self.idx, self.buffers)
            return False
        self.algo.average_plain(plain)
        if restart is not None:
            restart.take(self.idx, self.buffers)
        return True
