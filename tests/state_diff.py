"""Where two states differ, for the tests that compare an engine's or an algorithm's state before and after a
load, or with a twin's (tensors: dtype, shape and every bit)."""

from __future__ import annotations

from typing import Any

import torch

#: the stats that are wall-clock seconds: a twin's differ (compared only in the state before and after a load)
TIMING = ("compress_s", "comm_s")


def diff(a: Any, b: Any, path: str = "", timing: bool = True) -> str | None:
    """Where ``a`` and ``b`` differ (tensors: dtype, shape and every bit), or None; ``timing``: compare
    the :data:`TIMING` stats too."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        return None if torch.equal(a, b) else f"{path}: values differ"
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            if (timing or k not in TIMING) and (d := diff(a[k], b[k], f"{path}[{k!r}]", timing)) is not None:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            if (d := diff(x, y, f"{path}[{i}]", timing)) is not None:
                return d
        return None
    return None if a == b else f"{path}: {a!r} vs {b!r}"
