"""``localsgd:period=H``: local SGD, parameters averaged every H steps.

Local SGD / periodic model averaging (Stich 2019, "Local SGD Converges Fast
and Communicates Little"; Lin et al. 2020, "Don't Use Large Mini-Batches,
Use Local SGD"): every worker takes H optimizer steps on its own data, then
the workers average their parameters. gradpress averages the parameter
*delta* since the last synchronization, ``x_i - x_anchor``, through the
exchange engine, so any compressor with error feedback shrinks it further;
then every worker sets ``x = x_anchor + mean(delta)`` and the anchor moves
there. Floating buffers (BatchNorm statistics) are averaged plain at the
same time. The local optimizer's own state (momentum, Adam moments) stays
local, as in the papers.

Invariants: after every synchronization all replicas hold bit-identical
parameters (the engine's average is bit-identical on every rank and the
anchor is common). With H = 1, no compression and plain SGD the parameters
equal synchronous DDP SGD's up to rounding (x - lr g vs. the average of
deltas): the test checks it in float64.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gradpress.algorithms.base import Algorithm
from gradpress.algorithms.registry import register
from gradpress.compress.base import Param


@register
class LocalSGD(Algorithm):
    name = "localsgd"
    PARAMS = (
        Param("period", int, 8, "integer >= 1", lambda v: v >= 1, "local steps between averages (H)"),
    )
    summary = "local SGD: H local optimizer steps, then the (compressed) parameter delta is averaged"

    def after_broadcast(self) -> None:
        #: the parameters every rank agreed on at the last synchronization
        self.anchor = [p.detach().clone() for _, p in self.named]

    def step(self) -> None:
        self.local_step()
        if self._steps % self.period == 0:  # type: ignore[attr-defined]
            self.average()

    @torch.no_grad()
    def average(self) -> None:
        """Average the parameter deltas since the last synchronization (and
        the floating buffers) over the group; every replica restarts there."""
        params = [p for _, p in self.named]
        deltas = [p.detach() - a for p, a in zip(params, self.anchor)]
        self.sync(deltas)
        for p, a, d in zip(params, self.anchor, deltas):
            a.add_(d)
            p.copy_(a)
        self.average_plain(list(self.model.buffers()))

    def extra_state(self) -> dict[str, Any]:
        return {"anchor": [a.clone() for a in self.anchor]}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        anchor = state.get("anchor")
        if anchor is None or len(anchor) != len(self.anchor):
            raise ValueError("localsgd state: anchor missing or of another model")
        for a, saved in zip(self.anchor, anchor):
            a.copy_(saved)
