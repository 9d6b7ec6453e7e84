"""``--precision``: the arithmetic of a training step's forward pass.

* ``fp32`` (the default): no autocast.
* ``bf16``: ``torch.autocast(device_type, dtype=torch.bfloat16)`` around the forward and the loss; no
  scaler (bf16 has fp32's exponent range: gradients do not underflow).
* ``fp16``: ``torch.autocast(device_type, dtype=torch.float16)`` plus a ``torch.amp.GradScaler(device_type)``
  (Micikevicius et al. 2018, "Mixed Precision Training"): ``scaler.scale(loss).backward()``, and the scaler
  is given to the algorithm (``gradpress.algorithms.create(..., scaler=)``, which unscales, steps and updates
  in ``algo.step()``) or to the DDP hook (``gradpress.ddp.register(..., scaler=)``, which keeps its residuals
  in the scale of each step; :class:`~gradpress.train.algorithm.DDPAlgorithm` then steps through the scaler).

Parameters, optimizer state and everything exchanged stay fp32 in every mode: autocast casts per op.
The scaler's state is saved with the algorithm's (``loss_scaler``; the DDP path's in the checkpoint's rank
entry), so ``--resume`` continues bit-identically. :func:`check` refuses, before any worker starts, what
cannot work, naming why.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from gradpress.exchange.nonfinite import SCALER_NEEDS_PROPAGATE

if TYPE_CHECKING:
    from gradpress.train.config import TrainConfig

__all__ = ["PRECISIONS", "Precision", "check", "make"]

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _scaler_class() -> Any:
    return getattr(getattr(torch, "amp", None), "GradScaler", None)


def check(cfg: TrainConfig) -> None:
    """Refuse a ``precision`` that cannot run with the rest of ``cfg`` (validated up to it): ``ValueError``
    naming the field, the value and what is allowed, or why."""
    from gradpress.train.checks import _choice

    cfg.precision = _choice("precision", cfg.precision, PRECISIONS)
    if cfg.precision != "fp16":
        return
    if cfg.nonfinite != "propagate":
        raise ValueError(f"precision 'fp16' needs nonfinite 'propagate', got nonfinite {cfg.nonfinite!r}: "
                         f"{SCALER_NEEDS_PROPAGATE}; allowed: --nonfinite propagate, or --precision bf16")
    name = cfg.algorithm.partition(":")[0]
    if name != "ddp":
        from gradpress.algorithms.registry import get_class

        refusal = getattr(get_class(name), "scaler_refusal", None)
        if refusal is not None:
            raise ValueError(f"precision 'fp16' needs a GradScaler, which algorithm {name!r} refuses: {refusal}; "
                             "allowed: --precision fp32 or bf16 (bf16 needs no scaler)")
    cls = _scaler_class()
    try:
        if cls is None:
            raise AttributeError("torch.amp has no GradScaler")
        cls(cfg.device)
    except (AttributeError, TypeError, RuntimeError, ValueError) as exc:
        raise ValueError(f"precision 'fp16' needs torch.amp.GradScaler({cfg.device!r}), which this torch "
                         f"{torch.__version__} does not have ({type(exc).__name__}: {exc}); allowed here: "
                         "--precision fp32 or bf16") from None


class Precision:
    """What one step does for its precision: :meth:`autocast` around the forward and the loss,
    :meth:`backward` (through :attr:`scaler` under fp16)."""

    def __init__(self, precision: str, device: torch.device) -> None:
        self.name = precision
        self.device_type = device.type
        self.dtype = _DTYPES.get(precision)
        #: the fp16 loss scaler (None under fp32 and bf16), shared with the algorithm or hook
        self.scaler: Any = _scaler_class()(device.type) if precision == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()


def make(precision: str, device: torch.device) -> Precision | None:
    """The step's :class:`Precision`; None for ``fp32`` (the loop's plain forward and backward)."""
    return None if precision == "fp32" else Precision(precision, device)
