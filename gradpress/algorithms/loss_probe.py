"""A loss probe: the tensor subclass through which LSGD sees each worker's
training loss without a change to the user's loop."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["probe_class"]


def probe_class(sink: Callable[[torch.Tensor], None]) -> type[torch.Tensor]:
    """A tensor subclass whose ``backward()`` (and ``torch.autograd.backward``)
    hands its scalar to ``sink`` first; results that leave autograd
    (``detach``, no-grad ops) come back as plain tensors."""

    class LossProbe(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
            if func is torch.Tensor.backward or func is torch.autograd.backward:
                root = args[0] if args else (kwargs or {}).get("tensors")
                if isinstance(root, torch.Tensor) and root.numel() == 1:
                    sink(root)
            out = super().__torch_function__(func, types, args, kwargs or {})
            if isinstance(out, LossProbe) and not out.requires_grad:
                return out.as_subclass(torch.Tensor)
            return out

    return LossProbe
