"""``ring``: compressed ring allreduce over point-to-point messages.

Comprex (Kim et al.) and HiPress's compression-aware Ring (Bai et al., SOSP
2021). All tensors of one call (same dtype) are fused, in order of their keys (DDP
reorders a bucket's tensors when it rebuilds buckets), into one flat vector,
scaled by 1/N and cut into N chunks; chunk ``c`` ends up owned by rank
``c - 1 (mod N)``. One message per hop:

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
chunk it owns), so it keeps one residual per position of the fused vector,
stored per tensor key (DDP regroups tensors into new buckets after the first
iteration; a per-bucket key would lose them) and adds it to whatever it
encodes at those positions next step. Its own values then enter exactly: the
estimate is ``p`` and the hook's residual stays zero. Summable compressors
keep no residual here: the estimate is ``decode(encode(p))`` per chunk and the
hook's error feedback keeps the rest. With error feedback off no residual is
kept anywhere (unbiased compressors stay unbiased hop by hop). Messages are posted with ``isend``/``irecv`` then
waited on (see :mod:`gradpress.comm.p2p`): no ordering can deadlock on gloo.
Variable-size packets are preceded by their size; fixed sizes are known to
the receiver from a template packet.

Not for majority-vote compressors (a sign of partial sums is not a vote) nor
multi-round protocols (PowerSGD).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from gradpress import wire
from gradpress.comm.base import ExchangeResult, Strategy, register_strategy
from gradpress.comm.p2p import exchange_bytes
from gradpress.comm.recompress import template
from gradpress.compress.base import Compressor, Context, Packet

__all__ = ["Ring", "chunk_bounds"]


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


def unsupported_reason(compressor: Compressor, strategy: str) -> str | None:
    if compressor.rounds > 1:
        return f"compressor {compressor.name!r} runs its own multi-round allreduce protocol; use strategy 'allreduce'"
    if compressor.aggregation != "mean":
        return (
            f"compressor {compressor.name!r} aggregates by {compressor.aggregation} vote, which needs every "
            f"rank's packet; strategy {strategy!r} re-compresses partial sums; use 'allgather'"
        )
    return None


@register_strategy("ring")
class Ring(Strategy):
    """Compressed ring allreduce; see the module docstring."""

    def __init__(self, group: Any) -> None:
        super().__init__(group)
        #: per tensor key: this rank's re-compression residual (scaled by 1/N)
        self.residuals: dict[str, torch.Tensor] = {}
        self.comm_s = 0.0

    def supports(self, compressor: Compressor) -> str | None:
        return unsupported_reason(compressor, "ring")

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.residuals = {k: v.clone() for k, v in state.get("residuals", {}).items()}

    def exchange(
        self, compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context], want_estimates: bool
    ) -> ExchangeResult:
        t0 = time.perf_counter()
        self.comm_s = 0.0
        results: list[torch.Tensor | None] = [None] * len(tensors)
        estimates: list[torch.Tensor | None] | None = [None] * len(tensors) if want_estimates else None
        sent = 0
        by_dtype: dict[torch.dtype, list[int]] = {}
        # fuse in key order: DDP lists a bucket's tensors in a different order
        # after it rebuilds buckets, and the chunks must not depend on it
        for i in sorted(range(len(tensors)), key=lambda i: ctxs[i].key):
            by_dtype.setdefault(tensors[i].dtype, []).append(i)
        tensor_bytes = [0] * len(tensors)
        for idxs in by_dtype.values():
            avg, est, nbytes, payload = self._ring(
                compressor, [tensors[i] for i in idxs], [ctxs[i] for i in idxs], want_estimates
            )
            sent += nbytes
            offset = 0
            total = sum(tensors[i].numel() for i in idxs)
            for i in idxs:
                n = tensors[i].numel()
                results[i] = avg[offset : offset + n].view(tensors[i].shape)
                if estimates is not None and est is not None:
                    estimates[i] = est[offset : offset + n].view(tensors[i].shape)
                # payload bytes of the fused vector, attributed in proportion to size
                tensor_bytes[i] = payload * n // max(total, 1)
                offset += n
        compress_s = max(0.0, time.perf_counter() - t0 - self.comm_s)
        return ExchangeResult(results, sent, estimates, tensor_bytes, compress_s)  # type: ignore[arg-type]

    # ------------------------------------------------------------- residuals
    def _residual(self, ctxs: list[Context], tensors: list[torch.Tensor], flat: torch.Tensor) -> torch.Tensor:
        """This rank's re-compression residual over the fused vector, from
        per-tensor pieces (keyed by tensor key, so DDP's bucket rebuild, which
        regroups tensors, keeps them)."""
        res = self.residuals
        return torch.cat([
            res[c.key].to(flat.dtype) if c.key in res and res[c.key].numel() == t.numel() else torch.zeros_like(t.reshape(-1))
            for c, t in zip(ctxs, tensors)
        ])

    def _store_residual(self, ctxs: list[Context], tensors: list[torch.Tensor], resid: torch.Tensor) -> None:
        offset = 0
        for c, t in zip(ctxs, tensors):
            self.residuals[c.key] = resid[offset : offset + t.numel()].clone()
            offset += t.numel()

    # ------------------------------------------------------------------ ring
    def _send_recv(self, buf: torch.Tensor, size: int | None, variable: bool) -> tuple[torch.Tensor, int]:
        n, r = self.world_size, self.rank
        t = time.perf_counter()
        got, sent = exchange_bytes({(r + 1) % n: buf}, {(r - 1) % n: None if variable else size}, self.group, variable, buf.device)
        self.comm_s += time.perf_counter() - t
        return got[(r - 1) % n], sent

    def _ring(
        self, compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context], want: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
        """Average of the fused ``tensors``, this rank's estimate, bytes sent,
        payload bytes this rank originated."""
        n, r = self.world_size, self.rank
        scale = 1.0 / n
        orig = torch.cat([t.reshape(-1) for t in tensors])
        flat = orig * scale
        bounds = chunk_bounds(flat.numel(), n)
        chunks = [flat[a:b] for a, b in bounds]
        gkey = "|".join(c.key for c in ctxs)
        c0 = ctxs[0]

        def ctx(c: int) -> Context:
            return Context(key=f"{gkey}#ring{c}", step=c0.step, rank=r, world_size=n, seed=c0.seed)

        if n == 1:
            pk = compressor.encode(chunks[0], ctx(0))
            out = compressor.decode(pk).reshape(-1) / scale
            return out, (out.clone() if want else None), 0, pk.nbytes
        variable = bool(compressor.variable_size) and not compressor.is_summable
        est: list[torch.Tensor | None] = [None] * n
        final: list[Packet | None] = [None] * n
        sent = payload = 0
        owned = (r + 1) % n
        if compressor.is_summable:
            own = [compressor.encode(chunks[c], ctx(c)) for c in range(n)]
            if want:
                est = [compressor.decode(p).reshape(-1) for p in own]
            out = own[r]
            payload += out.nbytes
            for s in range(n - 1):
                c = (r - s - 1) % n
                got, nbytes = self._send_recv(wire.pack_packets([out], False), own[c].nbytes, False)
                sent += nbytes
                theirs = wire.unpack_packets(got, [own[c]], False)[0]
                out = Packet([a + b for a, b in zip(theirs.tensors, own[c].tensors)], own[c].shape, own[c].dtype, dict(own[c].meta))
                payload += out.nbytes if s < n - 2 else 0
            final[owned] = out
            templates = own
        else:
            templates = [template(compressor, chunks[c].shape, flat.dtype, flat.device) for c in range(n)]
            resid = self._residual(ctxs, tensors, flat) if want else None

            def encode(c: int, value: torch.Tensor) -> Packet:
                if resid is None:
                    return compressor.encode(value, ctx(c))
                a, b = bounds[c]
                p = value + resid[a:b]
                pk = compressor.encode(p, ctx(c))
                new = p - compressor.decode(pk).reshape(-1)
                ok = torch.isfinite(p).all() & torch.isfinite(new).all()
                resid[a:b] = torch.where(ok, new, resid[a:b])
                return pk

            # every rank encodes every chunk exactly once per step (its own first,
            # N - 2 partial sums at hops, the sum it owns), each with the residual
            # of those positions: its own values count exactly (estimate = p)
            out = encode(r, chunks[r])
            payload += out.nbytes
            for s in range(n - 1):
                c = (r - s - 1) % n
                got, nbytes = self._send_recv(wire.pack_packets([out], variable), templates[c].nbytes, variable)
                sent += nbytes
                theirs = wire.unpack_packets(got, [templates[c]], variable)[0]
                out = encode(c, compressor.decode(theirs).reshape(-1) + chunks[c])
                payload += out.nbytes
            final[owned] = out
            if resid is not None:
                self._store_residual(ctxs, tensors, resid)
        # allgather: forward the owners' bytes unchanged
        decoded: list[torch.Tensor | None] = [None] * n
        decoded[owned] = compressor.decode(final[owned]).reshape(-1)  # type: ignore[arg-type]
        buf = wire.pack_packets([final[owned]], variable)  # type: ignore[list-item]
        for s in range(n - 1):
            c = (r - s) % n
            got, nbytes = self._send_recv(buf, templates[c].nbytes, variable)
            sent += nbytes
            decoded[c] = compressor.decode(wire.unpack_packets(got, [templates[c]], variable)[0]).reshape(-1)
            buf = got
        avg = torch.cat(decoded)  # type: ignore[arg-type]
        if not want:
            estimate = None
        elif compressor.is_summable:
            estimate = torch.cat(est) / scale  # type: ignore[arg-type]
        else:
            estimate = orig  # own values entered exactly; the residuals hold the error

        return avg, estimate, sent, payload
