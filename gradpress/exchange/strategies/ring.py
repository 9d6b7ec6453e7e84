"""``ring``: compressed ring allreduce over point-to-point messages.

Comprex (Kim et al.) and HiPress's compression-aware Ring (Bai et al., SOSP
2021). Every tensor of one call is scaled by 1/N and cut into N pieces;
chunk ``c`` of the ring is piece ``c`` of every tensor (in key order: DDP
reorders a bucket's tensors when it rebuilds buckets), each piece compressed
on its own under its tensor's key, so a result never depends on which
tensors share a bucket. Chunk ``c`` ends up owned by rank ``c - 1 (mod N)``.
One message per hop carries the chunk's pieces of all tensors:

* reduce-scatter, N - 1 hops: at hop s rank r sends chunk ``r - s`` to
  ``r + 1`` and receives chunk ``r - s - 1`` from ``r - 1``. Non-summable
  compressors decode what arrives, add their own chunk and re-compress the
  partial sum with the residual this rank keeps for those positions. Summable
  compressors (none, fp16, random-k) skip the decode: each rank encodes its
  own chunk and adds payloads directly.
* the owner of each fully reduced chunk compresses it once (non-summable: with
  its residual; summable: the summed payload is already a packet);
* allgather, N - 1 hops: those bytes are forwarded unchanged, so every rank
  decodes the same N packets and replicas stay bit-identical.

Residuals (non-summable, error feedback on): every rank encodes every chunk
exactly once per step (its own chunk first, N - 2 partial sums at hops, the
chunk it owns), so it keeps one residual per position of each tensor, in the
engine's feedback store under the ``ring`` namespace and the tensor key
(DDP regroups tensors into new buckets after the first iteration; a
per-bucket key would lose them), staged and committed with the step like
every residual, and adds it to whatever it encodes at those positions next
step. Its own values then enter exactly: the worker's residual is zero.
Summable compressors keep no residual here: the estimate is
``decode(encode(p))`` per chunk and the worker's residual keeps the rest. With error feedback off no residual is
kept anywhere (unbiased compressors stay unbiased hop by hop). Messages are posted with ``isend``/``irecv`` then
waited on (see :mod:`gradpress.transport.p2p`): no ordering can deadlock on gloo.
Variable-size packets are preceded by their size; fixed sizes are known to
the receiver from a template packet.

Not for majority-vote compressors (a sign of partial sums is not a vote) nor
multi-round protocols (PowerSGD).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Mapping
from typing import Any

import torch

from gradpress.compress.base import Compressor, Context, Packet
from gradpress.exchange.base import ExchangeResult, Prelude, Strategy, bound_summand, register_strategy
from gradpress.exchange.costs import CostModel
from gradpress.exchange.feedback import Feedback, namespace
from gradpress.exchange.keys import hop_key, split_key
from gradpress.exchange.strategies.recompress import template, unsupported_reason
from gradpress.transport import wire
from gradpress.transport.p2p import exchange_bytes

__all__ = ["Ring", "chunk_bounds"]

#: where the hop residuals live in the engine's feedback store
RING = namespace("ring", suffix="")


#: a hop's exchanged key (:func:`~gradpress.exchange.keys.hop_key`; a tensor's escaped key holds no '#')
_HOP = re.compile(r"#ring\d+")


def _keys(tree: Any) -> list[str]:
    """Every string key of the mappings nested in ``tree`` (dicts, lists, tuples)."""
    out: list[str] = []
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            out += ([key] if isinstance(key, str) else []) + _keys(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            out += _keys(value)
    return out


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [start, end) ranges covering ``numel``; sizes
    differ by at most one (the first ones are longer)."""
    base, extra = divmod(numel, parts)
    out = []
    start = 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


@register_strategy("ring")
class Ring(Strategy):
    """Compressed ring allreduce; see the module docstring."""

    order = 2
    reshard_refusal = ("its per-hop residuals (the ring/ namespace) belong to the chunk positions of a ring of "
                       "the saved world size")

    @staticmethod
    def reshard_held(state: Mapping[str, Any]) -> str | None:
        """What in a saved rank's engine ``state`` belongs to a ring of its world size, or None: the ring's own
        state, a hop residual (the ring/ namespace; a non-summable compressor with error feedback) or compressor
        state under a hop's key (``<key>#ring<c>``: a stateful compressor re-compressing at the hops). A summable
        compressor, or one without state with error feedback off, leaves none: such a checkpoint folds."""
        own = (state.get("strategies") or {}).get("ring")
        if own:
            return f"ring state {sorted(map(str, own))}"
        fb = state.get("feedback")
        residuals = fb.get("residuals") if isinstance(fb, Mapping) else None
        for key in residuals if isinstance(residuals, Mapping) else ():
            if isinstance(key, str) and split_key(key)[0] == RING:
                return f"residual {key!r}"
        keys = _keys(state.get("compressor"))
        return next((f"compressor state of {k!r}" for k in keys if _HOP.search(k)), None)

    def __init__(self, group: Any) -> None:
        super().__init__(group)
        self.comm_s = 0.0

    def supports(self, compressor: Compressor) -> str | None:
        return unsupported_reason(compressor, "ring")

    @classmethod
    def predict(cls, costs: CostModel, numel: int, world_size: int, summable: bool, *,
                elem_size: int = 4) -> tuple[float, int]:
        """Chunks of ``d_c = d / N``: ``N ENC(d_c) + 2 (N-1) P2P(c(d_c)) +
        N DEC(d_c)``, plus ``(N-1) DEC(d_c)`` at the hops when not summable.
        Partitioning does not help a ring (it already splits): K = 1."""
        n = world_size
        dc = float(numel) / n
        hops = n * costs.encode(dc) + 2 * (n - 1) * costs.p2p(costs.wire(dc)) + n * costs.decode(dc)
        if not summable:
            hops += (n - 1) * costs.decode(dc)
        return hops, 1

    def exchange(
        self, compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context],
        feedback: Feedback | None, *, prelude: Prelude | None = None, out: list[torch.Tensor] | None = None,
    ) -> ExchangeResult:
        t0 = time.perf_counter()
        self.comm_s = 0.0
        # tensors travel in key order: DDP lists a bucket's tensors in another
        # order after it rebuilds its buckets; the messages must not depend on it
        order = sorted(range(len(tensors)), key=lambda i: ctxs[i].key)
        avgs, ests, sent, payload = self._ring(
            compressor, [tensors[i] for i in order], [ctxs[i] for i in order], feedback
        )
        results: list[torch.Tensor | None] = [None] * len(tensors)
        residuals: list[torch.Tensor | None] | None = [None] * len(tensors) if feedback is not None else None
        tensor_bytes = [0] * len(tensors)
        for pos, i in enumerate(order):
            results[i] = avgs[pos].view(tensors[i].shape)
            if residuals is not None:
                # the tensors are the engine's own: the residual is formed in place
                own = tensors[i]
                residuals[i] = own.zero_() if ests is None else own.sub_(ests[pos].view(own.shape))
            tensor_bytes[i] = payload[pos]
        compress_s = max(0.0, time.perf_counter() - t0 - self.comm_s)
        return ExchangeResult(results, sent, residuals, tensor_bytes, compress_s, self.comm_s)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ ring
    def _send_recv(self, buf: torch.Tensor, size: int | None, variable: bool) -> tuple[torch.Tensor, int]:
        n, r = self.world_size, self.rank
        t = time.perf_counter()
        got, sent = exchange_bytes({(r + 1) % n: buf}, {(r - 1) % n: None if variable else size}, self.group, variable, buf.device)
        self.comm_s += time.perf_counter() - t
        return got[(r - 1) % n], sent

    def _ring(
        self, compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context], feedback: Feedback | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, int, list[int]]:
        """Per tensor: the average and this rank's estimate (None when its own
        values entered exactly, or feedback is off); bytes sent; per tensor
        the payload bytes this rank originated.

        Every tensor is cut into N pieces; chunk ``c`` of the ring is piece
        ``c`` of every tensor (one message per hop carries them all), each
        piece compressed on its own under the key ``"<tensor key>#ring<c>"``.
        A tensor's result thus never depends on which tensors share its
        bucket (DDP regroups them after its first iteration)."""
        n, r = self.world_size, self.rank
        m = len(tensors)
        scale = 1.0 / n
        origs = [t.reshape(-1) for t in tensors]
        flats = [o * scale for o in origs]
        bounds = [chunk_bounds(f.numel(), n) for f in flats]
        c0 = ctxs[0]
        payload = [0] * m

        def ctx(i: int, c: int) -> Context:
            return dataclasses.replace(c0, key=hop_key(ctxs[i].key, c), rank=r, world_size=n)  # c0's step, seed, scale

        def piece(values: list[torch.Tensor], i: int, c: int) -> torch.Tensor:
            a, b = bounds[i][c]
            return values[i][a:b]

        def count(pks: list[Packet]) -> None:
            for i, pk in enumerate(pks):
                payload[i] += pk.nbytes

        def decode_all(pks: list[Packet]) -> list[torch.Tensor]:
            return [compressor.decode(pk).reshape(-1) for pk in pks]

        if n == 1:
            pks = [compressor.encode(piece(flats, i, 0), ctx(i, 0)) for i in range(m)]
            count(pks)
            outs = [d / scale for d in decode_all(pks)]
            return outs, ([o.clone() for o in outs] if feedback is not None else None), 0, payload
        variable = bool(compressor.variable_size) and not compressor.is_summable
        final: list[list[Packet] | None] = [None] * n
        sent = 0
        owned = (r + 1) % n
        est_pieces: list[list[torch.Tensor]] | None = None
        if compressor.is_summable:
            # every hop adds payloads in their own dtype: bounded summands keep the sum finite (no scaler)
            own = [[compressor.encode(bound_summand(compressor, piece(flats, i, c), n, hc), hc)
                    for i in range(m) for hc in (ctx(i, c),)]
                   for c in range(n)]
            if feedback is not None:
                est_pieces = [decode_all(own[c]) for c in range(n)]
            out = own[r]
            count(out)
            for s in range(n - 1):
                c = (r - s - 1) % n
                size = sum(pk.nbytes for pk in own[c])
                got, nbytes = self._send_recv(wire.pack_packets(out, False), size, False)
                sent += nbytes
                theirs = wire.unpack_packets(got, own[c], False)
                out = [
                    Packet([a + b for a, b in zip(t.tensors, o.tensors)], o.shape, o.dtype, dict(o.meta))
                    for t, o in zip(theirs, own[c])
                ]
                if s < n - 2:
                    count(out)
            final[owned] = out
            templates = own
        else:
            templates = [
                [template(compressor, piece(flats, i, c).shape, flats[i].dtype, flats[i].device) for i in range(m)]
                for c in range(n)
            ]
            store_keys = [Feedback.key(RING, c.key) for c in ctxs]
            resid = [feedback.current(k, f) for k, f in zip(store_keys, flats)] if feedback is not None else None

            def encode(c: int, values: list[torch.Tensor]) -> list[Packet]:
                pks = []
                for i, value in enumerate(values):
                    if resid is None:
                        pks.append(compressor.encode(value, ctx(i, c)))
                        continue
                    a, b = bounds[i][c]
                    p = value + resid[i][a:b]
                    pk = compressor.encode(p, ctx(i, c))
                    # staged whole after the ring; the store's one NaN rule decides
                    resid[i][a:b] = p - compressor.decode(pk).reshape(-1)
                    pks.append(pk)
                count(pks)
                return pks

            # every rank encodes every chunk exactly once per step (its own first,
            # N - 2 partial sums at hops, the sum it owns), each with the residual
            # of those positions: its own values count exactly (estimate = p)
            out = encode(r, [piece(flats, i, r) for i in range(m)])
            for s in range(n - 1):
                c = (r - s - 1) % n
                size = sum(pk.nbytes for pk in templates[c])
                got, nbytes = self._send_recv(wire.pack_packets(out, variable), size, variable)
                sent += nbytes
                theirs = decode_all(wire.unpack_packets(got, templates[c], variable))
                out = encode(c, [t + piece(flats, i, c) for i, t in enumerate(theirs)])
            final[owned] = out
            if feedback is not None and resid is not None:
                for k, e in zip(store_keys, resid):
                    feedback.stage(k, e)
        # allgather: forward the owners' bytes unchanged
        decoded: list[list[torch.Tensor] | None] = [None] * n
        decoded[owned] = decode_all(final[owned])  # type: ignore[arg-type]
        buf = wire.pack_packets(final[owned], variable)  # type: ignore[arg-type]
        for s in range(n - 1):
            c = (r - s) % n
            size = sum(pk.nbytes for pk in templates[c])
            got, nbytes = self._send_recv(buf, size, variable)
            sent += nbytes
            decoded[c] = decode_all(wire.unpack_packets(got, templates[c], variable))
            buf = got
        avgs = [torch.cat([decoded[c][i] for c in range(n)]) for i in range(m)]  # type: ignore[index]
        if feedback is None:
            estimates = None
        elif est_pieces is not None:
            estimates = [torch.cat([est_pieces[c][i] for c in range(n)]) / scale for i in range(m)]
        else:
            estimates = None  # own values entered exactly; the ring residuals hold the error
        return avgs, estimates, sent, payload
