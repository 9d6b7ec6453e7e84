"""``nonfinite='raise'`` for what a model-averaging synchronization carries
or leaves besides its deltas (local SGD, DiLoCo, Streaming DiLoCo, and the
synchronous phase of ``postlocalsgd`` and DiLoCo's ``switch``).

The engine raises when some rank's exchanged tensor (delta, outer gradient,
gradient) is not finite. A rank's optimizer state or floating buffers can
go non-finite while its parameters stay finite: a finite but huge gradient
entry overflows Adam's ``exp_avg_sq`` to Inf (that entry's update becomes 0,
the entry is frozen for good); an overflowed activation under fp16/bf16
autocast puts Inf into BatchNorm's running statistics, which the training
forward pass does not read. The synchronization then went through under
``raise``: the buffers (and with local SGD's averaged optimizer state, the
moments) carried the Inf to every rank, state kept local stayed poisoned on
that rank, and the run went on. ``skip`` drops such a synchronization
(:mod:`gradpress.algorithms.restart`); ``raise`` now fails it.

How every rank raises the same error: one flag per parameter (its optimizer
state, every floating tensor of it) and per floating buffer that the
synchronization checks, 1 where this rank's is not finite, rides in the
synchronization's own exchange as one more plain 1-D tensor (key
:data:`STATE_FLAGS_KEY`; no collective of its own). The averaged flags are
the same on every rank, so every rank raises the same
``FloatingPointError``, naming each tensor some rank holds non-finite,
after the exchange (every rank has left its collectives) and before
anything is applied. Cost, with ``raise`` only: one ``aminmax`` read of each
checked tensor, that many flags in the parameters' dtype in the exchange
(counted in ``stats``), and one host read of them per synchronization
(``raise`` reads the engine's flags already).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from gradpress.compress.base import all_finite

if TYPE_CHECKING:
    from gradpress.algorithms.base import Algorithm

__all__ = ["STATE_FLAGS_KEY", "StateAlarm", "riding"]

#: the engine key of the per-tensor "not finite on this rank" flags (1-D: plain)
STATE_FLAGS_KEY = "gradpress/state-nonfinite"


def riding(keys: Sequence[str], tensors: Sequence[torch.Tensor],
           flags: torch.Tensor | None) -> tuple[list[str], list[torch.Tensor]]:
    """A synchronization's engine keys and tensors with this rank's state
    ``flags`` (:meth:`StateAlarm.flags`) riding in it under
    :data:`STATE_FLAGS_KEY` (1-D: averaged plain, in place); unchanged
    without flags (``nonfinite`` is not ``raise``)."""
    if flags is None:
        return list(keys), list(tensors)
    return [*keys, STATE_FLAGS_KEY], [*tensors, flags]


class StateAlarm:
    """The optimizer state of ``named`` parameters and the floating
    ``buffers`` a synchronization checks under ``nonfinite='raise'``."""

    def __init__(self, optimizer: torch.optim.Optimizer, named: Sequence[tuple[str, torch.Tensor]],
                 buffers: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.optimizer = optimizer
        self.named = list(named)
        self.buffers = [(n, b) for n, b in buffers if b.is_floating_point() and b.numel()]

    @classmethod
    def for_raise(cls, algo: Algorithm) -> StateAlarm | None:
        """``algo``'s alarm when its engine raises on non-finite exchanges
        (``nonfinite='raise'``); None otherwise (nothing is checked)."""
        if algo.engine is None or algo.engine.nonfinite != "raise":
            return None
        return cls(algo.optimizer, algo.named, algo.model.named_buffers())

    def _labels(self, idx: Sequence[int], buffers: bool) -> list[str]:
        return ([f"optimizer state of {self.named[i][0]!r}" for i in idx]
                + [f"buffer {n!r}" for n, _ in (self.buffers if buffers else [])])

    @torch.no_grad()
    def flags(self, like: torch.Tensor, idx: Iterable[int] | None = None, buffers: bool = True) -> torch.Tensor | None:
        """This rank's flags (1 where not finite), on ``like``'s device in its
        dtype, for the optimizer state of the parameters ``idx`` (default:
        all) and, with ``buffers``, the floating buffers; None when there is
        nothing to check. No host read."""
        idx = range(len(self.named)) if idx is None else list(idx)
        bad = []
        for i in idx:
            state = self.optimizer.state.get(self.named[i][1], {})
            ts = [v for v in state.values() if torch.is_tensor(v) and v.is_floating_point() and v.numel()]
            bad.append(torch.stack([(~all_finite(t)).to(like.device) for t in ts]).any() if ts
                       else torch.zeros((), dtype=torch.bool, device=like.device))
        if buffers:
            bad += [(~all_finite(b)).to(like.device) for _, b in self.buffers]
        return torch.stack(bad).to(like.dtype) if bad else None

    def check(self, averaged: torch.Tensor | None, where: str, idx: Iterable[int] | None = None,
              buffers: bool = True) -> None:
        """Raise ``FloatingPointError`` (the same on every rank) when the
        ``averaged`` flags (:meth:`flags` of the same ``idx`` and ``buffers``,
        averaged over the group) mark a tensor not finite on some rank."""
        if averaged is None:
            return
        idx = range(len(self.named)) if idx is None else list(idx)
        names = [n for n, b in zip(self._labels(list(idx), buffers), (averaged > 0).tolist()) if b]
        if names:
            raise FloatingPointError(
                f"gradpress: non-finite (NaN/Inf) {', '.join(names)} at {where} on at least one rank "
                "(nonfinite='raise': the synchronization would carry it to every rank, or leave it in that rank "
                "for good; use 'skip' to drop such synchronizations and undo the period)")
