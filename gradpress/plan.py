"""Per-tensor synchronization plan from a cost model fitted on the live group.

In the spirit of HiPress's SeCoPa (Bai et al., "Gradient Compression
Supercharged High-Performance Data Parallel DNN Training", SOSP 2021):
decide per tensor whether to compress, with which strategy, and into how
many partitions, by minimising a predicted time. HiPress shipped fitted
constants; gradpress measures the live process group at registration
(:func:`measure`) and on request (``handle.replan()``).

Cost model. Every primitive costs ``T(x) = max(overhead, A + B x)``
(:class:`Fit`): ``AR``, ``AG``, ``BC`` and ``P2P`` take bytes (allreduce of
x bytes; allgather of x bytes per rank; broadcast of x bytes; every rank
sending x bytes to its ring neighbour while receiving as much);
``ENC``/``DEC`` take elements (encode/decode of the chosen compressor).
``c(d)`` is the compressed size of d elements and ``c'(d)`` that of the PS
root's compressor (density x N for sparse methods), both fitted linearly from
probe encodings. For a tensor of d elements of e bytes on N workers, with
``m = d / K`` elements per partition:

* uncompressed (joins the fused plain allreduce): ``AR(e d)``
* allreduce, summable compressors: ``ENC(d) + AR(c(d)) + DEC(d)``
* allgather: ``ENC(d) + AG(c(d)) + N DEC(d)``
* ring (the tensor is cut into N chunks of ``d_c = d / N``): non-summable
  ``N ENC(d_c) + (N-1) DEC(d_c)`` for the hops (decode, add, re-encode)
  ``+ 2 (N-1) P2P(c(d_c))`` for reduce-scatter and allgather
  ``+ N DEC(d_c)`` for the final decode; summable: ``N ENC(d_c) + 2 (N-1)
  P2P(c(d_c)) + N DEC(d_c)`` (payloads are added, never decoded on the way).
  Partitioning does not help a ring (it already splits into N chunks): K = 1.
* ps with K partitions (1 <= K <= N, rooted on K different ranks):
  ``K ENC(m)`` (every rank encodes all parts) ``+ P2P((N-1) c(m))`` (a root
  receives N-1 packets; different roots receive in parallel) ``+ N DEC(m) +
  ENC(m)`` (root decodes, sums, re-encodes; roots work in parallel) ``+ K
  BC(c'(m))`` (one broadcast per root) ``+ K DEC(m)`` (everyone decodes every
  part). Summable: the root adds payloads (no decode/re-encode), ``c' = c``.

Per tensor the cheapest option wins; a compressed option is chosen only when
it beats uncompressed (ties go to uncompressed, then to the order above).
Overheads shared between tensors of a bucket (one fused message per strategy
and bucket) are charged per tensor, which favours leaving small tensors
uncompressed. The fit is made on rank 0 and broadcast, so every rank builds
the identical plan from identical numbers.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradpress.compress.base import Compressor, Context

__all__ = ["Fit", "CostModel", "Decision", "Plan", "Planner", "measure", "OPTIONS"]

log = logging.getLogger("gradpress.plan")

#: decision names, in tie-break order
OPTIONS = ("uncompressed", "allreduce", "allgather", "ring", "ps")
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


@dataclass(frozen=True)
class Decision:
    """How one tensor travels: ``strategy`` in :data:`OPTIONS`, ``parts``
    partitions (keys ``name#k`` when > 1), predicted seconds per option."""

    key: str
    numel: int
    strategy: str
    parts: int = 1
    predicted_s: float = 0.0
    costs: dict[str, float] = field(default_factory=dict)
    reason: str = ""

    @property
    def compressed(self) -> bool:
        return self.strategy != "uncompressed"


class Plan:
    """Decisions for every parameter; ``table()`` renders them."""

    def __init__(self, decisions: Mapping[str, Decision], source: str = "") -> None:
        self.decisions: dict[str, Decision] = dict(decisions)
        self.source = source

    def __getitem__(self, key: str) -> Decision:
        return self.decisions[key]

    def table(self) -> str:
        head = ("tensor", "numel", "decision", "K", "predicted ms", "uncompressed ms", "note")
        rows = []
        for d in self.decisions.values():
            unc = d.costs.get("uncompressed")
            rows.append((
                d.key, str(d.numel), d.strategy, str(d.parts),
                f"{d.predicted_s * 1e3:.3f}" if d.costs else "-",
                f"{unc * 1e3:.3f}" if unc is not None else "-",
                d.reason,
            ))
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
        lines = [f"plan ({self.source})" if self.source else "plan"]
        lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        return "\n".join(lines)

    def summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.decisions.values():
            out[d.strategy] = out.get(d.strategy, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {k: {"strategy": d.strategy, "parts": d.parts} for k, d in self.decisions.items()}

    def __repr__(self) -> str:
        return f"<Plan {self.summary()}>"


class Planner:
    """Chooses per tensor among ``candidates`` (subset of :data:`OPTIONS`
    minus uncompressed) with a :class:`CostModel`."""

    def __init__(self, costs: CostModel, world_size: int, summable: bool, candidates: Iterable[str]) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        cands = tuple(candidates)
        bad = [c for c in cands if c not in OPTIONS[1:]]
        if bad:
            raise ValueError(f"planner candidate {bad[0]!r} is not a strategy; allowed: {', '.join(OPTIONS[1:])}")
        if "allreduce" in cands and not summable:
            raise ValueError("planner candidate 'allreduce' needs a summable compressor")
        self.costs = costs
        self.world_size = world_size
        self.summable = summable
        self.candidates = cands

    @classmethod
    def from_costs(cls, costs: CostModel | Mapping[str, Any], world_size: int, *, summable: bool = False,
                   candidates: Iterable[str] | None = None) -> Planner:
        """A planner from injected measurements (tests, what-if studies)."""
        if candidates is None:
            candidates = ("allreduce", "ring", "ps") if summable else ("allgather", "ring", "ps")
        return cls(CostModel.from_mapping(costs), world_size, summable, candidates)

    # ------------------------------------------------------------------ costs
    def option_costs(self, numel: int, elem_size: int = 4) -> dict[str, tuple[float, int]]:
        """Predicted seconds (and K) of every option for one tensor."""
        c, n, d = self.costs, self.world_size, float(numel)
        out: dict[str, tuple[float, int]] = {"uncompressed": (c.allreduce(elem_size * d), 1)}
        enc, dec, wire = c.encode, c.decode, c.wire
        for opt in self.candidates:
            if opt == "allreduce":
                out[opt] = (enc(d) + c.allreduce(wire(d)) + dec(d), 1)
            elif opt == "allgather":
                out[opt] = (enc(d) + c.allgather(wire(d)) + n * dec(d), 1)
            elif opt == "ring":
                dc = d / n
                hops = n * enc(dc) + 2 * (n - 1) * c.p2p(wire(dc)) + n * dec(dc)
                if not self.summable:
                    hops += (n - 1) * dec(dc)
                out[opt] = (hops, 1)
            elif opt == "ps":
                best: tuple[float, int] | None = None
                for k in range(1, n + 1):
                    m = d / k
                    t = k * enc(m) + c.p2p((n - 1) * wire(m)) + k * dec(m)
                    if self.summable:
                        t += k * c.broadcast(wire(m))
                    else:
                        t += n * dec(m) + enc(m) + k * c.broadcast(c.root_wire(m))
                    if best is None or t < best[0] - 1e-15:
                        best = (t, k)
                assert best is not None
                out[opt] = best
        return out

    def decide(self, key: str, numel: int, elem_size: int = 4, eligible: bool = True, reason: str = "") -> Decision:
        if not eligible:
            return Decision(key, numel, "uncompressed", 1, 0.0, {}, reason or "rule")
        costs = self.option_costs(numel, elem_size)
        best = "uncompressed"
        for opt in OPTIONS:
            if opt in costs and costs[opt][0] < costs[best][0] - 1e-15:
                best = opt
        parts = min(costs[best][1], max(1, numel))
        return Decision(key, numel, best, parts, costs[best][0], {k: v[0] for k, v in costs.items()}, "cost model")

    def plan(self, params: Iterable[tuple[str, int, int, bool]], source: str = "cost model") -> Plan:
        """``params``: (key, numel, element size, eligible) per parameter."""
        return Plan({k: self.decide(k, n, e, ok, "" if ok else "1-D or below min_numel") for k, n, e, ok in params}, source)


# ---------------------------------------------------------------- measurement
def _timed(fn: Any, reps: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    group: dist.ProcessGroup | None,
    compressor: Compressor,
    *,
    device: torch.device | str = "cpu",
    comm_sizes: tuple[int, ...] = (1 << 10, 1 << 15, 1 << 18, 1 << 20),
    compute_sizes: tuple[int, ...] = (1 << 10, 1 << 14, 1 << 17, 1 << 19),
    reps: int = 3,
) -> CostModel:
    """Time the primitives on ``group`` (every rank takes part) and the
    compressor (rank 0 only), fit on rank 0 and broadcast the fit: every rank
    returns the identical :class:`CostModel`. A second or so on loopback."""
    from gradpress.comm.p2p import exchange_bytes, global_rank
    from gradpress.comm.recompress import densified

    device = torch.device(device)
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    pts: dict[str, tuple[list[float], list[float]]] = {f: ([], []) for f in FIELDS}
    for size in comm_sizes:
        x = torch.zeros(size // 4, dtype=torch.float32, device=device)
        out = [torch.empty_like(x) for _ in range(n)]
        byte_buf = torch.zeros(size, dtype=torch.uint8, device=device)
        prims = {
            "allreduce": lambda x=x: (dist.all_reduce(x, group=group), _sync(device)),
            "allgather": lambda x=x, out=out: (dist.all_gather(out, x, group=group), _sync(device)),
            "broadcast": lambda x=x: (dist.broadcast(x, global_rank(group, 0), group=group), _sync(device)),
            "p2p": lambda b=byte_buf, size=size: (
                exchange_bytes({(rank + 1) % n: b}, {(rank - 1) % n: size}, group, False, device), _sync(device)
            ),
        }
        for name, fn in prims.items():
            if n == 1 and name == "p2p":
                continue
            t = _timed(fn, reps)
            pts[name][0].append(float(size))
            pts[name][1].append(t)
    params = torch.zeros(3 * len(FIELDS), dtype=torch.float64)
    if rank == 0:
        import copy

        # probe a copy: stateful compressors keep per-key state sized by the first call
        compressor = copy.deepcopy(compressor)
        root = densified(compressor, n)
        for size in compute_sizes:
            x = torch.randn(size, device=device)
            ctx = Context(key=f"__gradpress_plan__{size}", step=0, rank=0, world_size=n)
            pk = compressor.encode(x, ctx)
            pts["encode"][0].append(float(size))
            pts["encode"][1].append(_timed(lambda x=x, ctx=ctx: (compressor.encode(x, ctx), _sync(device)), reps))
            pts["decode"][0].append(float(size))
            pts["decode"][1].append(_timed(lambda pk=pk: (compressor.decode(pk), _sync(device)), reps))
            pts["wire"][0].append(float(size))
            pts["wire"][1].append(float(pk.nbytes))
            pts["root_wire"][0].append(float(size))
            pts["root_wire"][1].append(float(root.encode(x, ctx).nbytes))
        fits = {}
        for f in FIELDS:
            xs, ts = pts[f]
            if not xs:  # single worker: no point-to-point
                fits[f] = Fit(0.0, 0.0, 0.0)
            elif f in ("wire", "root_wire"):
                fits[f] = _linear(xs, ts)
            else:
                fits[f] = Fit.least_squares(xs, ts)
        params = CostModel(**fits).to_tensor()
    if n > 1:
        dist.broadcast(params, global_rank(group, 0), group=group)
    return CostModel.from_tensor(params)


def _linear(xs: list[float], ys: list[float]) -> Fit:
    """Ordinary least squares ``a + b x`` (sizes are exact, no weighting)."""
    k = len(xs)
    mx, my = sum(xs) / k, sum(ys) / k
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    b = max(b, 0.0)
    return Fit(0.0, my - b * mx, b)


def log_plan(plan: Plan, rank: int) -> None:
    """Log the plan table once, on rank 0."""
    if rank == 0:
        log.info("gradpress synchronization plan:\n%s", plan.table())
