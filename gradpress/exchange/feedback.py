"""Error feedback: the one home of every residual.

Residual memory (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019,
"Error Feedback Fixes SignSGD"): ``p = beta * e + gamma * g``; send ``C(p)``;
``e <- p - D(C(p))``. The same store keeps the residuals of the strategies
that re-compress on the way, under their own namespace
(:func:`namespace`, :meth:`Feedback.key`): a compressed ring's per-position hop residuals
(Comprex; HiPress Ring) and a parameter-server root's re-compression
residuals (HiPress CaSync-PS). Keys: :mod:`gradpress.exchange.keys` (a
tensor's name escaped, so that no two tensors share one).

Invariant (the one NaN rule): a non-finite value never enters a residual.
New residuals are *staged* and committed together once the step's outcome is
known on every rank (:meth:`Feedback.stage`, :meth:`Feedback.commit`); a
residual is kept only when the step is good on every rank and the residual
itself is finite (one fused ``aminmax`` read, through which NaN and Inf
propagate), otherwise the old one stays. So a NaN/Inf gradient, a finite one
whose sum with the residual overflows, or a step some rank drops, leaves
every residual as it was.

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
from gradpress.exchange.keys import (
    WORKER,
    escape,
    namespace,
    owner,
    owner_among,
    split_key,
    store_key,
    tensor_owner,
)

__all__ = ["Feedback", "WORKER", "escape", "namespace", "split_key", "owner", "owner_among", "tensor_owner"]


class Feedback:
    """Residuals keyed by namespace and stable tensor key (:mod:`gradpress.exchange.keys`:
    the tensor's name escaped): the worker's by that key (whole, even when the plan
    partitions the tensor), the strategies' by the key they exchanged (``key#k`` for
    the k-th partition, ``key#k#ps`` at a PS root)."""

    def __init__(self, beta: float = 1.0, gamma: float = 1.0) -> None:
        self.beta = float(beta)
        self.gamma = float(gamma)
        self.residuals: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}

    @staticmethod
    def key(namespace: str, key: str) -> str:
        """The store key of the exchanged ``key`` in ``namespace`` (the worker's own: the key itself)."""
        return store_key(namespace, key)

    @staticmethod
    def of(name: str) -> str:
        """The store key of the worker's own residual of the tensor ``name`` (its escaped name)."""
        return escape(name)

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

    def current(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """A fresh copy of the residual of ``key`` (zeros when there is none
        or its size differs), shaped and typed like ``like``: for strategies
        that update a residual piece by piece before staging it."""
        old = self.residuals.get(key)
        if old is not None and old.numel() == like.numel():
            return old.to(like.dtype).reshape(like.shape).clone()
        return torch.zeros_like(like)

    def stage(self, key: str, residual: torch.Tensor) -> None:
        """Hold ``residual`` (``p - sent``) for :meth:`commit`."""
        self._pending[key] = residual

    def keep_now(self, key: str, residual: torch.Tensor) -> None:
        """Keep ``residual`` at once if it is finite (the local rule of an
        exchange encoded ahead: the next one encodes before this one's
        verdict is known); nothing is staged."""
        self._keep(key, residual, torch.tensor(True))

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
            elif old is None or old.shape != new.shape:
                self.residuals[key] = torch.zeros_like(new)
            return
        if old is None or old.shape != new.shape:
            old = torch.zeros_like(new)
        self.residuals[key] = torch.where(ok, new, old)

    def namespace(self, namespace: str) -> dict[str, torch.Tensor]:
        """The residuals of one namespace, by exchanged key (a view for reading)."""
        out = {}
        for k, v in self.residuals.items():
            space, key = split_key(k)
            if space == namespace:
                out[key] = v
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta, "gamma": self.gamma, "residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.beta = float(state.get("beta", self.beta))
        self.gamma = float(state.get("gamma", self.gamma))
        self.residuals = {k: v.clone() for k, v in state.get("residuals", {}).items()}
        self._pending.clear()

    def nbytes(self, namespace: str | None = None) -> int:
        """Bytes held, in all namespaces or in one."""
        held = self.residuals.values() if namespace is None else self.namespace(namespace).values()
        return sum(v.numel() * v.element_size() for v in held)
