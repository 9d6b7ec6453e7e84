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

Optional: ``intra_allreduce``, an allreduce of x bytes among the workers of
one host (their fast link), for the ``hierarchical`` strategy's inner steps.
The probe measures the whole group only, so it is given by injected costs
(``plan_costs``); without it the hierarchical prediction uses the group's
``allreduce`` of N ranks (as if the host's link were as slow as the
group's). Either is read at the payload that moves the step's bytes per
link (:mod:`gradpress.exchange.strategies.hierarchical_costs`).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Fit", "CostModel", "FIELDS", "OPTIONAL_FIELDS", "COMM_PRIMITIVES", "COSTS_FORMAT", "load_costs"]

COSTS_FORMAT = "gradpress-costs/1"

COMM_PRIMITIVES = ("allreduce", "allgather", "broadcast", "p2p")
FIELDS = (*COMM_PRIMITIVES, "encode", "decode", "wire", "root_wire")
#: fits a cost model may hold (see the module doc); not part of :meth:`CostModel.to_tensor`
OPTIONAL_FIELDS = ("intra_allreduce",)


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
    intra_allreduce: Fit | None = None

    def intra_host_allreduce(self, nbytes: float) -> float:
        """Seconds of an allreduce of ``nbytes`` among one host's workers:
        ``intra_allreduce`` when given, else the group's ``allreduce``."""
        fit = self.intra_allreduce if self.intra_allreduce is not None else self.allreduce
        return fit(nbytes)

    @classmethod
    def from_mapping(cls, costs: Mapping[str, Any]) -> CostModel:
        """From ``{field: Fit or (overhead, a, b)}``; ``root_wire`` defaults
        to ``wire``. A mapping written by :meth:`to_json` (with ``format``)
        is accepted too."""
        if isinstance(costs, CostModel):
            return costs
        if isinstance(costs, Mapping) and costs.get("format") == COSTS_FORMAT:
            costs = costs.get("fits", {})
        if not isinstance(costs, Mapping):
            raise ValueError(f"plan_costs must be a mapping of {', '.join(FIELDS)} to (overhead, a, b), got {costs!r}")
        unknown = sorted(set(costs) - set(FIELDS) - set(OPTIONAL_FIELDS))
        if unknown:
            raise ValueError(f"plan_costs: unknown field {unknown[0]!r}; allowed: {', '.join(FIELDS + OPTIONAL_FIELDS)}")
        values = dict(costs)
        values.setdefault("root_wire", values.get("wire"))
        missing = [f for f in FIELDS if values.get(f) is None]
        if missing:
            raise ValueError(f"plan_costs: missing field {missing[0]!r}; required: {', '.join(FIELDS)}")
        optional = {f: Fit.coerce(values[f], f) for f in OPTIONAL_FIELDS if values.get(f) is not None}
        return cls(**{f: Fit.coerce(values[f], f) for f in FIELDS}, **optional)

    def fits(self) -> dict[str, list[float]]:
        """``{field: [overhead, a, b]}`` (plain numbers: JSON, configuration
        checks); optional fits only when present."""
        fields = [*FIELDS, *(f for f in OPTIONAL_FIELDS if getattr(self, f) is not None)]
        return {f: [getattr(self, f).overhead, getattr(self, f).a, getattr(self, f).b] for f in fields}

    def to_json(self, **about: Any) -> dict[str, Any]:
        """A JSON-ready mapping; ``about`` records what was measured
        (compressor spec, world size, device, date)."""
        return {"format": COSTS_FORMAT, **about, "fits": self.fits()}

    def to_tensor(self) -> torch.Tensor:
        """The required fits (the probe's broadcast); optional ones are not carried."""
        return torch.tensor([v for f in FIELDS for v in (getattr(self, f).overhead, getattr(self, f).a, getattr(self, f).b)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> CostModel:
        v = t.tolist()
        return cls(**{f: Fit(v[3 * i], v[3 * i + 1], v[3 * i + 2]) for i, f in enumerate(FIELDS)})


def load_costs(path: str | os.PathLike[str], *, compressor: str | None = None, world_size: int | None = None) -> CostModel:
    """Read a cost file written by ``gradpress bench plan --out FILE``.

    Refuses, naming both values, a file measured for another compressor or
    world size than ``compressor`` / ``world_size`` (when given): encode and
    decode costs are the compressor's, collective costs the group's."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"plan_costs: file {str(path)!r} does not exist") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"plan_costs: cannot read {str(path)!r} as a gradpress cost file: {exc}") from None
    if not isinstance(data, Mapping) or data.get("format") != COSTS_FORMAT:
        raise ValueError(f"plan_costs: {str(path)!r} is not a gradpress cost file (format {COSTS_FORMAT!r}); "
                         "write one with: gradpress bench plan --out FILE")
    for name, mine in (("compressor", compressor), ("world_size", world_size)):
        theirs = data.get(name)
        if mine is not None and theirs is not None and theirs != mine:
            raise ValueError(f"plan_costs: {str(path)!r} was measured with {name} {theirs!r}, this run has {mine!r}; "
                             "measure again with: gradpress bench plan")
    return CostModel.from_mapping(data)
