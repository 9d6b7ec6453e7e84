"""Error feedback: keep what the compressor dropped and add it back next time.

Residual memory (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019,
"Error Feedback Fixes SignSGD"): ``p = beta * e + gamma * g``; send ``C(p)``;
``e <- p - D(C(p))``.

Invariant: a non-finite gradient never enters the residual. When ``g`` has a
NaN/Inf, ``p`` is ``g`` alone (so the caller still sees the bad value and can
raise or skip) and ``e`` is left as it was. The check is a tensor op
(``torch.where`` on an ``isfinite().all()`` flag), not a host sync.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["ResidualMemory"]


class ResidualMemory:
    """Per-tensor residuals keyed by a stable tensor key (parameter name)."""

    def __init__(self, beta: float = 1.0, gamma: float = 1.0) -> None:
        self.beta = float(beta)
        self.gamma = float(gamma)
        self.residuals: dict[str, torch.Tensor] = {}
        self._pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def compensate(self, key: str, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(p, finite)``: the error-compensated tensor and a 0-d bool
        tensor saying whether ``grad`` was finite."""
        finite = torch.isfinite(grad).all()
        e = self.residuals.get(key)
        g = grad if self.gamma == 1.0 else grad * self.gamma
        if e is None:
            return g.clone() if g is grad else g, finite
        e = e if self.beta == 1.0 else e * self.beta
        p = torch.where(finite, g + e.to(g.dtype), g)
        return p, finite

    def update(self, key: str, p: torch.Tensor, sent: torch.Tensor, finite: torch.Tensor) -> None:
        """``e <- p - sent`` where the gradient was finite; unchanged otherwise."""
        new = p - sent.to(p.dtype)
        old = self.residuals.get(key)
        if old is None:
            old = torch.zeros_like(new)
        # a finite gradient can still give a non-finite residual (overflow): keep the old one
        ok = finite & torch.isfinite(new).all()
        self.residuals[key] = torch.where(ok, new, old)

    def stage(self, key: str, p: torch.Tensor, sent: torch.Tensor, finite: torch.Tensor) -> None:
        """Like :meth:`update`, but held until :meth:`commit`: a step whose
        outcome is only known after all its buckets leaves every residual as
        it was when it is dropped."""
        self._pending[key] = (p - sent.to(p.dtype), finite)

    def commit(self, step_ok: torch.Tensor | bool = True) -> None:
        """Apply the staged residuals where ``step_ok`` (a 0-d bool tensor,
        no host sync) and their own gradient was finite."""
        ok_step = step_ok if isinstance(step_ok, torch.Tensor) else torch.tensor(bool(step_ok))
        for key, (new, finite) in self._pending.items():
            old = self.residuals.get(key)
            if old is None:
                old = torch.zeros_like(new)
            ok = finite & ok_step.to(new.device) & torch.isfinite(new).all()
            self.residuals[key] = torch.where(ok, new, old)
        self._pending.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta, "gamma": self.gamma, "residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.beta = float(state.get("beta", self.beta))
        self.gamma = float(state.get("gamma", self.gamma))
        self.residuals = {k: v.clone() for k, v in state.get("residuals", {}).items()}

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.residuals.values())
