"""The Comprex optimizer's local parts: gradient-norm clipping and the
momentum buffer kept *before* compression.

Comprex (Kim et al.) applies, on each worker, before anything is
compressed:

1. **clipping** of the whole gradient's 2-norm to ``max_norm`` (5.0 in the
   paper): ``g <- g * min(1, max_norm / (||g||_2 + 1e-6))``, the formula of
   ``torch.nn.utils.clip_grad_norm_``. A rare huge gradient would otherwise
   land in the error-feedback residual and be released over many later
   steps, long after it was relevant;
2. **local momentum before compression**: ``m <- mu * m + lr * g`` (mu =
   0.9), and what is compressed is ``m`` plus the error-feedback residual
   (the engine adds the residual). Compressing the smooth momentum instead
   of the noisy gradient keeps the top entries stable from step to step,
   and applying the averaged compressed ``m`` directly as the update
   (``x <- x - mean C(m + e)``) makes the method, without compression,
   exactly heavy-ball SGD with the learning rate inside the buffer. DGC's
   momentum correction (Lin et al. 2018) is the same idea.

Both need the whole gradient at once, which a per-bucket DDP hook never
holds: that is why Comprex is an algorithm (it owns the step) and not a hook.

Invariant: a step whose gradient is not finite on this rank leaves the
momentum buffer as it was (``torch.where``, no host sync), as the error
feedback store keeps its residual (gradpress's one NaN rule); the NaN still
travels so that every rank sees the bad step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gradpress.compress.base import all_finite

__all__ = ["clip_by_total_norm", "copies_like", "LocalMomentum", "save_pending", "load_pending"]


def clip_by_total_norm(grads: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale ``grads`` in place so that their joint 2-norm is at most
    ``max_norm`` (``max_norm <= 0``: unchanged); returns the norm before
    clipping (0-d tensor). One fused norm per tensor, no host sync."""
    if not grads:
        return torch.zeros(())
    norms = torch._foreach_norm(list(grads), 2.0)
    total = torch.linalg.vector_norm(torch.stack([n.to(torch.float64) for n in norms]), 2.0)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return total


class LocalMomentum:
    """``m <- mu * m + lr * (g + wd * x)`` per tensor; see the module doc.
    ``lr`` and ``wd`` come per tensor from the user's optimizer's parameter
    group at each step (its learning-rate schedule applies)."""

    def __init__(self, params: Sequence[torch.Tensor], momentum: float) -> None:
        self.momentum = float(momentum)
        self.buffers = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in params]

    @torch.no_grad()
    def update(self, grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor], lrs: Sequence[float],
               wds: Sequence[float]) -> list[torch.Tensor]:
        """Advance every buffer by one step; returns fresh copies of the
        buffers (the payload, which the exchange may overwrite)."""
        fresh = []
        for g, p, wd in zip(grads, params, wds):
            fresh.append(torch.add(g, p.detach(), alpha=wd) if wd else g)
        finite = torch.stack([all_finite(g) for g in fresh]).all() if fresh else torch.ones((), dtype=torch.bool)
        on_host = all(m.device.type == "cpu" for m in self.buffers)
        ok = bool(finite) if on_host else True  # a branch costs nothing on the host
        out = []
        for i, (d, lr) in enumerate(zip(fresh, lrs)):
            m = self.buffers[i]
            new = torch.add(m * self.momentum, d.to(m.dtype), alpha=lr)
            if on_host:
                self.buffers[i] = new if ok else m
                out.append(new.clone() if ok else d.to(m.dtype) * lr)  # the NaN still travels
            else:
                self.buffers[i] = torch.where(finite, new, m)
                out.append(torch.where(finite, new, d.to(m.dtype) * lr))
        return out

    def state_dict(self) -> list[torch.Tensor]:
        return [m.clone() for m in self.buffers]

    def load_state_dict(self, buffers: Sequence[torch.Tensor]) -> None:
        self.buffers = copies_like(buffers, self.buffers, "'momentum' buffers")


def copies_like(saved: Sequence[torch.Tensor], like: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
    """Copies of ``saved`` in ``like``'s dtypes, refused (naming ``what``)
    unless they are as many tensors of the same shapes."""
    if len(saved) != len(like) or any(not isinstance(s, torch.Tensor) or s.shape != x.shape
                                       for s, x in zip(saved, like)):
        raise ValueError(f"comprex state: {what} missing or of another model "
                         f"(expected {len(like)} tensors shaped like the parameters)")
    return [s.to(x.dtype).clone() for s, x in zip(saved, like)]


def save_pending(item: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint's copy of an exchange in flight (its fields but the
    background ticket: tensors and lists of them cloned)."""
    def copied(v: Any) -> Any:
        return v.clone() if isinstance(v, torch.Tensor) else [copied(x) for x in v] if isinstance(v, list) else v
    return {k: copied(v) for k, v in item.items() if k != "ticket"}


def load_pending(items: Sequence[Mapping[str, Any]], shapes: list[tuple[int, ...]], proxy: bool
                 ) -> list[dict[str, Any]]:
    """The exchanges in flight of a checkpoint (:func:`save_pending`),
    refused unless shaped like the parameters (``proxy``: the look-ahead's
    stand-ins too)."""
    out = []
    for it in items:
        stand_in = it.get("proxy") if proxy else None
        if [tuple(u.shape) for u in it["update"]] != shapes or (
                proxy and (stand_in is None or [tuple(u.shape) for u in stand_in] != shapes)):
            raise ValueError("comprex state: an exchange in flight does not match this model "
                             "(or was saved without the look-ahead's stand-in)")
        out.append({"step": int(it["step"]), "exchange": int(it["exchange"]), "ratio": float(it["ratio"]),
                    "bytes": int(it["bytes"]), "skipped": bool(it["skipped"]),
                    "update": [u.clone() for u in it["update"]],
                    # update=optimizer: this rank's gradient flags and their average (DDP's rule at the update)
                    **({"mine": [bool(b) for b in it["mine"]], "flags": it["flags"].clone()} if "flags" in it else {}),
                    **({"proxy": [u.clone() for u in stand_in]} if stand_in is not None else {})})
    return out
