"""Cost model of the exchange primitives, fitted on the live group.

Every primitive costs ``T(x) = max(overhead, A + B x)`` (:class:`Fit`):
``allreduce``, ``allgather``, ``broadcast`` and ``p2p`` take bytes (allreduce
of x bytes; allgather of x bytes per rank; broadcast of x bytes; every rank
sending x bytes to its ring neighbour while receiving as much); ``encode`` and
``decode`` take elements (the chosen compressor). ``wire`` is the compressed
size (bytes) of d elements and ``root_wire`` that of the PS root's
compressor (density x N for sparse methods), both linear in d.
:mod:`gradpress.exchange.probe` measures them; each strategy turns them into
a predicted time (``Strategy.predict``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Fit", "CostModel", "FIELDS", "COMM_PRIMITIVES"]

COMM_PRIMITIVES = ("allreduce", "allgather", "broadcast", "p2p")
FIELDS = (*COMM_PRIMITIVES, "encode", "decode", "wire", "root_wire")


@dataclass(frozen=True)
class Fit:
    """``T(x) = max(overhead, a + b x)``."""

    overhead: float
    a: float
    b: float

    def __call__(self, x: float) -> float:
        return max(self.overhead, self.a + self.b * x)

    @classmethod
    def least_squares(cls, xs: Iterable[float], ts: Iterable[float]) -> Fit:
        """Fit ``a + b x`` minimising the *relative* squared error (so small
        sizes count as much as large ones), ``b >= 0``; overhead = min time."""
        xs, ts = list(map(float, xs)), list(map(float, ts))
        if not xs or len(xs) != len(ts):
            raise ValueError(f"need equally many sizes and times, got {len(xs)} and {len(ts)}")
        w = [1.0 / max(t, 1e-12) for t in ts]
        # normal equations of sum (w (a + b x) - 1)^2
        s11 = sum(wi * wi for wi in w)
        s12 = sum(wi * wi * x for wi, x in zip(w, xs))
        s22 = sum(wi * wi * x * x for wi, x in zip(w, xs))
        r1 = sum(wi for wi in w)
        r2 = sum(wi * x for wi, x in zip(w, xs))
        det = s11 * s22 - s12 * s12
        if abs(det) < 1e-300 or len(set(xs)) < 2:
            a, b = statistics.median(ts), 0.0
        else:
            a = (r1 * s22 - r2 * s12) / det
            b = (s11 * r2 - s12 * r1) / det
        if b < 0:
            a, b = statistics.median(ts), 0.0
        return cls(min(ts), a, b)

    @classmethod
    def coerce(cls, value: Any, name: str) -> Fit:
        if isinstance(value, Fit):
            return value
        try:
            o, a, b = (float(v) for v in value)
        except (TypeError, ValueError):
            raise ValueError(f"plan cost {name!r} must be a Fit or (overhead, a, b), got {value!r}") from None
        if not all(math.isfinite(v) for v in (o, a, b)) or o < 0 or b < 0:
            raise ValueError(f"plan cost {name!r} must have finite overhead >= 0 and b >= 0, got {value!r}")
        return cls(o, a, b)


@dataclass(frozen=True)
class CostModel:
    """Fitted costs of the primitives (seconds; comm in bytes, compressor in
    elements) and the compressed sizes (bytes as a function of elements)."""

    allreduce: Fit
    allgather: Fit
    broadcast: Fit
    p2p: Fit
    encode: Fit
    decode: Fit
    wire: Fit
    root_wire: Fit

    @classmethod
    def from_mapping(cls, costs: Mapping[str, Any]) -> CostModel:
        """From ``{field: Fit or (overhead, a, b)}``; ``root_wire`` defaults
        to ``wire``."""
        if isinstance(costs, CostModel):
            return costs
        if not isinstance(costs, Mapping):
            raise ValueError(f"plan_costs must be a mapping of {', '.join(FIELDS)} to (overhead, a, b), got {costs!r}")
        unknown = sorted(set(costs) - set(FIELDS))
        if unknown:
            raise ValueError(f"plan_costs: unknown field {unknown[0]!r}; allowed: {', '.join(FIELDS)}")
        values = dict(costs)
        values.setdefault("root_wire", values.get("wire"))
        missing = [f for f in FIELDS if values.get(f) is None]
        if missing:
            raise ValueError(f"plan_costs: missing field {missing[0]!r}; required: {', '.join(FIELDS)}")
        return cls(**{f: Fit.coerce(values[f], f) for f in FIELDS})

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([v for f in FIELDS for v in (getattr(self, f).overhead, getattr(self, f).a, getattr(self, f).b)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> CostModel:
        v = t.tolist()
        return cls(**{f: Fit(v[3 * i], v[3 * i + 1], v[3 * i + 2]) for i, f in enumerate(FIELDS)})
