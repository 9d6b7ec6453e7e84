"""The pipelined exchange of :class:`~gradpress.exchange.strategies.hierarchical.Hierarchical`
(``chunk`` > 0): pieces of whole rows (:mod:`gradpress.exchange.pieces`)
through three overlapped stages, host reduce, leaders' move, combine and
host broadcast. Kept apart from the strategy's layout, checks and
unpipelined path; ``self`` is the strategy (its groups, leader, outer
strategy and wire thread).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from gradpress.compress.base import Compressor, Context
from gradpress.exchange.base import ExchangeResult
from gradpress.exchange.feedback import Feedback
from gradpress.exchange.pieces import Piece, piece_context
from gradpress.exchange.strategies.hierarchical_abort import is_marked, mark_failed

__all__ = ["pipelined"]


def pipelined(
    self: Any, compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context], keys: list[str],
    feedback: Feedback | None, pieces: list[Piece],
) -> ExchangeResult:
    """The same exchange in three stages per piece, overlapped: every rank
    posts the pieces' host reduces at once (async, on the host's group);
    the leader encodes each reduced piece as it arrives (``outer.encode``)
    and hands its packets to one wire thread (``outer.move``: the leaders'
    collective, pieces back to back, one flow at a time on the slow
    link); meanwhile it combines the piece before (``outer.combine``:
    decode and average) and broadcasts it (async). Every rank issues the
    same collectives in the same order on every group; the result equals
    exchanging each piece alone. A leader stage that raises: the pieces on
    the wire are waited for, every piece not broadcast yet is broadcast as
    the abort marker, and the error is re-raised; the workers read the
    last piece and raise an error naming the leader."""
    t0 = time.perf_counter()
    per, src = self.workers_per_host, self._leader_global
    dense = sum(t.numel() * t.element_size() for t in tensors) if per > 1 else 0
    # in place (the tensors are the caller's to reuse; a non-contiguous one is copied alone, in its own
    # dtype): no fused copy, whose fresh model-sized allocation (page faults) held the first host reduce
    # back by 20-110 ms per call
    views = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    span = [p.of(views[p.tensor]).reshape(-1) for p in pieces]
    reduces = [dist.reduce(x, dst=src, group=self.intra, async_op=True) for x in span] if per > 1 else []
    sent = dense
    tensor_bytes = [0 if self.is_leader else t.numel() * t.element_size() for t in tensors]
    compress_s = 0.0
    if not self.is_leader:
        for w in reduces:
            w.wait()
        casts = [dist.broadcast(x, src=src, group=self.intra, async_op=True) for x in span]
        for w in casts:
            w.wait()
        if span and is_marked(span[-1]):  # the last piece is broadcast last: marked whenever the leader failed
            raise self._leader_failed(ctxs)
    else:
        casts: list[Any] = []
        in_flight: list[Any] = []  # (piece, encoded, wire ticket) handed to the wire thread, not combined yet
        failure = None
        try:
            sent, compress_s = _lead(self, compressor, ctxs, keys, feedback, pieces, views, span, reduces, casts,
                                     in_flight, sent, tensor_bytes)
        except Exception as exc:  # noqa: BLE001 - the host is told (the marker), then it is re-raised
            failure = exc
            _abort(self, span, reduces, casts, in_flight)
        sent += dense
        for w in casts:
            w.wait()
        if failure is not None:
            raise failure
    # every worker's values entered the host sum exactly: its own residual is zero
    residuals = [torch.zeros_like(t) for t in tensors] if feedback is not None else None
    total = time.perf_counter() - t0
    host = dense * (2 if self.is_leader else 1)  # reduce in (every rank), broadcast out (the leader)
    return ExchangeResult(views, sent, residuals, tensor_bytes, compress_s, max(0.0, total - compress_s),
                          host_bytes=host)


def _lead(
    self: Any, compressor: Compressor, ctxs: list[Context], keys: list[str], feedback: Feedback | None,
    pieces: list[Piece], views: list[torch.Tensor], span: list[torch.Tensor], reduces: list[Any], casts: list[Any],
    in_flight: list[Any], sent: int, tensor_bytes: list[int],
) -> tuple[int, float]:
    """The leader's stages: encode piece i + 1 while the wire thread moves
    piece i, combine piece i - 1 and post its broadcast (into ``casts``;
    the pieces on the wire in ``in_flight``). Returns the bytes sent so far
    and the codec seconds."""
    per, src = self.workers_per_host, self._leader_global
    compress_s = 0.0
    kept = [torch.empty_like(v) for v in views] if feedback is not None else None
    owed = [feedback.current(k, v) for k, v in zip(keys, views)] if feedback is not None else None
    outer, wire = self._outer_strategy(compressor), self._wire_thread()

    def finish() -> None:
        nonlocal sent, compress_s
        i, encoded, ticket = in_flight.pop(0)
        p = pieces[i]
        moved, nbytes = wire.wait(ticket)
        t = time.perf_counter()
        span[i].copy_(outer.combine(compressor, encoded, moved)[0].reshape(-1))  # type: ignore[attr-defined]
        compress_s += time.perf_counter() - t
        if kept is not None and encoded.residuals is not None:
            p.of(kept[p.tensor]).copy_(encoded.residuals[0].view(p.of(kept[p.tensor]).shape))
        sent += nbytes
        tensor_bytes[p.tensor] += encoded.packets[0].nbytes
        if per > 1:
            casts.append(dist.broadcast(span[i], src=src, group=self.intra, async_op=True))

    for i, p in enumerate(pieces):
        if reduces:
            reduces[i].wait()
        q = p.of(views[p.tensor]).div_(per)
        if owed is not None:
            q = q.add(p.of(owed[p.tensor]), alpha=feedback.beta)  # type: ignore[union-attr]
        encoded = outer.encode(compressor, [q], [piece_context(ctxs[p.tensor], p)], feedback)  # type: ignore[attr-defined]
        compress_s += encoded.seconds
        in_flight.append((i, encoded, wire.submit(f"hierarchical piece {i}", self._move(outer, compressor, encoded))))
        if len(in_flight) > 1:  # piece i is queued behind piece i - 1: combine that one meanwhile
            finish()
    while in_flight:
        finish()
    if kept is not None:
        for k, r in zip(keys, kept):
            feedback.stage(k, r)  # type: ignore[union-attr]
    return sent, compress_s


def _abort(self: Any, span: list[torch.Tensor], reduces: list[Any], casts: list[Any], in_flight: list[Any]) -> None:
    """A leader's stage raised: let the wire thread finish the moves it was
    given (the other leaders issue them too), wait for the host reduces,
    then broadcast the abort marker in every piece not broadcast yet (its
    host's workers posted every piece's broadcast)."""
    for _, _, ticket in in_flight:
        try:
            self._wire_thread().wait(ticket)
        except Exception:  # noqa: BLE001, S110 - the first error is the one raised
            pass
    in_flight.clear()
    for w in reduces:
        w.wait()
    if self.workers_per_host > 1:
        for x in span[len(casts):]:
            mark_failed(x)
            casts.append(dist.broadcast(x, src=self._leader_global, group=self.intra, async_op=True))
