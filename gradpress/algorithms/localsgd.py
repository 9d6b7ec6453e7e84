"""``localsgd:period=H``: local SGD, parameters averaged every H steps;
``postlocalsgd:period=H,switch=N,warmup=W``: the same after N synchronous steps.

Local SGD / periodic model averaging (Stich 2019, "Local SGD Converges Fast
and Communicates Little"; Lin et al. 2020, "Don't Use Large Mini-Batches,
Use Local SGD"): every worker takes H optimizer steps on its own data, then
the workers average their parameters. gradpress averages the parameter
*delta* since the last synchronization, ``x_i - x_anchor``, through the
exchange engine, so any compressor with error feedback shrinks it further;
then every worker sets ``x = x_anchor + mean(delta)`` and the anchor moves
there. Floating buffers (BatchNorm statistics) are averaged plain at the
same time.

The local optimizer's floating state (momentum buffers, Adam's moments) can
be averaged too, plain, at every synchronization (``optimizer_state=average``):
with Adam the workers' moments drift apart between synchronizations and the
restarted replicas then step with inconsistent scales. On mnist1d-cnn
(2 workers, Adam, H = 8) keeping them local (``optimizer_state=local``, the
papers' plain form, as PyTorch's ``PostLocalSGDOptimizer``) ends 1.3 points
below DDP on average over 5 seeds, averaging them matches DDP
(docs/results/localsgd-mnist1d.md); the price is one more model-sized plain
exchange per moment at each synchronization (counted), which would swamp a
compressed delta. So ``auto`` (the default) averages the state when the
exchange is uncompressed (an identity compressor) and keeps it local when a
compressor shrinks the deltas. The state is averaged per parameter, for the
parameters whose state every rank holds (a rank that never stepped one has
none; it then stays local): :meth:`LocalSGD.optimizer_state_tensors`. A
synchronization that ``nonfinite='skip'`` drops (some rank's delta, optimizer
state or floating buffers are not finite) restarts every replica from the anchor and averages no state; each
rank's optimizer state and buffers go back to its copy taken at the anchor
(:mod:`gradpress.algorithms.restart`: the period never happened). With
``nonfinite='raise'`` such a synchronization raises on every rank, naming
the tensor (:mod:`gradpress.algorithms.alarm`).
Between synchronizations the replicas differ: :meth:`eval_model` evaluates
their average (:meth:`~gradpress.algorithms.base.Algorithm.consensus_model`).

Two schedules from Lin et al. 2020, selected by the name ``postlocalsgd``
(as PyTorch names its ``PostLocalSGDOptimizer``); ``localsgd`` is the
same class with both off:

* ``switch=N`` (post-local SGD): the first N steps are synchronous, exactly
  as DDP: the *gradients* are averaged through the engine (keys
  ``grad:<name>``, compressed like the deltas, their own residuals) before
  every optimizer step, so parameters and optimizer state stay identical on
  every rank (the floating buffers are averaged too; a step ``nonfinite=skip``
  drops, for a gradient or a floating buffer not finite on some rank, steps
  no optimizer and puts every rank's buffers back to the previous step's
  average: :meth:`~gradpress.algorithms.base.Algorithm.ddp_step`); local SGD
  starts at step N + 1 from that common point.
* ``warmup=W``: after the switch, the period grows linearly from 1 to H
  over W steps (period ``1 + floor((H - 1) * min(s, W) / W)`` at the s-th
  local step), instead of jumping to H.

Invariants: after every synchronization all replicas hold bit-identical
parameters (the engine's average is bit-identical on every rank and the
anchor is common); during the first ``switch`` steps they also hold
bit-identical optimizer state. With H = 1, no compression and plain SGD the
parameters equal synchronous DDP SGD's up to rounding (x - lr g vs. the
average of deltas): the test checks it in float64.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gradpress.algorithms.alarm import StateAlarm
from gradpress.algorithms.base import Algorithm
from gradpress.algorithms.presence import flags
from gradpress.algorithms.registry import register
from gradpress.algorithms.restart import LocalCopy
from gradpress.algorithms.sync_guard import SyncGuard
from gradpress.compress.base import Param

GRAD = "grad:"
#: the engine key of the per-parameter "this rank holds no optimizer state" flags (1-D: plain)
STATE_MISSING_KEY = "gradpress/state-missing"


def warmed_period(period: int, warmup: int, local_steps: int) -> int:
    """The period in force after ``local_steps`` local steps when it grows
    linearly from 1 to ``period`` over ``warmup`` steps (``warmup=0``: always
    ``period``): ``1 + floor((period - 1) * min(s, W) / W)``. Shared by every
    model-averaging algorithm with a ``warmup`` parameter."""
    if not warmup:
        return period
    return 1 + (period - 1) * min(local_steps, warmup) // warmup


@register
class LocalSGD(Algorithm):
    name = "localsgd"
    PARAMS = (
        Param("period", int, 8, "integer >= 1", lambda v: v >= 1, "local steps between averages (H)"),
        Param("optimizer_state", str, "auto", "auto, average or local", lambda v: v in ("auto", "average", "local"),
              "average the local optimizer's floating state (momentum, Adam moments) at each sync, or keep it "
              "local; auto: average when the exchange is uncompressed, local when a compressor shrinks it"),
    )
    summary = "local SGD: H local optimizer steps, then the (compressed) parameter delta is averaged"
    #: post-local SGD: synchronous steps first (``postlocalsgd`` makes them parameters)
    switch = 0
    #: steps over which the period grows from 1 to H after the switch
    warmup = 0

    def exchanged_params(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        own = super().exchanged_params()
        if self.switch:
            own += [(GRAD + n, shape, dtype) for n, shape, dtype in own]
        return own

    def after_broadcast(self) -> None:
        #: the parameters every rank agreed on at the last synchronization
        self.anchor = [p.detach().clone() for _, p in self.named]
        #: local steps since the last average (or since the switch)
        self.since = 0
        #: nonfinite=skip: this rank's optimizer state and buffers at the anchor (a dropped sync restores them)
        self.restart = LocalCopy.for_skip(self)
        #: nonfinite=raise: a non-finite optimizer state or buffer on some rank raises at a synchronization
        self.alarm = StateAlarm.for_raise(self)

    def current_period(self) -> int:
        """The period in force at the current local step (warm-up aware)."""
        return warmed_period(self.period, self.warmup, self._steps - self.switch)  # type: ignore[attr-defined]

    def step(self) -> None:
        if self._steps < self.switch:
            self.synchronous_step()
            return
        self.local_step()
        self.since += 1
        if self.since >= self.current_period():
            self.average()

    @torch.no_grad()
    def synchronous_step(self) -> None:
        """DDP's step: average the gradients, then the (identical) optimizer step."""
        self.ddp_step(keys=[GRAD + n for n, _ in self.named])
        if self._steps == self.switch:
            for a, (_, p) in zip(self.anchor, self.named):
                a.copy_(p)
            if self.restart is not None:
                self.restart.take()

    @torch.no_grad()
    def average(self) -> None:
        """Average the parameter deltas since the last synchronization (and
        the floating buffers, and with :attr:`averages_optimizer_state` the
        optimizer's state) over the group; every replica restarts there."""
        params = [p for _, p in self.named]
        deltas = [p.detach() - a for p, a in zip(params, self.anchor)]
        # nonfinite: a non-finite optimizer state or buffer drops (skip) or fails (raise) the synchronization too
        guard = SyncGuard.before(self, deltas)
        names = [n for n, _ in self.named]
        states = self.optimizer_state_tensors() if self.averages_optimizer_state else None
        if states is not None and deltas and self.world_size > 1:
            # 1 where this rank holds no state for the parameter; averaged with the deltas (no collective of its
            # own): above 0 where some rank lacks it (a call nonfinite=skip dropped zeroed them: no state is
            # averaged then, each rank's is restored below)
            missing = flags([not ts for ts in states], deltas[0])
            keys, tensors = guard.riding([*names, STATE_MISSING_KEY], [*deltas, missing])
            self.sync(tensors, keys=keys)
            states = [ts for ts, gone in zip(states, (missing > 0).tolist()) if not gone]
        else:
            keys, tensors = guard.riding(names, deltas)
            self.sync(tensors, keys=keys)
        guard.check(f"step {self._steps}")  # raise: before anything is applied, the same error on every rank
        for p, a, d in zip(params, self.anchor, deltas):
            a.add_(d)
            p.copy_(a)
        self.since = 0
        # dropped: the period never happened, each rank's optimizer state and buffers as they were at the anchor
        # (the NaN/Inf that made some delta non-finite is in that rank's momentum and BatchNorm statistics);
        # otherwise the buffers and the states every rank holds are averaged plain
        guard.settle(list(self.model.buffers()) + [t for ts in states or [] for t in ts])

    def optimizer_state_tensors(self) -> list[list[torch.Tensor]]:
        """Per trainable parameter, in the model's order, the optimizer's
        floating state tensors for it (momentum, Adam's moments) in key order;
        empty where this rank holds none (it never stepped the parameter: its
        ``.grad`` was always None here). :meth:`average` averages a
        parameter's state only where every rank holds it (a flag per parameter
        rides in the deltas' exchange) and leaves it local elsewhere; after an
        exchange ``nonfinite='skip'`` dropped it averages none and restores
        each rank's copy from the anchor. (Taking
        the states in the optimizer's own order paired one parameter's momentum
        with another's when the ranks created them in different orders, and a
        rank with fewer states broke the collective.)"""
        out = []
        for _, p in self.named:
            state = self.optimizer.state.get(p, {})
            out.append([state[k] for k in sorted(state, key=str)
                        if torch.is_tensor(state[k]) and state[k].is_floating_point() and state[k].dim() > 0])
        return out

    @property
    def averages_optimizer_state(self) -> bool:
        """Whether each synchronization also averages the optimizer's state."""
        mode = self.optimizer_state  # type: ignore[attr-defined]
        return mode == "average" or (mode == "auto" and self.compressor.identity)

    def eval_model(self) -> torch.nn.Module:
        """Right after a synchronization the replicas are identical: the
        model itself; otherwise their average (collective)."""
        return self.model if self.since == 0 else self.consensus_model()

    def extra_state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"anchor": [a.clone() for a in self.anchor], "since": self.since}
        if self.restart is not None:
            out["restart"] = self.restart.state_dict()
        return out

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        anchor = state.get("anchor")
        if anchor is None or len(anchor) != len(self.anchor):
            raise ValueError("localsgd state: anchor missing or of another model")
        for a, saved in zip(self.anchor, anchor):
            a.copy_(saved)
        self.since = int(state.get("since", self._steps % self.period))
        if self.restart is not None:
            self.restart.load_extra(state, self.name)


@register
class PostLocalSGD(LocalSGD):
    name = "postlocalsgd"
    PARAMS = (
        *LocalSGD.PARAMS,
        Param("switch", int, 100, "integer >= 0", lambda v: v >= 0,
              "the first N steps are synchronous (gradients averaged, as DDP), then local SGD"),
        Param("warmup", int, 0, "integer >= 0", lambda v: v >= 0,
              "after the switch the period grows linearly from 1 to H over this many steps"),
    )
    summary = ("post-local SGD: synchronous (DDP) for the first N steps, then local SGD with period H "
               "(optionally warmed up from 1 to H)")
