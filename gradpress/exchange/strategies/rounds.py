"""The multi-round allreduce protocol (``Compressor.rounds > 1``; PowerSGD:
P then Q), behind the allreduce strategy's contract.

Per tensor the compressor says ``begin`` (first tensor to sum, or None:
travel dense), ``advance`` (given the sum, the next tensor, or None: done)
and ``finish`` (the averaged approximation, written into ``out`` when it
can). Every round is one fused allreduce of all tensors still active, in
input order, so every rank issues the same collectives. The prelude (plain
tensors, NaN/Inf flags) rides in the first round: two collectives per bucket
for PowerSGD instead of three.

Residual (error feedback): ``p - approximation``, formed in place on the
caller's own ``p``; a tensor that travelled dense dropped nothing (zero).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from gradpress.compress.base import Compressor, Context
from gradpress.exchange.base import ExchangeResult, Prelude
from gradpress.exchange.feedback import Feedback
from gradpress.transport.collectives import fused_allreduce

__all__ = ["run_rounds"]

_DENSE = object()


def run_rounds(
    compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context], feedback: Feedback | None,
    group: dist.ProcessGroup | None, prelude: Prelude | None, out: list[torch.Tensor] | None,
) -> ExchangeResult:
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    comp_s = comm_s = 0.0
    sent = 0
    tensor_bytes = [0] * len(tensors)
    states: list[Any] = []
    outgoing: list[torch.Tensor | None] = []
    dense: set[int] = set()
    t = time.perf_counter()
    for j, (p, ctx) in enumerate(zip(tensors, ctxs)):
        state, first = compressor.begin(p, ctx)
        if first is None:
            dense.add(j)
            state, first = _DENSE, p.div(n)
        states.append(state)
        outgoing.append(first)
    comp_s += time.perf_counter() - t
    active = list(range(len(tensors)))
    dense_sums: dict[int, torch.Tensor] = {}
    first_round = True
    while active:
        extra = prelude.tensors if (first_round and prelude is not None) else []
        t = time.perf_counter()
        summed, nbytes = fused_allreduce([*(outgoing[j] for j in active), *extra], group)  # type: ignore[misc]
        comm_s += time.perf_counter() - t
        sent += nbytes
        if extra:
            if prelude is not None and prelude.on_summed(summed[len(active):]):
                return ExchangeResult([], sent, compress_s=comp_s, comm_s=comm_s, stopped=True)
            summed = summed[: len(active)]
        for j, s in zip(active, summed):
            tensor_bytes[j] += s.numel() * s.element_size()
        t = time.perf_counter()
        nxt = []
        for j, s in zip(active, summed):
            if j in dense:
                dense_sums[j] = s
                outgoing[j] = None
                continue
            outgoing[j] = compressor.advance(states[j], s, ctxs[j])
            if outgoing[j] is not None:
                nxt.append(j)
        comp_s += time.perf_counter() - t
        active = nxt
        first_round = False
    t = time.perf_counter()
    results: list[torch.Tensor] = []
    residuals: list[torch.Tensor] | None = [] if feedback is not None else None
    for j, p in enumerate(tensors):
        dst = out[j] if out is not None else None
        if j in dense:
            avg = dense_sums[j].view(p.shape)
            if dst is not None:
                avg = dst.copy_(avg.view_as(dst))
        else:
            avg = compressor.finish(states[j], out=dst)  # written into dst when it can
        results.append(avg)
        if residuals is not None:
            # p is the caller's own tensor: it becomes the residual in place
            residuals.append(p.zero_() if j in dense else p.sub_(avg.reshape(p.shape).to(p.dtype)))
    comp_s += time.perf_counter() - t
    return ExchangeResult(results, sent, residuals, tensor_bytes, comp_s, comm_s)
