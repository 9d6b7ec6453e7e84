"""Error feedback: keep what the compressor dropped and add it back next time.

Residual memory (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019,
"Error Feedback Fixes SignSGD"): ``p = beta * e + gamma * g``; send ``C(p)``;
``e <- p - D(C(p))``.

Invariant: a non-finite value never enters the residual. A new residual is
kept only when it is finite (checked with one fused ``aminmax`` read, through
which NaN and Inf propagate), so a NaN/Inf gradient, or a finite one whose
sum with the residual overflows, leaves ``e`` as it was. In the DDP hook the
new residuals of a step are *staged* and committed together once the step's
outcome is known on every rank (:meth:`stage`, :meth:`commit`): a step that
some rank drops leaves every residual untouched.

Cost per tensor and step: one add (``g + e``), the residual itself (for
sparsifiers only the kept entries change: see ``Compressor.residual``), one
``aminmax`` read. On CPU the keep/drop choice is a branch; on CUDA a
``torch.where`` (no host sync).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gradpress.compress.base import all_finite

__all__ = ["ResidualMemory", "all_finite"]


class ResidualMemory:
    """Per-tensor residuals keyed by a stable tensor key (parameter name)."""

    def __init__(self, beta: float = 1.0, gamma: float = 1.0) -> None:
        self.beta = float(beta)
        self.gamma = float(gamma)
        self.residuals: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}

    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """``p = beta * e + gamma * g``: a fresh tensor the caller owns (the
        compressor may turn it into the residual in place)."""
        g = grad * self.gamma if self.gamma != 1.0 else grad
        e = self.residuals.get(key)
        if e is None or e.shape != grad.shape:
            return g.clone() if g is grad else g
        if self.beta != 1.0:
            return torch.add(g, e.to(g.dtype), alpha=self.beta)
        return g + e.to(g.dtype)

    def update(self, key: str, p: torch.Tensor, sent: torch.Tensor) -> None:
        """``e <- p - sent`` now, if finite; unchanged otherwise."""
        self._keep(key, p - sent.to(p.dtype), torch.ones((), dtype=torch.bool))

    def stage(self, key: str, residual: torch.Tensor) -> None:
        """Hold ``residual`` (``p - sent``) for :meth:`commit`."""
        self._pending[key] = residual

    def commit(self, step_ok: torch.Tensor | bool = True) -> None:
        """Keep the staged residuals where ``step_ok`` (bool or 0-d bool
        tensor) and the residual is finite; drop them otherwise."""
        ok_step = step_ok if isinstance(step_ok, torch.Tensor) else torch.tensor(bool(step_ok))
        for key, residual in self._pending.items():
            self._keep(key, residual, ok_step)
        self._pending.clear()

    def _keep(self, key: str, new: torch.Tensor, step_ok: torch.Tensor) -> None:
        ok = step_ok.to(new.device) & all_finite(new)
        old = self.residuals.get(key)
        if new.device.type == "cpu":  # a branch costs nothing on the host
            if bool(ok):
                self.residuals[key] = new
            elif old is None:
                self.residuals[key] = torch.zeros_like(new)
            return
        if old is None:
            old = torch.zeros_like(new)
        self.residuals[key] = torch.where(ok, new, old)

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta, "gamma": self.gamma, "residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.beta = float(state.get("beta", self.beta))
        self.gamma = float(state.get("gamma", self.gamma))
        self.residuals = {k: v.clone() for k, v in state.get("residuals", {}).items()}
        self._pending.clear()

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.residuals.values())
