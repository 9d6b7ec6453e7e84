"""The compressed part of one :meth:`~gradpress.exchange.engine.Synchronizer.sync` call: error
compensation, partitions, the strategies' exchanges in their fixed order, reassembly, residuals staged.

Invariant: every rank groups the same keys under the same strategies and runs the groups in the same order
(``Strategy.order``, then the name), so every rank issues the same collectives with the same sizes. A
tensor the plan cuts into K partitions is compensated whole (its worker residual is kept whole, keyed by
its escaped name), cut into flat pieces keyed ``name#k`` (:func:`~gradpress.exchange.keys.part_key`), and
its residual is staged whole again once every piece is back.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from gradpress.compress import Context
from gradpress.exchange.base import Encoded, ExchangeResult, Prelude
from gradpress.exchange.keys import escape, part_key
from gradpress.exchange.planner import Decision
from gradpress.transport.collectives import fused_allreduce

if TYPE_CHECKING:
    from gradpress.exchange.engine import Synchronizer

__all__ = ["exchange_compressed"]


def exchange_compressed(
    engine: Synchronizer, keys: list[str], tensors: list[torch.Tensor], comp_idx: list[int], decisions: list[Decision],
    step: int, prelude: Prelude, prepared: Encoded | None = None, by_strategy: dict[str, int] | None = None,
) -> tuple[float, float, int, dict[str, int], bool, int]:
    """``engine``'s exchange of the tensors ``comp_idx`` of a call: compensate each tensor whole, cut it
    into its planned partitions, exchange each strategy's group (fixed order; the first one that
    ``carries_prelude`` takes ``prelude`` along, else it is summed first), reassemble, stage the
    residuals (``prepared``: encoded by ``Synchronizer.prepare``, residuals kept there). Returns (compress s, comm s, bytes, bytes per key, stopped, bytes
    that stayed inside a host); ``by_strategy`` gets the bytes per
    strategy that handed them over (``uncompressed``: the prelude's own
    plain allreduce)."""
    split = {} if by_strategy is None else by_strategy

    def count(name: str, nbytes: int) -> None:
        if nbytes:
            split[name] = split.get(name, 0) + nbytes
    t0 = time.perf_counter()
    fb = engine.feedback if engine.error_feedback else None
    tkeys = {i: escape(keys[i]) for i in comp_idx}  # every key built from a tensor's name starts here
    if prepared is not None:  # encoded (and its residuals kept) by prepare(): nothing to compensate or stage
        compensated, fb = [tensors[i] for i in comp_idx], None
    else:
        compensated = [fb.compensate(tkeys[i], tensors[i]) if fb is not None else tensors[i] for i in comp_idx]
    groups: dict[str, list[tuple[int, torch.Tensor, Context, torch.Tensor | None]]] = {}
    for pos, i in enumerate(comp_idx):
        d, p, key = decisions[i], compensated[pos], tkeys[i]
        if d.parts <= 1:
            groups.setdefault(d.strategy, []).append((pos, p, engine.context(key, step), tensors[i]))
        else:
            for k, part in enumerate(torch.tensor_split(p.reshape(-1), d.parts)):
                groups.setdefault(d.strategy, []).append((pos, part, engine.context(part_key(key, k), step), None))
    missing = [name for name in groups if name not in engine.strategies]
    if missing:
        raise RuntimeError(f"plan uses strategy {missing[0]!r}, which this engine cannot use with {engine.compressor.name!r}")
    # the strategies' fixed order: every rank issues the same collectives in the same order
    order = sorted(groups, key=lambda name: (engine.strategies[name].order, name))
    comp_s, comm_s, sent = time.perf_counter() - t0 + (prepared.seconds if prepared else 0.0), 0.0, 0
    host = 0
    pending: Prelude | None = prelude
    if not engine.strategies[order[0]].carries_prelude:
        t = time.perf_counter()
        summed, sent = fused_allreduce(prelude.tensors, engine.group)
        comm_s += time.perf_counter() - t
        count("uncompressed", sent)
        if prelude.on_summed(summed):
            return 0.0, comm_s, sent, {}, True, 0
        pending = None
    outs: list[list[torch.Tensor]] = [[] for _ in comp_idx]
    resids: list[list[torch.Tensor]] = [[] for _ in comp_idx]
    nbytes = [0] * len(comp_idx)
    for name in order:
        items = groups[name]
        t1 = time.perf_counter()
        extra = {"encoded": prepared} if prepared is not None else {}
        result: ExchangeResult = engine.strategies[name].exchange(
            engine.compressor, [t for _, t, _, _ in items], [c for _, _, c, _ in items], fb,
            prelude=pending, out=[o for _, _, _, o in items], **extra,
        )
        pending = None
        sent += result.bytes_sent
        host += result.host_bytes
        count("uncompressed", result.plain_bytes)
        count(name, result.bytes_sent - result.plain_bytes)
        comp_s += result.compress_s
        comm_s += max(0.0, time.perf_counter() - t1 - result.compress_s)
        if result.stopped:
            return 0.0, comm_s, sent, {}, True, host
        for j, (pos, _, _, _) in enumerate(items):
            outs[pos].append(result.tensors[j])
            if result.residuals is not None:
                resids[pos].append(result.residuals[j])
            nbytes[pos] += result.tensor_bytes[j]
    t2 = time.perf_counter()
    tensor_bytes = {}
    for pos, i in enumerate(comp_idx):
        x, key = tensors[i], keys[i]
        avg = outs[pos][0] if len(outs[pos]) == 1 else torch.cat([o.reshape(-1) for o in outs[pos]])
        if fb is not None and len(resids[pos]) == len(outs[pos]):
            r = resids[pos][0] if len(resids[pos]) == 1 else torch.cat([e.reshape(-1) for e in resids[pos]])
            fb.stage(tkeys[i], r.reshape(x.shape))
        if avg is not x:
            x.copy_(avg.reshape(x.shape))
        tensor_bytes[key] = nbytes[pos]
    if engine.output_scale != 1.0 and engine.compressor.scale_degree == 0:
        # after every strategy's aggregation (a majority vote is the sign of a sum: scale-free again), in one pass
        torch._foreach_mul_([tensors[i] for i in comp_idx], engine.output_scale)
    comp_s += time.perf_counter() - t2
    return comp_s, comm_s, sent, tensor_bytes, False, host

