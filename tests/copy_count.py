"""Counting tensor copies, for the tests of the state copy (``test_review_snapcopy.py``,
``test_review_snapfollow.py``): test code only, no gradpress code.

:class:`Copies` counts the bytes written by ``aten.clone`` and ``aten.copy_`` while it is active;
:func:`tensor_bytes` is the bytes of the tensors in a nested state (dicts, lists, tuples).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Copies(TorchDispatchMode):
    """Counts the bytes written by tensor copies (``aten.clone``'s output, ``aten.copy_``'s destination)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.clone_bytes = 0  # those of ``aten.clone`` alone (a fresh allocation)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.clone.default:
            self.bytes += out.numel() * out.element_size()
            self.clone_bytes += out.numel() * out.element_size()
        elif func is torch.ops.aten.copy_.default:
            self.bytes += args[0].numel() * args[0].element_size()
        return out


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (nested dicts, lists and tuples; anything else counts 0)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0
