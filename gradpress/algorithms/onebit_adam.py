"""``onebit_adam:freeze_step=T``: 1-bit Adam, exact Adam for T steps, then
the frozen variance and a compressed momentum exchange.

Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale Training
with Adam's Convergence Speed" (ICML). Algorithm 1 of the paper:

* warm-up, steps ``t <= T`` (15-25% of the run in the paper): exact Adam on
  the exactly averaged gradient, ``m <- b1 m + (1 - b1) g``,
  ``v <- b2 v + (1 - b2) g^2``;
* compression stage, ``t > T``: ``v`` is frozen; every worker updates its
  momentum with its *local* gradient, ``m_i <- b1 m + (1 - b1) g_i``, and
  the momenta are averaged by the compressed allreduce with error feedback
  on the worker side and on the server (chunk owner) side; every worker
  applies ``m / (sqrt(v) + eps)``. ``m`` is identical on every rank after
  the exchange, so the next step starts from the same momentum. Where
  ``v == 0`` (coordinates that never had a gradient: embedding rows of
  unseen tokens) the exchanged momentum is set to 0, since one bit cannot
  say 0 and ``m / eps`` would throw them away (DeepSpeed asks the user for
  an ``exp_avg_mask`` instead).

Compressor: ``efsignsgd:chunk=64`` by default (one bit per element plus
one fp32 scale per 64 consecutive elements of each partition, at the
worker and at the owner: 1.5 bits per element). Its scale is
``||x_k||_1 / |x_k|`` per chunk, the scale that minimises
``||x_k - s sign(x_k)||``; DeepSpeed's 1-bit Adam uses ``||x||_2 /
sqrt(d)`` with one scale per flattened buffer at the worker and one per
partition at the server. The finer scale is a deviation chosen for
accuracy: where a tensor mixes magnitudes (embedding rows, the q/k/v
blocks of an attention projection) it lowers the momentum's compression
error. 64 is the rule's choice (the best 3-seed mean at a 25% warm-up on
``charlm-transformer`` among the chunks tried, 0, 256 and 64, all >= 10x
fewer bytes than DDP); measurements and commands in
docs/results/compressed-adam-charlm-transformer.md.
Any registered compressor is allowed (``compressor="efsignsgd"`` for one
scale per partition, ``"topk:ratio=0.01"``...). The exchange
itself, bias correction and the optimizer contract are described in
:mod:`gradpress.algorithms.compressed_adam`.

``scaler=`` (fp16 autocast, :mod:`gradpress.algorithms.loss_scale`): the gradients are unscaled first;
an overflow on any rank reaches every rank (the warm-up's exact sums; the engine's ``propagate`` verdict
after it, ``StepGuard.last_bad``) and skips the step there as ``nonfinite='skip'`` does (moments, counts
and schedule as they were), then ``scaler.update()``: this class steps the parameters itself, so
``scaler.step`` (torch's Adam) is never called (tests/test_review_ampalgo.py).

Invariants (tests/test_compressed_adam.py): with an identity compressor and
``T`` past the end of the run this is distributed Adam (float64); with an
identity compressor it is Adam whose variance stops at step ``T``; ``v``
never changes after step ``T``; replicas are bit-identical after every
step; ``state_dict`` (``m``, ``v``, ``t``, both residuals, ``T``) resumes
bit-identically.
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
    # >= 1: with no warm-up v stays 0, every momentum is masked (v == 0) and no parameter ever moves
    Param("freeze_step", int, 100, "integer >= 1", lambda v: v >= 1,
          "exact-Adam warm-up steps, after which the variance is frozen (15-25% of the run in the paper)"),
    BIAS_PARAM,
)


@register
class OneBitAdam(CompressedAdam):
    name = "onebit_adam"
    PARAMS = PARAMS
    default_compressor = "efsignsgd:chunk=64"  # one scale per 64 elements (results page: the rule)
    summary = ("1-bit Adam (Tang et al. 2021): exact Adam warm-up, then frozen variance and the momentum "
               "exchanged compressed with worker- and server-side error feedback")

    @property
    def frozen(self) -> bool:
        """Whether the variance is frozen (the compression stage)."""
        return self.t >= self.freeze_step  # type: ignore[attr-defined]

    @torch.no_grad()
    def step(self) -> None:
        scale = self.loss_scale  # fp16 loss scaling: unscaled before anything reads the gradients
        if scale is not None:
            scale.unscale()
        skip = self.engine is not None and self.engine.nonfinite == "skip" or scale is not None
        compressed = self.frozen
        saved = [m.clone() for m in self.exp_avg] if skip else None
        self._begin_step()
        grads = self.gradients()
        if not compressed:
            present = self._exact_average(grads)
            if scale is not None and self._overflowed(StepGuard.any_bad(grads)):  # the exact sums carry it everywhere
                present = None
            if present is None:  # nonfinite='skip' (or the scaler's overflow) and a NaN/Inf sum on every rank
                self.t -= 1
                self._scaled_end()
                return
            self._moments(grads, update_v=True, present=present)
        else:
            # DDP's rule before the exchange (a missing gradient is a zero one); the flags ride in the exchange,
            # and a parameter no rank has gets its m back (kept by the ranks that lack it: then every rank)
            mine = [p.grad is not None for _, p in self.named]
            kept = {i: self.exp_avg[i].clone() for i, ok in enumerate(mine) if not ok}
            self._moments(grads, update_v=False, present=[True] * len(mine))
            agreed = self._sync_agreeing(self.exp_avg, mine)
            if scale is not None and self.engine is not None and self._overflowed(self.engine.guard.last_bad):
                agreed = None  # the engine's verdict (propagate: NaN on every rank)
            if agreed is None:  # nonfinite='skip' (or the scaler's overflow): every rank drops the step
                assert saved is not None
                for m, s in zip(self.exp_avg, saved):
                    m.copy_(s)
                self.t -= 1
                self._scaled_end()
                return
            present = agreed
            self._mask_unseen(self.exp_avg)
            for i, m in kept.items():
                if not present[i]:
                    self.exp_avg[i].copy_(m)
        self._apply(present)
        self._scaled_end()

    def phase_state(self) -> dict[str, Any]:
        return {"freeze_step": self.freeze_step}  # type: ignore[attr-defined]

    def load_phase_state(self, state: Mapping[str, Any]) -> None:
        saved = state.get("freeze_step")
        if saved is not None and int(saved) != self.freeze_step:  # type: ignore[attr-defined]
            raise ValueError(f"{self.name} state: freeze_step {saved} differs from this run's "
                             f"{self.freeze_step}")  # type: ignore[attr-defined]
