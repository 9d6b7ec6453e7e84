"""The compression-ratio schedule of the Comprex optimizer.

Comprex (Kim et al.) smooths the effect of compression on training by
compressing mildly (or not at all) at first and at the target ratio
(e.g. 1% kept) later: early gradients are large and change fast, dropping
most of them then costs accuracy that error feedback recovers only slowly.
DGC's warm-up (Lin et al. 2018, "Deep Gradient Compression") is one
instance: ``delta_e = delta^((e + 1) / (W + 1))`` for epochs e < W, i.e.
25%, 6.25%, 1.56%, 0.39%, then 0.1% for delta = 0.001 and W = 4.

:class:`RatioSchedule` maps the exchange step t (identical on every rank,
so every rank changes its payload size in the same step) to a density:

* ``constant``: the target from the first step;
* ``linear``: ``start + (target - start) * f``;
* ``exponential``: ``start^(1 - f) * target^f`` (geometric interpolation);

with ``f = min(t, warmup) / warmup`` (0 -> 1 over ``warmup`` steps), or,
with ``stages = S > 0``, ``f = floor(S * min(t, warmup) / warmup) / S``:
piecewise constant over S equal stages. DGC's warm-up is ``exponential``
with ``start = target^(1 / (W + 1))``, ``stages = W`` and ``warmup = W``
epochs of steps (tested).

The target is the compressor's own ``ratio`` (``topk:ratio=0.01``): the
schedule only moves the density on the way there. :func:`ratio_holder` finds
the stage of a compressor that owns ``ratio`` (the first stage of a
composition ``topk:ratio=0.01>natural``).
"""

from __future__ import annotations

import math
from typing import Any

from gradpress.compress import Compressor

__all__ = ["SCHEDULES", "RatioSchedule", "ratio_holder"]

SCHEDULES = ("constant", "linear", "exponential")


def ratio_holder(compressor: Compressor) -> Compressor | None:
    """The compressor (or composition stage) whose float ``ratio`` sets the
    density, or None when it has none."""
    first = getattr(compressor, "first", None)
    if isinstance(first, Compressor):
        return ratio_holder(first)
    return compressor if isinstance(getattr(compressor, "ratio", None), float) else None


class RatioSchedule:
    """Density at exchange step ``t``; see the module doc. Validates its
    fields, naming the field, the value and what is allowed."""

    def __init__(self, kind: str, start: float, target: float, warmup: int, stages: int = 0,
                 owner: str = "comprex") -> None:
        def bad(field: str, value: Any, allowed: str) -> ValueError:
            return ValueError(f"algorithm {owner!r}: parameter {field!r} got {value!r}; allowed: {allowed}")

        if kind not in SCHEDULES:
            raise bad("schedule", kind, ", ".join(SCHEDULES))
        if not 0 < start <= 1:
            raise bad("start_ratio", start, "0 < start_ratio <= 1")
        if not 0 < target <= 1:
            raise bad("ratio", target, "0 < ratio <= 1 (the compressor's)")
        if warmup < 0:
            raise bad("warmup", warmup, "integer >= 0")
        if stages < 0 or (warmup and stages > warmup):
            raise bad("stages", stages, f"integer in [0, warmup={warmup}]")
        self.kind, self.start, self.target = kind, float(start), float(target)
        self.warmup, self.stages = int(warmup), int(stages)

    @property
    def moves(self) -> bool:
        """Whether the density ever differs from the target."""
        return self.kind != "constant" and self.warmup > 0 and self.start != self.target

    def fraction(self, t: int) -> float:
        """How far along the warm-up step ``t`` is, in [0, 1]."""
        if self.warmup == 0:
            return 1.0
        done = min(max(t, 0), self.warmup)
        if self.stages:
            return math.floor(self.stages * done / self.warmup) / self.stages
        return done / self.warmup

    def __call__(self, t: int) -> float:
        if not self.moves:
            return self.target
        f = self.fraction(t)
        if f >= 1.0:
            return self.target  # exactly the target, whatever the rounding on the way
        if self.kind == "linear":
            value = self.start + (self.target - self.start) * f
        else:
            value = self.start ** (1.0 - f) * self.target ** f
        return min(1.0, max(value, min(self.start, self.target)))
