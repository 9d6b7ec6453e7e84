"""Which strategies an engine may use, and the plan it starts from.

:class:`StrategyChoice` resolves the requested strategy against the
compressor (the one place that decides it):

* a named strategy is forced for every eligible tensor, and refused at
  construction, with the strategy's own reason, when it cannot carry the
  compressor;
* ``collective`` is the general strategy: allreduce when packets are
  summable, else allgather; every eligible tensor compressed;
* ``auto`` plans per tensor among the general strategy, ring and ps (those
  that can carry the compressor), and ``hierarchical`` when the launch has
  several workers on each of several hosts (every rank's
  ``GRADPRESS_WORKERS_PER_HOST`` / ``LOCAL_WORLD_SIZE`` gives the same L > 1
  dividing the group, N / L > 1), with a cost model measured on the live group
  (:mod:`gradpress.exchange.probe`) or injected (a :class:`CostModel`, a
  mapping of its fields, or the path of a file written by ``gradpress bench
  plan``). It may keep tensors dense when compression does not pay on this
  network. A multi-round protocol
  (PowerSGD) decides per tensor itself whether to compress: ``auto`` is
  allreduce for it. An identity compressor (``none``) has nothing to
  compress: its tensors join the plain allreduce.

Eligible: more than one dimension and at least ``min_numel`` elements.

Per call, :func:`unused_everywhere` finds the tensors that no rank computed
(DDP's ``find_unused_parameters``, ``static_graph``), from flags summed over
the group: the engine sends nothing of them.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradpress.compress.base import Compressor
from gradpress.exchange.base import Strategy, get_strategy, parse_strategy, strategy_class, strategy_key, strategy_names
from gradpress.exchange.costs import CostModel, load_costs
from gradpress.exchange.planner import Decision, Plan, Planner, log_plan
from gradpress.transport.collectives import fused_allreduce
from gradpress.transport.groups import device_of
from gradpress.transport.p2p import global_rank

__all__ = ["StrategyChoice"]


class StrategyChoice:
    def __init__(self, compressor: Compressor, strategy: str, group: dist.ProcessGroup | None, min_numel: int,
                 plan_costs: CostModel | Mapping[str, Any] | None) -> None:
        self.compressor = compressor
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.min_numel = min_numel
        self.requested = strategy
        self.name, self.params = self._resolve(strategy)
        self.strategies: dict[str, Strategy] = {}
        for name in self._candidates():
            strat = self._make(name)
            reason = strat.supports(compressor)
            if reason and self.name != "auto":
                raise ValueError(f"strategy {strategy!r}: {reason}")
            if not reason:
                self.strategies[name] = strat
        if plan_costs is not None and strategy != "auto":
            raise ValueError(f"plan_costs is only used with strategy 'auto', got strategy {strategy!r}")
        if isinstance(plan_costs, (str, os.PathLike)):
            plan_costs = load_costs(plan_costs, compressor=compressor.spec(), world_size=self.world_size)
        #: the cost model the plan came from (None until one is measured or injected)
        self.cost_model: CostModel | None = CostModel.from_mapping(plan_costs) if plan_costs is not None else None
        #: the injected cost model (part of the configuration every rank must agree on)
        self.injected: dict[str, list[float]] | None = self.cost_model.fits() if self.cost_model is not None else None

    @property
    def general(self) -> str:
        """The first general strategy (in exchange order) that can carry the
        compressor: allreduce if its packets are summable, else allgather."""
        for name in strategy_names():
            if strategy_class(name).general and get_strategy(name, self.group).supports(self.compressor) is None:
                return name
        raise ValueError(f"no general strategy can carry compressor {self.compressor.spec()!r}")

    @property
    def forced(self) -> Strategy | None:
        """The forced strategy (None with ``auto``)."""
        return self.strategies.get(self.name)

    @property
    def plans(self) -> bool:
        """Whether this choice is made per tensor by the planner."""
        return self.name == "auto" and bool(self.strategies)

    def _resolve(self, strategy: str) -> tuple[str, dict[str, str]]:
        """(the name this choice goes by, the strategy's parameters). A
        strategy with parameters goes by its
        :func:`~gradpress.exchange.base.strategy_key`, the name and the
        parameters that differ from their defaults
        (``hierarchical:outer=ring,workers_per_host=2``): the configuration
        every rank must agree on holds them, and one strategy spelled two
        ways (defaults written out, another order) is one configuration."""
        name, params = parse_strategy(strategy)
        if name == "collective" or (name == "auto" and self.compressor.rounds > 1):
            return self.general, {}
        key = strategy_key(strategy)
        return key, (params if key != name else {})

    def _make(self, name: str) -> Strategy:
        """The strategy object ``name`` (a registry name, or this choice's
        spec with parameters) stands for, on this choice's group."""
        if self.params and name == self.name:
            cls = strategy_class(name.partition(":")[0])
            return cls(self.group, **self.params)  # type: ignore[call-arg]
        return get_strategy(name, self.group)

    def _candidates(self) -> list[str]:
        if self.name != "auto":
            return [self.name]
        several = self._several_per_host()  # collective: before any early return, on every rank alike
        if self.compressor.identity:
            return []
        general = self.general
        names = [general, *(n for n in strategy_names() if strategy_class(n).planned and not strategy_class(n).general)]
        if several and "hierarchical" in strategy_names():
            names.append("hierarchical")
        return names

    def _several_per_host(self) -> bool:
        """Whether every rank sees the same L > 1 workers per host, L
        dividing the group into more than one host. Collective (one small
        allgather) in a group of several ranks: ranks whose environments
        differ all decide alike."""
        from gradpress.exchange.strategies.hierarchical import workers_per_host_from_env

        try:
            per = workers_per_host_from_env()
        except ValueError:
            per = 1
        n = self.world_size
        if n > 1 and dist.is_initialized():
            mine = torch.tensor([per], dtype=torch.int64, device=device_of(self.group))
            everyone = [torch.empty_like(mine) for _ in range(n)]
            dist.all_gather(everyone, mine, group=self.group)
            if any(int(t) != per for t in everyone):
                return False
        return per > 1 and n % per == 0 and n // per > 1

    def eligible(self, shape: list[int]) -> bool:
        return len(shape) > 1 and math.prod(shape) >= self.min_numel

    def default_decision(self, key: str, numel: int, shape: list[int]) -> Decision:
        if not self.eligible(shape):
            return Decision(key, numel, "uncompressed", 1, reason="1-D or below min_numel")
        if self.compressor.identity and self.requested in ("collective", "auto"):
            return Decision(key, numel, "uncompressed", 1, reason="nothing to compress")
        if self.name != "auto":
            return Decision(key, numel, self.name, 1, reason="forced")
        return Decision(key, numel, self.general, 1, reason="not planned yet")

    def _plan_params(self, params: list[tuple[str, list[int], str]]) -> list[tuple[str, int, int, bool]]:
        out = []
        for key, shape, dtype in params:
            elem = torch.empty(0, dtype=getattr(torch, dtype.replace("torch.", ""))).element_size()
            out.append((key, math.prod(shape), elem, self.eligible(shape)))
        return out

    def _planner(self, costs: CostModel) -> Planner:
        return Planner(costs, self.world_size, self.compressor.is_summable, list(self.strategies))

    def initial_plan(self, params: list[tuple[str, list[int], str]]) -> Plan:
        if self.plans and self.cost_model is not None:
            return self._planner(self.cost_model).plan(self._plan_params(params), "injected costs")
        source = "forced" if self.name != "auto" else "default"
        return Plan({k: self.default_decision(k, math.prod(s), s) for k, s, _ in params}, source)

    def replan(self, params: list[tuple[str, list[int], str]], current: Plan, costs: Any, rank: int) -> Plan:
        """Measure the group (or use ``costs``) and rebuild the plan; a forced
        strategy keeps its plan. Collective when measuring."""
        if not self.plans:
            return current
        if costs is None:
            from gradpress.exchange.probe import measure

            model = measure(self.group, self.compressor, device=device_of(self.group))
            source = "measured"
        else:
            model = CostModel.from_mapping(costs)
            source = "injected costs"
        plan = self._planner(model).plan(self._plan_params(params), source) if rank == 0 else None
        if self.world_size > 1:  # rank 0's plan is everyone's: ranks can never disagree
            box = [plan.to_json() if plan is not None else None]
            dist.broadcast_object_list(box, src=global_rank(self.group, 0), group=self.group)
            plan = Plan.from_json(box[0])
        assert plan is not None
        self.cost_model = model
        log_plan(plan, rank)
        return plan

    def plan_from_dict(self, saved: Mapping[str, Any], current: Plan) -> Plan:
        """A checkpoint's plan (the partitions its residuals are keyed by)."""
        return Plan({
            k: Decision(k, current[k].numel if k in current.decisions else 0, v["strategy"], int(v["parts"]),
                        reason="checkpoint")
            for k, v in saved.items()
        }, "checkpoint")


def unused_everywhere(decisions: list[Decision], tensors: Sequence[torch.Tensor], used: Sequence[bool],
                      group: dist.ProcessGroup | None) -> tuple[list[int], int, float]:
    """The positions of the tensors of a call that no rank used (``used``:
    this rank's flag per tensor), from one allreduce of a flag per tensor,
    compressed or not. A call that compresses nothing exchanges no flags and
    finds none (it sends what DDP's own allreduce sends: the whole bucket;
    docs/integrations.md, "Models with parameters unused on some steps").
    Collective. Returns (positions, bytes handed over, seconds)."""
    if not any(d.compressed for d in decisions):
        return [], 0, 0.0
    t = time.perf_counter()
    flags = torch.tensor([1.0 if u else 0.0 for u in used], device=tensors[0].device)
    (summed,), sent = fused_allreduce([flags], group)
    return [i for i, anywhere in enumerate(summed.tolist()) if not anywhere], sent, time.perf_counter() - t
