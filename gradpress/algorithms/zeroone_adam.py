"""``zeroone_adam``: 0/1 Adam, variance updated at exponentially sparser
steps, compressed gradients in between, then local steps.

Lu et al. 2022, "Maximizing Communication Efficiency for Large-scale
Training via 0/1 Adam" (ICLR 2023); the schedule follows DeepSpeed's
``ZeroOneAdam`` (parameter names and defaults are its own). Step ``t``:

* ``t <= var_freeze_step`` (variance phase). The variance is updated only
  on the steps of T_v: the step is in T_v when ``t % I == 0`` for the
  current interval ``I`` (1 at first); after every ``var_update_scaler``
  (kappa) variance updates ``I`` doubles. On a T_v step the gradient is
  averaged exactly and ``m``, ``v`` are updated (Adam); on the other steps
  the gradient is averaged by the compressed exchange with worker- and
  server-side error feedback and only ``m`` is updated. Every step applies
  ``m / (sqrt(v) + eps)``; replicas stay identical.
* ``t > var_freeze_step`` (the variance is frozen: the adaptive freeze of
  the paper has already made its updates rare). Local steps: each worker
  updates ``m`` with its local gradient and its parameters; every ``H``
  steps (T_u) its change since the last synchronization, ``u = x - anchor``,
  is exchanged compressed as ``u * (sqrt(v) + eps)`` (minus the lr-weighted
  sum of its momenta), ``m`` becomes minus that average divided by the
  summed learning rates, and every replica becomes ``anchor + average /
  (sqrt(v) + eps)``, identical again. Exchanged values are zeroed where
  ``v == 0`` (coordinates that never had a gradient), as in 1-bit Adam.
  ``H`` starts at 1 and doubles every ``local_step_scaler`` steps up to
  ``local_step_clipper``. At the freeze the residuals are cleared (they held
  gradient errors, and now hold momentum errors), as DeepSpeed does.

A missing gradient (``.grad`` is None) on a local step skips that
parameter on that rank alone (no exchange to agree on); a synchronization
leaves alone a parameter no rank stepped since the previous one
(``stepped``, in the state; the flags ride in the synchronization's
exchange); elsewhere the agreed rule of
:mod:`gradpress.algorithms.compressed_adam` holds.

Bias correction and the exchange: :mod:`gradpress.algorithms.compressed_adam`
(``s``, the count of variance updates, is what corrects ``v``). Between
synchronizations the replicas differ; :meth:`eval_model` is then their
average (a plain allreduce, not counted).

``scaler=`` (fp16 autocast, :mod:`gradpress.algorithms.loss_scale`): the gradients are unscaled first;
in the variance phase an overflow on any rank skips the step on every rank, as in 1-bit Adam; a local step
that overflowed on one rank is, on that rank, a step without any gradient (counted, nothing moved: the
schedule and the summed lr stay the same on every rank), and its scaler backs off alone.

Invariants (tests/test_compressed_adam.py): with an identity compressor,
kappa past the run and no freeze, it is distributed Adam (float64); ``v``
never changes after ``var_freeze_step`` nor between T_v steps; replicas are
bit-identical after every synchronized step; resume is bit-identical.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gradpress.algorithms.compressed_adam import BIAS_PARAM, CompressedAdam
from gradpress.algorithms.registry import register
from gradpress.compress.base import Param
from gradpress.exchange.nonfinite import StepGuard

PARAMS = (
    # >= 1: the anchor of the local steps and the variance they divide by come from the variance phase
    Param("var_freeze_step", int, 100000, "integer >= 1", lambda v: v >= 1,
          "last step of the variance phase; local steps after it"),
    Param("var_update_scaler", int, 16, "integer >= 1", lambda v: v >= 1,
          "kappa: variance updates between doublings of their interval"),
    Param("local_step_scaler", int, 32678, "integer >= 1", lambda v: v >= 1,
          "steps between doublings of the local-step interval H"),
    Param("local_step_clipper", int, 16, "integer >= 1", lambda v: v >= 1, "largest local-step interval H"),
    BIAS_PARAM,
)

_COUNTERS = ("var_interval", "var_counter", "local_interval", "local_counter")


@register
class ZeroOneAdam(CompressedAdam):
    name = "zeroone_adam"
    PARAMS = PARAMS
    summary = ("0/1 Adam (Lu et al. 2022): variance updated at exponentially sparser steps with compressed "
               "gradients between, then frozen variance and compressed local steps")

    def setup(self) -> None:
        super().setup()
        self.var_interval, self.var_counter = 1, 0
        self.local_interval, self.local_counter = 1, 0
        self.lrs = [0.0] * len(self.named)  # summed lr since the last synchronization, per parameter
        self.anchor: list[torch.Tensor] = []  # the parameters at the last synchronization (local phase)
        #: per parameter: whether this rank stepped it since the last synchronization (local phase)
        self.stepped = [False] * len(self.named)
        self._synced = True

    @property
    def frozen(self) -> bool:
        return self.t >= self.var_freeze_step  # type: ignore[attr-defined]

    def eval_model(self) -> torch.nn.Module:
        return self.model if self._synced else self.consensus_model()

    @torch.no_grad()
    def step(self) -> None:
        if self.loss_scale is not None:  # fp16 loss scaling: unscaled before anything reads the gradients
            self.loss_scale.unscale()
        if self.frozen:
            self._local_step()
            return
        self._begin_step()
        grads = self.gradients()
        if self.t % self.var_interval == 0:
            present = self._exact_average(grads)
            if self.loss_scale is not None and self._overflowed(StepGuard.any_bad(grads)):  # the exact sums
                present = None
            if present is None:  # nonfinite='skip' (or a scaler's overflow) and a NaN/Inf sum on every rank
                self.t -= 1
                self._scaled_end()
                return
            self._moments(grads, update_v=True, present=present)
            self.var_counter += 1
            if self.var_counter == self.var_update_scaler:  # type: ignore[attr-defined]
                self.var_counter, self.var_interval = 0, self.var_interval * 2
        else:
            agreed = self._sync_agreeing(grads, [p.grad is not None for _, p in self.named])
            if self.loss_scale is not None and self.engine is not None and self._overflowed(
                    self.engine.guard.last_bad):
                agreed = None  # a scaler's: the engine's verdict (propagate: NaN on every rank)
            if agreed is None:  # nonfinite='skip' (or a scaler's overflow): every rank drops it
                self.t -= 1
                self._scaled_end()
                return
            present = agreed
            self._mask_unseen(grads)
            self._moments(grads, update_v=False, present=present)
        self._apply(present)
        if self.frozen:  # the next step is local: the residuals change meaning
            self.engine.feedback.residuals.clear()  # type: ignore[union-attr]
            self.anchor = [p.detach().clone() for _, p in self.named]
            self.stepped = [False] * len(self.named)
        self._scaled_end()

    @torch.no_grad()
    def _local_step(self) -> None:
        """A local Adam step: a parameter without a gradient on this rank
        stays (torch's skip, on this rank alone: nothing is exchanged to
        agree on), while every rank counts the step, so that the bias
        corrections stay equal on every rank. A step this rank's loss scaler
        skips (its gradient overflowed) is such a step for every parameter:
        counted (schedule, bias correction, summed lr), nothing moved."""
        self._begin_step()
        skipped = self.loss_scale is not None and self.loss_scale.found_inf()
        mine = [p.grad is not None and not skipped for _, p in self.named]
        self._moments(self.gradients(), update_v=False, present=mine)
        self._apply(mine, count=[True] * len(self.named))
        self.stepped = [a or b for a, b in zip(self.stepped, mine)]
        for i in range(len(self.named)):
            self.lrs[i] += self._hyper(i)[0]
        self._synced = False
        if self.t % self.local_interval == 0:
            self._synchronize()
        self.local_counter += 1
        if self.local_counter == self.local_step_scaler:  # type: ignore[attr-defined]
            self.local_counter = 0
            self.local_interval = min(self.local_step_clipper, self.local_interval * 2)  # type: ignore[attr-defined]
        self._scaled_end()

    def _synchronize(self) -> None:
        """Average ``u * denom`` compressed (``u = x - anchor``, this
        worker's change since the last synchronization), set ``m = -mean /
        sum(lr)`` and every replica to ``anchor + mean / denom``. The anchor
        is kept, not recovered as ``x - u``: that would differ between ranks
        by rounding."""
        denoms = [self._denom(i) for i in range(len(self.named))]
        change = [(p - a).mul_(d) for (_, p), a, d in zip(self.named, self.anchor, denoms)]
        present = self._sync_agreeing(change, self.stepped)
        if present is None:  # nonfinite='skip': the engine zeroed every change (the replicas go back to the anchor)
            present = [True] * len(self.named)
        self._mask_unseen(change)
        for i, ((_, p), a, u, d) in enumerate(zip(self.named, self.anchor, change, denoms)):
            if not present[i]:  # no rank stepped it since the last synchronization: p, m, residuals stay
                self.lrs[i] = 0.0
                continue
            if self.lrs[i] > 0:
                self.exp_avg[i].copy_(u).mul_(-self._bc1(i) / self.lrs[i])
            a.add_(u / d)
            p.copy_(a)
            self.lrs[i] = 0.0
        self.stepped = [False] * len(self.named)
        self._synced = True

    def phase_state(self) -> dict[str, Any]:
        return {**{k: getattr(self, k) for k in _COUNTERS}, "lrs": list(self.lrs),
                "anchor": [a.clone() for a in self.anchor], "synced": self._synced, "stepped": list(self.stepped)}

    def load_phase_state(self, state: Mapping[str, Any]) -> None:
        for k in _COUNTERS:
            setattr(self, k, int(state[k]))
        anchor = state["anchor"]
        if anchor and len(anchor) != len(self.named):
            raise ValueError(f"{self.name} state: anchor of another model ({len(anchor)} tensors, "
                             f"the model has {len(self.named)})")
        self.lrs = [float(v) for v in state["lrs"]]
        self.anchor = [s.to(p.device, p.dtype).clone() for (_, p), s in zip(self.named, anchor)]
        self._synced = bool(state["synced"])
        # a state saved before these flags: every parameter counts as stepped (exchanged, as that code did)
        stepped = [bool(b) for b in state.get("stepped", [True] * len(self.named))]
        if len(stepped) != len(self.named):
            raise ValueError(f"{self.name} state: 'stepped' has {len(stepped)} flags, the model has "
                             f"{len(self.named)} parameters")
        self.stepped = stepped
