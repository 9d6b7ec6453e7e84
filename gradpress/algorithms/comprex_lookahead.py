"""Look-ahead for stale exchanges: each rank computes its gradient at the
weights the stale update will be applied to, predicted from its own
momentum.

With staleness s the update applied at step t is the average of gradients
computed s steps earlier, at weights that have moved since. Under heavy-ball
momentum this delay is what breaks training: on a quadratic with curvature h,
momentum mu and step lr, synchronous heavy ball is stable for
``lr * h < 2 (1 + mu)`` (3.8 at mu = 0.9), the one-step-stale version only for
``lr * h < 1 - mu`` (0.1): 38x less (gradpress measured it: mnist1d-cnn,
momentum 0.9, staleness 1 without compression ends at chance). Mitliagkas et
al. 2016 ("Asynchrony begets momentum") describe the same interaction.

The remedy is weight prediction (SpecTrain, Chen et al. 2018; PipeMare,
Yang et al. 2021): run the forward/backward pass at ``x_hat = x - (the
updates still in flight)`` instead of ``x``. Each update in flight is the
average over ranks of ``C(m_r + e_r)``; its local stand-in is this rank's
momentum buffer ``m_r`` at that exchange's launch (the quantity whose
compressed average the update is; with error feedback the applied updates
sum to the momenta minus the residual). Without compression and with the
same data on every rank the prediction is exact, and the stale method then
evaluates its gradients at exactly the iterates of synchronous heavy ball
(tested in float64).

Invariants: the *shared* weights ``x`` are kept here (``shadow``) and are
bit-identical on every rank: every rank subtracts the same averaged updates
from them. The model's parameters hold the rank-local prediction ``x_hat``
between steps, which is the point of the method; evaluation, re-broadcast
and :meth:`write_back` (at ``close``) use ``x``. A checkpoint holds ``x``
and the stand-ins of the exchanges in flight, so a resumed run is
bit-identical.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradpress.algorithms.comprex_optim import copies_like

__all__ = ["LookAhead"]


class LookAhead:
    """The shared weights of a stale exchange and the prediction the model
    holds between steps; see the module doc."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def apply(self, updates: Sequence[torch.Tensor]) -> None:
        """``x <- x - u`` for an averaged update (identical on every rank)."""
        torch._foreach_sub_(self.shadow, [u.to(x.dtype) for x, u in zip(self.shadow, updates)])

    @torch.no_grad()
    def predict(self, in_flight: Sequence[Sequence[torch.Tensor]]) -> None:
        """Parameters <- ``x`` minus this rank's stand-in of every update in flight."""
        for p, x in zip(self.params, self.shadow):
            p.copy_(x)
        for proxy in in_flight:
            torch._foreach_sub_(self.params, [u.to(p.dtype) for p, u in zip(self.params, proxy)])

    @torch.no_grad()
    def write_back(self) -> None:
        """Parameters <- the shared weights ``x``."""
        for p, x in zip(self.params, self.shadow):
            p.copy_(x)

    def state_dict(self) -> list[torch.Tensor]:
        return [x.clone() for x in self.shadow]

    def load_state_dict(self, shadow: Sequence[torch.Tensor]) -> None:
        self.shadow = copies_like(shadow, self.shadow, "'shared_weights'")
