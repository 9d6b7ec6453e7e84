"""The exchange engine: "average these keyed tensors, compressed".

:class:`Synchronizer` is what the DDP hook and every algorithm share. One
call, :meth:`Synchronizer.sync`, averages a list of keyed tensors over the
group in place. It owns:

* the plan (per tensor: uncompressed, or compressed by a strategy in K
  partitions keyed ``name#k``, the name escaped as every key built from it:
  :mod:`gradpress.exchange.keys`; see :mod:`gradpress.exchange.planner`);
* error feedback (:class:`~gradpress.exchange.feedback.Feedback`: worker,
  ring and PS-root residuals in one store, staged per step);
* the NaN/Inf protocol (:mod:`gradpress.exchange.nonfinite`);
* stats (:mod:`gradpress.exchange.stats`) and ``state_dict`` (:mod:`gradpress.exchange.state`).

The compressed part of a call (compensation, partitions, the strategies in
their order, reassembly) is :func:`gradpress.exchange.dispatch.exchange_compressed`.

Per call: tensors below ``min_numel``, 1-D tensors and tensors the plan
leaves uncompressed go through one fused plain allreduce (the prelude,
which also carries one NaN/Inf flag per tensor, and rides inside the
allreduce strategy's own collective when it can); the others are
error-compensated (whole), cut into their partitions, grouped by strategy
and exchanged strategy by strategy in a fixed order (``Strategy.order``); the residuals are
staged; the averages are written back. A step may span several calls (the
DDP hook's buckets): ``end_of_step=True`` on the last commits the step.
``used=`` (the DDP hook with ``find_unused_parameters``): a tensor no rank
used is not sent (left as it is) in a call that compresses something.

Invariant: every rank issues the same collectives in the same order with
the same sizes (the plan and the keys agree across ranks: checked at
construction by :mod:`gradpress.exchange.agree`), so averages are
bit-identical on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradpress.compress import Compressor, create
from gradpress.compress.base import all_finite
from gradpress.exchange.base import Encoded, Prelude, Strategy
from gradpress.exchange.dispatch import exchange_compressed
from gradpress.exchange.feedback import Feedback
from gradpress.exchange.keys import escape
from gradpress.exchange.nonfinite import NONFINITE_MODES, StepGuard, local_flags, zeroer
from gradpress.exchange.planner import Decision, Plan
from gradpress.exchange.plans import StrategyChoice, unused_everywhere
from gradpress.exchange.state import EngineState
from gradpress.exchange.stats import ExchangeStats
from gradpress.transport.collectives import fused_allreduce

__all__ = ["Synchronizer", "ParamSpec"]

#: (key, shape, dtype) of every tensor the engine will see
ParamSpec = tuple[str, Sequence[int], torch.dtype]


class Synchronizer(EngineState):
    """Averages keyed tensors over ``group``, compressed; see the module doc.

    ``params``: every tensor it will be asked to average (key, shape,
    dtype); the plan is made for them and they are part of the configuration
    all ranks must agree on. ``strategy``: ``collective`` (the default:
    allreduce if summable, else allgather, every eligible tensor
    compressed), a strategy name, or ``auto`` (the planner; call
    :meth:`replan` on every rank to measure). ``error_feedback``: None uses the compressor's default.
    ``nonfinite``: ``propagate`` | ``skip`` | ``raise``.
    """

    def __init__(
        self,
        compressor: str | Compressor,
        *,
        params: Sequence[ParamSpec],
        group: dist.ProcessGroup | None = None,
        error_feedback: bool | None = None,
        strategy: str = "collective",
        min_numel: int = 1024,
        seed: int = 0,
        nonfinite: str = "propagate",
        plan_costs: Any = None,
    ) -> None:
        if nonfinite not in NONFINITE_MODES:
            raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE_MODES)}, got {nonfinite!r}")
        if not isinstance(min_numel, int) or isinstance(min_numel, bool) or min_numel < 0:
            raise ValueError(f"min_numel must be an integer >= 0, got {min_numel!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if error_feedback is not None and not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be True, False or None (compressor default), got {error_feedback!r}")
        self.compressor = create(compressor)
        self.compressor.seed = seed
        self.error_feedback = self.compressor.default_error_feedback if error_feedback is None else error_feedback
        self.nonfinite = nonfinite
        self.min_numel = min_numel
        self.seed = seed
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.params = [(str(k), [int(s) for s in shape], str(dtype)) for k, shape, dtype in params]
        self.choice = StrategyChoice(self.compressor, strategy, group, min_numel, plan_costs)
        self.feedback = Feedback()
        self.stats_counter = ExchangeStats(count_skipped=nonfinite == "skip")
        self.guard = StepGuard(nonfinite, self._snapshot_state, self._restore_state, self.stats_counter)
        self.plan: Plan = self.choice.initial_plan(self.params)

    # ------------------------------------------------------------ properties
    @property
    def strategy_name(self) -> str:
        return self.choice.name

    @property
    def strategies(self) -> dict[str, Strategy]:
        return self.choice.strategies

    @property
    def cost_model(self) -> Any:
        return self.choice.cost_model

    @property
    def stats(self) -> dict[str, Any]:
        """A plain mapping; see ``STATS_KEYS`` for every key."""
        out = self.stats_counter.snapshot()
        out["nothing_compressed"] = bool(out["steps"]) and not self.compressor.identity and not out["compressed_tensors"]
        return out

    @property
    def last_step_skipped(self) -> bool:
        """True when the last completed step was dropped on every rank
        (``nonfinite='skip'``)."""
        return self.guard.last_skipped

    def replan(self, costs: Any = None) -> Plan:
        """Measure the group (or use ``costs``) and rebuild the plan.
        Collective: every rank, between steps."""
        self.plan = self.choice.replan(self.params, self.plan, costs, self.rank)
        return self.plan

    def config(self) -> dict[str, Any]:
        """Everything that must agree across ranks and across a resume."""
        return {
            "compressor": self.compressor.spec(),
            "error_feedback": self.error_feedback,
            "strategy": self.strategy_name,
            "min_numel": self.min_numel,
            "nonfinite": self.nonfinite,
            "seed": self.seed,
            "world_size": self.world_size,
            "plan_costs": self.choice.injected,
            "parameters": [list(p) for p in self.params],
        }

    # ------------------------------------------------------------------ sync
    def prepare(self, keys: Sequence[str], tensors: Sequence[torch.Tensor], *, step: int) -> Encoded | None:
        """Encode now, in the caller's thread, what ``sync(..., prepared=)``
        will exchange later (Comprex: compression in the training thread
        while the previous exchange is on the wire). Error feedback's
        residuals are kept at once by the local rule (:meth:`Feedback.keep_now`),
        since the next call encodes before this one's NaN verdict. None when
        the call cannot be split: ``nonfinite=skip`` (its verdict decides the
        residuals), nothing compressed, several strategies or partitions, or
        a strategy without ``encode`` (the ring re-compresses at every hop),
        or a multi-round compressor (PowerSGD's Q depends on the summed P).
        Also None while a step may be dropped (``StepGuard.may_drop``; a call in
        flight dropped before this one's sync would leave its Context step stale)."""
        if self.guard.may_drop:
            return None
        keys, tensors = list(keys), list(tensors)
        decisions = [self._decision(k, t) for k, t in zip(keys, tensors)]
        comp_idx = [i for i, d in enumerate(decisions) if d.compressed]
        names = {decisions[i].strategy for i in comp_idx}
        if len(names) != 1 or any(decisions[i].parts > 1 for i in comp_idx):
            return None
        strategy = self.strategies.get(names.pop())
        if strategy is None or not hasattr(strategy, "encode") or self.compressor.rounds > 1:
            return None
        t0 = time.perf_counter()
        fb = self.feedback if self.error_feedback else None
        tkeys = [escape(k) for k in keys]
        payload = [fb.compensate(tkeys[i], tensors[i]) if fb is not None else tensors[i] for i in comp_idx]
        encoded: Encoded = strategy.encode(self.compressor, payload, [self.context(tkeys[i], step) for i in comp_idx], fb)
        if fb is not None and encoded.residuals is not None:
            for i, r in zip(comp_idx, encoded.residuals):
                fb.keep_now(tkeys[i], r.reshape(tensors[i].shape))
        encoded.seconds = time.perf_counter() - t0
        encoded.counted = self.guard.counted(step)
        return encoded

    def sync(self, keys: Sequence[str], tensors: Sequence[torch.Tensor], *, step: int,
             flat: torch.Tensor | None = None, end_of_step: bool = True, prepared: Encoded | None = None,
             used: Sequence[bool] | None = None) -> None:
        """Average ``tensors`` (keyed by ``keys``) over the group, in place.

        ``flat``: a contiguous buffer of which the tensors are views (a DDP
        bucket), used when nothing is compressed. ``step``: the step every
        rank agrees on (shared randomness). ``end_of_step``: this call
        closes the step (residuals committed, stats counted). ``prepared``:
        :meth:`prepare`'s encoding of these same keys, tensors and step.
        ``used``: per tensor, whether this rank computed it this step (DDP's
        ``find_unused_parameters``, ``static_graph``; every rank passes it or
        none does); in a call that compresses something, a tensor no rank
        used is not sent, left as it is (DDP's reducer keeps such a gradient
        and discards the bucket's value of it), and no state of it moves, for
        one allreduce of a flag per tensor; a call that compresses nothing
        averages every tensor, as DDP does."""
        if used is not None and (prepared is not None or len(used) != len(keys)):
            raise ValueError(f"used: one flag per tensor ({len(keys)}), without prepared=; got {len(used)}")
        if prepared is not None:
            self.guard.check_counted(prepared.counted, step)
        try:
            self.guard.begin_call(snapshot=prepared is None)
            self._sync(list(keys), list(tensors), step, flat, end_of_step, prepared, used)
        finally:
            if end_of_step:
                self.guard.end_step(self.feedback)

    def _sync(self, keys: list[str], tensors: list[torch.Tensor], step: int, flat: torch.Tensor | None,
              end_of_step: bool, prepared: Encoded | None = None, used: Sequence[bool] | None = None) -> None:
        n = self.world_size
        decisions = [self._decision(k, t) for k, t in zip(keys, tensors)]
        dense_bytes = flat.numel() * flat.element_size() if flat is not None else sum(_nbytes(t) for t in tensors)
        unused, flag_bytes, flag_s = ([], 0, 0.0) if used is None else unused_everywhere(decisions, tensors, used,
                                                                                          self.group)
        tensor_bytes = {keys[i]: 0 for i in unused}  # sent nothing: left as they are
        if unused:  # the others only, never the bucket's buffer (it holds these too)
            gone, flat = set(unused), None
            keys, tensors, decisions = ([x[i] for i in range(len(x)) if i not in gone] for x in (keys, tensors, decisions))
        dense_idx = [i for i, d in enumerate(decisions) if not d.compressed]
        comp_idx = [i for i, d in enumerate(decisions) if d.compressed]
        tensor_bytes.update({keys[i]: _nbytes(tensors[i]) for i in dense_idx})
        if not comp_idx:
            self._sync_dense(keys, tensors, step, flat, dense_bytes, tensor_bytes, end_of_step, flag_bytes, flag_s)
            return
        t0 = time.perf_counter()
        plain = [tensors[i].mul(1.0 / n) for i in dense_idx]  # as DDP's reducer scales
        outcome: dict[str, Any] = {}

        def on_summed(summed: list[torch.Tensor]) -> bool:
            """Write back the plain tensors, learn every rank's NaN/Inf flags;
            True when the call is dropped (skip); raise mode raises here."""
            for i, s in zip(dense_idx, summed[:-1]):
                tensors[i].copy_(s)
            bad = summed[-1] > 0
            outcome["bad"] = bad
            return self.guard.observe(bad, [keys[i] for i in range(len(keys))], step, zeroer(tensors, flat))

        prelude = Prelude([*plain, local_flags(tensors, flat)], on_summed)
        by_strategy: dict[str, int] = {}
        comp_s, comm_s, sent, comp_bytes, stopped, host = exchange_compressed(self, keys, tensors, comp_idx, decisions,
                                                                                step, prelude, prepared, by_strategy)
        tensor_bytes.update(comp_bytes)
        sent, comm_s = sent + flag_bytes, comm_s + flag_s
        if flag_bytes:
            by_strategy["uncompressed"] = by_strategy.get("uncompressed", 0) + flag_bytes
        if not stopped:
            overflow = torch.stack([~all_finite(tensors[i]) for i in comp_idx]) & ~outcome["bad"][comp_idx]
            stopped = self.guard.observe_results(overflow, [keys[i] for i in comp_idx], step, zeroer(tensors, flat))
        bad = outcome.get("bad")
        # a CPU flag read costs nothing, and a clean call (the usual one) then skips a write pass over
        # every tensor; on an accelerator the masked fill stays (reading the flag would wait for it)
        if not stopped and self.nonfinite == "propagate" and (bad.device.type != "cpu" or bool(bad[comp_idx].any())):
            for i in comp_idx:  # every rank sees the NaN, so every rank's GradScaler skips alike
                tensors[i].masked_fill_(bad[i], float("nan"))
        total = time.perf_counter() - t0
        self.stats_counter.record(
            sent=sent, dense=dense_bytes, compress_s=0.0 if stopped else min(comp_s, total), comm_s=comm_s,
            compressed=0 if stopped else len(comp_idx), plain=len(dense_idx), tensor_bytes=tensor_bytes,
            end_of_step=end_of_step, host=host, by_strategy=by_strategy,
        )

    def _sync_dense(self, keys: list[str], tensors: list[torch.Tensor], step: int, flat: torch.Tensor | None,
                    dense_bytes: int, tensor_bytes: dict[str, int], end_of_step: bool, flag_bytes: int = 0,
                    flag_s: float = 0.0) -> None:
        """Nothing to compress: exactly what DDP's built-in reduction does
        (the reducer multiplies by 1/N while filling the bucket, then sums);
        a NaN/Inf travels as it does in plain DDP and survives the sum, so
        every rank sees the same thing: no flag exchange."""
        n = self.world_size
        t = time.perf_counter()
        if not tensors:  # every tensor of the call was left as it is (no rank used it): nothing to average
            sent, bad = 0, None
        elif flat is not None:
            flat.mul_(1.0 / n)
            if n > 1:
                dist.all_reduce(flat, group=self.group)
            sent = dense_bytes
            bad = self.guard.not_finite(flat)
        else:
            summed, sent = fused_allreduce([x.mul(1.0 / n) for x in tensors], self.group)
            for x, s in zip(tensors, summed):
                x.copy_(s)
            bad = self.guard.any_bad(tensors)
        comm = time.perf_counter() - t + flag_s
        sent += flag_bytes
        if bad is not None:
            self.guard.observe_dense(bad, keys, tensors, step, zeroer(tensors, flat))
        self.stats_counter.record(sent=sent, dense=dense_bytes, compress_s=0.0, comm_s=comm, compressed=0,
                                  plain=len(tensors), tensor_bytes=tensor_bytes, end_of_step=end_of_step,
                                  by_strategy={"uncompressed": sent})

    def _decision(self, key: str, x: torch.Tensor) -> Decision:
        d = self.plan.decisions.get(key)
        if d is None or d.numel != x.numel():
            d = self.choice.default_decision(key, x.numel(), list(x.shape))
        return d


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

