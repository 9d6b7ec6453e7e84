"""What ``nonfinite='skip'`` restores when it drops a model-averaging
synchronization (local SGD, DiLoCo, Streaming DiLoCo).

A synchronization that the engine drops (some rank's delta or outer
gradient was not finite) puts every replica's parameters back where every
rank agreed last (the anchor, ``theta``). The local steps between
synchronizations are not guarded: the NaN/Inf gradient that made the delta
non-finite also went into that rank's optimizer state (momentum, Adam's
moments) and, through the following forward passes, into its floating
buffers (BatchNorm statistics). Parameters alone back at the anchor then
stepped with that state give NaN again at the next local step, every later
synchronization is dropped too, and the run is dead while it looks alive.

So, with ``skip``, each rank keeps its own copy of what the local steps
change besides the parameters, taken whenever its parameters are set to
the agreed point (:meth:`LocalCopy.take`): the local optimizer's
per-parameter state (every entry: momentum buffers, moments, step counts)
and the model's buffers. A dropped synchronization puts them back
(:meth:`LocalCopy.restore`) on every rank, so the period is undone as a
whole: the run continues as if its local steps had never happened (their
batches are consumed; the step counter, the period schedule and the
optimizer's ``param_groups``, hence a learning-rate schedule, go on).
Cost: one copy of the optimizer's state and buffers per rank, on their
device (Adam: two parameter-sized tensors), refreshed at every
synchronization; nothing without ``skip``.

What drops a synchronization: some rank's delta, *or its optimizer state or
floating buffers*, not finite. A rank's state can go non-finite while its
parameters stay finite: a gradient entry of 1e20 in fp32 (finite) overflows
Adam's ``exp_avg_sq`` to Inf and that entry's update becomes 0; an
overflowed activation under fp16/bf16 autocast puts Inf into BatchNorm's
running statistics, which the training forward pass does not use. Such a
synchronization used to go through: averaged buffers (and with local SGD's
averaged optimizer state, the moments) carried the Inf to every rank;
state kept local stayed poisoned on that rank for good. Now, before the
exchange, :meth:`LocalCopy.flag_into` makes one element of the rank's
outgoing delta NaN where one of its state tensors or buffers is not
finite, so the engine's own verdict, which every rank already agrees on,
drops the whole synchronization and the period is undone as above; unless
this rank's copy of that same tensor is itself not finite (in a synchronous
phase, ``switch``, a finite 1e200 gradient entry, averaged, overflows Adam's
``exp_avg_sq`` on every rank alike, so the Inf is in every rank's copy at the
switch): restoring it would not help, and every later synchronization would
be dropped (the replicas would never meet again), so such a tensor drops
nothing. It is asked per tensor: a non-finite copy of one tensor does not
hide a fault in another (when the copy as a whole was asked, it did, and
local SGD averaged the Inf into every rank). Cost, with ``skip`` only: one
``aminmax`` read of each optimizer state tensor and buffer, and of its copy,
per synchronization, on its device (Adam: four parameter-sized reads), no
host read, no collective and no byte of its own.

The synchronous phase itself
(:meth:`~gradpress.algorithms.base.Algorithm.ddp_step`) uses the same copy
for the buffers: a buffer newly non-finite on some rank drops the step
(:meth:`LocalCopy.flag_into` with no parameter), and a dropped step puts
every rank's buffers back to their copy, the previous step's average,
refreshed at every step that goes through (an Inf running variance used to
be averaged into every rank, and the statistics of a dropped step too).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from gradpress.compress.base import all_finite

if TYPE_CHECKING:
    from gradpress.algorithms.base import Algorithm

__all__ = ["LocalCopy"]


def _clone(value: Any) -> Any:
    return value.detach().clone() if torch.is_tensor(value) else copy.deepcopy(value)


def _placed(value: Any, param: torch.Tensor, key: Any, group: Mapping[str, Any]) -> Any:
    """A loaded state value where ``Optimizer.load_state_dict`` puts it (checkpoints load with
    ``map_location='cpu'``): a step count stays (on the CPU) unless ``capturable`` or ``fused``;
    the rest goes to the parameter's device (floating values in its dtype)."""
    if not torch.is_tensor(value):
        return copy.deepcopy(value)
    if key == "step":
        if group.get("capturable", False) or group.get("fused", False):
            return value.to(dtype=torch.float32, device=param.device, copy=True)
        return value.detach().clone()
    if param.is_floating_point() and value.is_floating_point():
        return value.to(dtype=param.dtype, device=param.device, copy=True)
    return value.to(device=param.device, copy=True)


def _stacked_by_device(flags: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The 0-d bool ``flags``, one 1-d stack per device they are on (no host read, no copy between devices)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for f in flags:
        by_device.setdefault(f.device, []).append(f)
    return [torch.stack(fs) for fs in by_device.values()]


def _finite_by_device(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Per device of ``tensors``, a 0-d bool tensor there: its floating tensors are all finite (no host read)."""
    return [s.all() for s in _stacked_by_device(all_finite(t) for t in tensors if t.is_floating_point() and t.numel())]


def _newly_not_finite(now: torch.Tensor, then: Any) -> torch.Tensor | None:
    """A 0-d bool on ``now``'s device: ``now`` is not finite while its copy ``then`` is (or is none); None
    when ``now`` is not a floating tensor with entries (integer buffers, step counts kept as ints)."""
    if not now.is_floating_point() or not now.numel():
        return None
    bad = ~all_finite(now)
    if torch.is_tensor(then) and then.is_floating_point() and then.numel():
        bad = bad & all_finite(then).to(bad.device)
    return bad


def _all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every floating tensor of ``tensors`` is finite (one host read per device)."""
    return all(bool(f) for f in _finite_by_device(tensors))


class LocalCopy:
    """This rank's copy of the optimizer state of ``params`` and of
    ``buffers`` at the last agreed point."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                 buffers: Iterable[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.params = list(params)
        self.buffers = list(buffers)
        #: per parameter: its optimizer state (None: it had none), in ``params``' order
        self.states: list[dict[str, Any] | None] = [None] * len(self.params)
        self.saved_buffers: list[torch.Tensor] = [b.detach().clone() for b in self.buffers]

    @classmethod
    def for_skip(cls, algo: Algorithm) -> LocalCopy | None:
        """``algo``'s copy (its local optimizer, trainable parameters and
        buffers), taken now, when its engine drops non-finite exchanges
        (``nonfinite='skip'``); None otherwise (nothing is copied)."""
        if algo.engine is None or algo.engine.nonfinite != "skip":
            return None
        local = cls(algo.optimizer, [p for _, p in algo.named], algo.model.buffers())
        local.take()
        return local

    def load_extra(self, state: Mapping[str, Any], what: str) -> None:
        """From an algorithm's saved extra state: its ``restart`` entry, or,
        for a checkpoint written before there was one, the state as loaded
        (exact at a synchronization: the model and optimizer load before the
        algorithm), not this fresh run's (empty state, initial buffers)."""
        if "restart" in state:
            self.load_state_dict(state["restart"], what)
        else:
            self.take()

    @torch.no_grad()
    def take(self, idx: Iterable[int] | None = None, buffers: bool = True) -> None:
        """Copy the state of the parameters ``idx`` (default: all) and, with
        ``buffers``, the buffers."""
        for i in range(len(self.params)) if idx is None else idx:
            state = self.optimizer.state.get(self.params[i])
            self.states[i] = {k: _clone(v) for k, v in state.items()} if state else None
        if buffers:
            for saved, b in zip(self.saved_buffers, self.buffers):
                saved.copy_(b)

    @torch.no_grad()
    def restore(self, idx: Iterable[int] | None = None, buffers: bool = True) -> None:
        """Put the copies back (a parameter that had no state loses the one
        it gained since); the copies stay for another restore."""
        for i in range(len(self.params)) if idx is None else idx:
            p, saved = self.params[i], self.states[i]
            if saved is None:
                self.optimizer.state.pop(p, None)
            else:
                self.optimizer.state[p] = {k: _clone(v) for k, v in saved.items()}
        if buffers:
            for saved_b, b in zip(self.saved_buffers, self.buffers):
                b.copy_(saved_b)

    def _state_tensors(self, idx: Iterable[int] | None) -> list[torch.Tensor]:
        return [v for i in (range(len(self.params)) if idx is None else idx)
                for v in self.optimizer.state.get(self.params[i], {}).values() if torch.is_tensor(v)]

    @torch.no_grad()
    def flag_into(self, deltas: Sequence[torch.Tensor], idx: Iterable[int] | None = None,
                  buffers: bool = True) -> None:
        """Make this rank's outgoing ``deltas`` non-finite (one element NaN)
        where one of its optimizer state tensors of the parameters ``idx``
        (default: all) or, with ``buffers``, one of its floating buffers is
        not finite while this copy of that same tensor is (or there was none),
        so the engine's own verdict on the exchange (every rank agrees on it)
        drops the whole synchronization and :meth:`restore` undoes the period,
        as for a non-finite delta. A tensor whose copy is itself not finite
        (an Adam moment that overflowed in a synchronous phase, alike on
        every rank) drops nothing: restoring it would not help, and every
        later synchronization would be dropped; it hides no fault of another
        tensor (the copy as a whole was asked first: one Inf tensor there let
        an overflowed Adam moment through for good). One ``aminmax``
        read per tensor and per copied tensor, on its device; no host read
        and no collective of its own."""
        target = next((d for d in deltas if d.numel()), None)
        if target is None:
            return
        idx = range(len(self.params)) if idx is None else list(idx)
        pairs = [(v, (self.states[i] or {}).get(k)) for i in idx
                 for k, v in self.optimizer.state.get(self.params[i], {}).items() if torch.is_tensor(v)]
        if buffers:
            pairs += list(zip(self.buffers, self.saved_buffers))
        stacks = _stacked_by_device(f for f in (_newly_not_finite(now, then) for now, then in pairs) if f is not None)
        if not stacks:
            return
        bad = torch.stack([s.any().to(target.device) for s in stacks]).any()
        target[(0,) * target.dim()].masked_fill_(bad, float("nan"))

    def finite(self, idx: Iterable[int]) -> bool:
        """Whether the parameters ``idx`` and their optimizer state are finite on this rank."""
        idx = list(idx)
        return _all_finite([self.params[i].detach() for i in idx] + self._state_tensors(idx))

    def buffers_finite(self) -> bool:
        """Whether the floating buffers are finite on this rank."""
        return _all_finite(self.buffers)

    def state_dict(self) -> dict[str, Any]:
        return {"states": [None if s is None else {k: _clone(v) for k, v in s.items()} for s in self.states],
                "buffers": [b.clone() for b in self.saved_buffers]}

    def load_state_dict(self, state: Mapping[str, Any], what: str) -> None:
        states, buffers = state.get("states"), state.get("buffers")
        if (not isinstance(states, list) or len(states) != len(self.params) or not isinstance(buffers, list)
                or [tuple(b.shape) for b in buffers] != [tuple(b.shape) for b in self.saved_buffers]):
            raise ValueError(f"{what} state: the copy of the optimizer state and buffers that nonfinite='skip' "
                             "restores is missing or of another model")
        groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        self.states = [None if s is None else {k: _placed(v, p, k, groups.get(id(p), {})) for k, v in s.items()}
                       for p, s in zip(self.params, states)]
        for saved, b in zip(self.saved_buffers, buffers):
            saved.copy_(b)
