"""Per-tensor synchronization plan from a cost model fitted on the live group.

In the spirit of HiPress's SeCoPa (Bai et al., "Gradient Compression
Supercharged High-Performance Data Parallel DNN Training", SOSP 2021):
decide per tensor whether to compress, with which strategy, and into how
many partitions, by minimising a predicted time. HiPress shipped fitted
constants; gradpress measures the live process group at registration
(:func:`measure`) and on request (``handle.replan()``).

Cost model: :mod:`gradpress.exchange.costs` (``AR``, ``AG``, ``BC``,
``P2P`` for the collectives, ``ENC``/``DEC`` for the compressor, ``c(d)``
and ``c'(d)`` for compressed sizes). Each strategy predicts its own time
(``Strategy.predict``, next to the code it models); for a tensor of d
elements of e bytes on N workers, with ``m = d / K`` elements per partition:

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
* hierarchical (a candidate only when the launch has L > 1 workers on each
  of H > 1 hosts, see :mod:`gradpress.exchange.plans`): the bytes over a
  leader's links read off the fits
  (:mod:`gradpress.exchange.strategies.hierarchical_costs`): the dense
  reduce and broadcast, ``e d`` each over the host's link (the optional
  injected ``intra_allreduce`` fit of L workers, else the group's ``AR``
  of N), at the payload whose allreduce moves that much per link
  (``AR_k(b k / (2 (k-1)))``), plus the leaders' exchange, pipelined (its
  default ``chunk``: the codec overlaps the wire): summable
  ``max(AR(2 (H-1)/H c(d) N / (2 (N-1))), ENC(d) + DEC(d))``, else
  ``max(AG((H-1) c(d) / (N-1)), ENC(d) + H DEC(d))``.

Per tensor the cheapest option wins; a compressed option is chosen only when
it predicts at least :data:`MIN_GAIN` (10%) less time than uncompressed
(ties among compressed options go to the order above), so a near tie never
flips with measurement noise. Overheads shared between tensors of a bucket
(one fused message per strategy and bucket) are charged per tensor, which
favours leaving small tensors uncompressed. The fit is made on rank 0 and
broadcast, and rank 0's plan is broadcast too: every rank uses the identical
plan. A plan is a plain object: :meth:`Plan.to_json` holds the fitted cost
model and, per tensor, the decision, its reason and every option's predicted
time.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gradpress.exchange.base import strategy_class, strategy_names
from gradpress.exchange.costs import CostModel

__all__ = ["Decision", "Plan", "Planner", "OPTIONS", "log_plan"]

log = logging.getLogger("gradpress.plan")

#: decision names, in tie-break order: uncompressed, then every strategy in exchange order
OPTIONS = ("uncompressed", *strategy_names())


def _takes_elem_size(predict: Any) -> bool:
    """Whether a strategy's ``predict`` accepts ``elem_size`` (by name or ``**kwargs``)."""
    try:
        params = inspect.signature(predict).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "elem_size" or p.kind is p.VAR_KEYWORD for p in params)


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

    def __init__(self, decisions: Mapping[str, Decision], source: str = "",
                 cost_model: CostModel | None = None) -> None:
        self.decisions: dict[str, Decision] = dict(decisions)
        self.source = source
        #: the fitted costs the decisions come from (None for forced/default plans)
        self.cost_model = cost_model

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
        """The decisions only (what a checkpoint needs: the partitions its residuals are keyed by)."""
        return {k: {"strategy": d.strategy, "parts": d.parts} for k, d in self.decisions.items()}

    def to_json(self) -> dict[str, Any]:
        """Everything, JSON-ready: the source, the fitted cost model, and per
        tensor the decision, its reason and the predicted seconds of every
        option."""
        return {
            "source": self.source,
            "cost_model": self.cost_model.fits() if self.cost_model is not None else None,
            "decisions": {k: {"numel": d.numel, "strategy": d.strategy, "parts": d.parts, "predicted_s": d.predicted_s,
                              "costs": dict(d.costs), "reason": d.reason} for k, d in self.decisions.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Plan:
        return cls({k: Decision(k, int(v["numel"]), v["strategy"], int(v["parts"]), float(v["predicted_s"]),
                                {o: float(c) for o, c in v["costs"].items()}, v["reason"])
                    for k, v in data["decisions"].items()}, data.get("source", ""),
                   CostModel.from_mapping(data["cost_model"]) if data.get("cost_model") else None)

    def __repr__(self) -> str:
        return f"<Plan {self.summary()}>"


#: a compressed option must predict at least this fraction less time than
#: uncompressed to be chosen: near ties stay dense, so noise in the
#: measurements cannot flip a decision from one run to the next
MIN_GAIN = 0.1


class Planner:
    """Chooses per tensor among ``candidates`` (subset of :data:`OPTIONS`
    minus uncompressed) with a :class:`CostModel`; compression only when it
    predicts at least ``min_gain`` (a fraction) less time than uncompressed."""

    def __init__(self, costs: CostModel, world_size: int, summable: bool, candidates: Iterable[str],
                 min_gain: float = MIN_GAIN) -> None:
        if not isinstance(min_gain, (int, float)) or isinstance(min_gain, bool) or not 0 <= min_gain < 1:
            raise ValueError(f"min_gain must be a number in [0, 1), got {min_gain!r}")
        self.min_gain = float(min_gain)
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        cands = tuple(candidates)
        bad = [c for c in cands if c not in OPTIONS[1:]]
        if bad:
            raise ValueError(f"planner candidate {bad[0]!r} is not a strategy; allowed: {', '.join(OPTIONS[1:])}")
        needs = [c for c in cands if strategy_class(c).summable_only and not summable]
        if needs:
            raise ValueError(f"planner candidate {needs[0]!r} needs a summable compressor")
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
        """Predicted seconds (and K) of every option for one tensor: the
        plain allreduce for ``uncompressed``, each candidate's own
        ``Strategy.predict`` for the others."""
        out: dict[str, tuple[float, int]] = {"uncompressed": (self.costs.allreduce(elem_size * float(numel)), 1)}
        for opt in self.candidates:
            predict = strategy_class(opt).predict
            # elem_size only to a predict that takes it (the documented signature has four arguments)
            extra = {"elem_size": elem_size} if _takes_elem_size(predict) else {}
            out[opt] = predict(self.costs, numel, self.world_size, self.summable, **extra)
        return out

    def decide(self, key: str, numel: int, elem_size: int = 4, eligible: bool = True, reason: str = "") -> Decision:
        if not eligible:
            return Decision(key, numel, "uncompressed", 1, 0.0, {}, reason or "rule")
        costs = self.option_costs(numel, elem_size)
        best = "uncompressed"
        for opt in OPTIONS[1:]:
            if opt in costs and (best == "uncompressed" or costs[opt][0] < costs[best][0] - 1e-15):
                best = opt
        flat = costs["uncompressed"][0]
        reason = "cost model"
        if best != "uncompressed" and not costs[best][0] < flat * (1.0 - self.min_gain):
            reason = f"{best} gains < {self.min_gain:.0%}" if costs[best][0] < flat else "cost model"
            best = "uncompressed"
        parts = min(costs[best][1], max(1, numel))
        return Decision(key, numel, best, parts, costs[best][0], {k: v[0] for k, v in costs.items()}, reason)

    def plan(self, params: Iterable[tuple[str, int, int, bool]], source: str = "cost model") -> Plan:
        """``params``: (key, numel, element size, eligible) per parameter."""
        return Plan({k: self.decide(k, n, e, ok, "" if ok else "1-D or below min_numel") for k, n, e, ok in params},
                    source, self.costs)


def log_plan(plan: Plan, rank: int) -> None:
    """Log the plan table once, on rank 0."""
    if rank == 0:
        log.info("gradpress synchronization plan:\n%s", plan.table())
