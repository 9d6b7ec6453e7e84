"""``ps``: sharded parameter server co-located on the workers.

HiPress CaSync-PS (Bai et al., SOSP 2021) and BytePS (Jiang et al., OSDI
2020). Every tensor (the hook passes each of the K partitions of a large
tensor as its own tensor, keyed ``name#k``) has a root rank, assigned round
robin in order of first appearance (every rank sees tensors in the same
order, so the assignment agrees and stays fixed for a key; consecutive
partitions land on different ranks). Per call:

1. every rank encodes its tensors and sends each root, in one message, the
   packets of the tensors that root owns (point-to-point, all posted at once;
   variable-size packets are preceded by their size);
2. a root sums, in rank order, the N packets of each tensor it owns:
   summable compressors add payloads (packets were encoded from x / N, so the
   sum is the average and fp16 does not overflow); the others decode, average
   and re-encode with a residual of the root's own (kept only with error
   feedback, in the engine's feedback store under the ``root`` namespace)
   using :func:`~gradpress.exchange.strategies.recompress.densified`: for sparse
   methods density ``ratio * N`` capped at 1, since the sum of N top-k packets
   has up to N k non-zeros; other compressors re-encode as they are;
3. each root broadcasts its re-encoded bytes (one broadcast per root that owns
   something, roots in increasing order; sizes of variable-size packets go
   first in one small allgather) and every rank, root included, decodes those
   bytes, so replicas are bit-identical.

Estimates: ``decode(encode(x))`` of this rank's own packets (what the root
received from it). On another world size (``--reshard``) the roots and root
residuals fold by :mod:`~gradpress.exchange.strategies.ps_reshard`. Not for majority-vote compressors or multi-round protocols.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from gradpress.compress.base import Compressor, Context, Packet
from gradpress.exchange.base import (
    ExchangeResult,
    Prelude,
    Strategy,
    aggregate_packets,
    encode_local,
    register_strategy,
)
from gradpress.exchange.costs import CostModel
from gradpress.exchange.feedback import Feedback, namespace
from gradpress.exchange.keys import root_key
from gradpress.exchange.strategies.ps_reshard import fold_roots
from gradpress.exchange.strategies.recompress import densified, recompress, template, unsupported_reason
from gradpress.transport import wire
from gradpress.transport.p2p import exchange_bytes, global_rank

__all__ = ["ParameterServer"]

#: where the roots' re-compression residuals live in the engine's feedback store
ROOT = namespace("root", suffix="#ps")


@register_strategy("ps")
class ParameterServer(Strategy):
    """Sharded parameter server; see the module docstring."""

    order = 3
    state_dict_copies = True  # a fresh dict of root ranks
    reshard_fold = staticmethod(fold_roots)  # roots and root residuals onto another world size

    def __init__(self, group: Any) -> None:
        super().__init__(group)
        self.roots: dict[str, int] = {}
        self._next_root = 0

    def supports(self, compressor: Compressor) -> str | None:
        return unsupported_reason(compressor, "ps")

    @classmethod
    def predict(cls, costs: CostModel, numel: int, world_size: int, summable: bool, *,
                elem_size: int = 4) -> tuple[float, int]:
        """Best K in 1..N, with ``m = d / K``: ``K ENC(m) + P2P((N-1) c(m)) +
        K DEC(m)``, plus ``K BC(c(m))`` when summable (the root adds
        payloads), else ``N DEC(m) + ENC(m) + K BC(c'(m))`` (the root decodes,
        sums and re-encodes at density x N)."""
        n, d = world_size, float(numel)
        best: tuple[float, int] | None = None
        for k in range(1, n + 1):
            m = d / k
            t = k * costs.encode(m) + costs.p2p((n - 1) * costs.wire(m)) + k * costs.decode(m)
            if summable:
                t += k * costs.broadcast(costs.wire(m))
            else:
                t += n * costs.decode(m) + costs.encode(m) + k * costs.broadcast(costs.root_wire(m))
            if best is None or t < best[0] - 1e-15:
                best = (t, k)
        assert best is not None
        return best

    def state_dict(self) -> dict[str, Any]:
        return {"roots": dict(self.roots), "next_root": self._next_root}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = sorted(set(state) - {"roots", "next_root"})
        if unknown:
            raise ValueError(f"strategy 'ps': unknown state {unknown}; expected roots, next_root")
        self.roots = dict(state.get("roots", {}))
        self._next_root = int(state.get("next_root", 0))

    def root_of(self, key: str) -> int:
        """The root rank of ``key`` (assigned round robin on first sight)."""
        root = self.roots.get(key)
        if root is None:
            root = self._next_root % self.world_size
            self._next_root += 1
            self.roots[key] = root
        return root

    def root_compressor(self, compressor: Compressor) -> Compressor:
        """The compressor a root re-encodes with: a densified shallow copy,
        made afresh per call so that it shares the state ``compressor`` holds
        *now* (never cached: a ``load_state_dict``, a checkpoint or the
        snapshot ``nonfinite='skip'`` restores, gives ``compressor`` new
        state objects, and a cached copy would keep learning into the old
        ones, out of every later ``state_dict``)."""
        return densified(compressor, self.world_size)

    def exchange(
        self, compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context],
        feedback: Feedback | None, *, prelude: Prelude | None = None, out: list[torch.Tensor] | None = None,
    ) -> ExchangeResult:
        t0 = time.perf_counter()
        comm = 0.0
        n, me = self.world_size, self.rank
        summable = compressor.is_summable
        packets, residuals = encode_local(compressor, tensors, ctxs, 1.0 / n if summable else 1.0, feedback,
                                          n if summable else 1)
        tensor_bytes = [p.nbytes for p in packets]
        if n == 1:
            results = [compressor.decode(p) for p in packets]
            return ExchangeResult(results, 0, residuals, tensor_bytes, time.perf_counter() - t0)
        roots = [self.root_of(c.key) for c in ctxs]
        owned: dict[int, list[int]] = {}
        for i, root in enumerate(roots):
            owned.setdefault(root, []).append(i)
        mine = owned.get(me, [])
        variable = bool(compressor.variable_size) and not summable
        device = tensors[0].device
        # 1. gather: each rank sends every root the packets it owns, in one message
        sends = {root: wire.pack_packets([packets[i] for i in idxs], variable) for root, idxs in owned.items() if root != me}
        expect: dict[int, int | None] = {}
        if mine:
            size = sum(packets[i].nbytes for i in mine)
            expect = {q: (None if variable else size) for q in range(n) if q != me}
        t = time.perf_counter()
        got, sent = exchange_bytes(sends, expect, self.group, variable, device)
        comm += time.perf_counter() - t
        # 2. roots aggregate in rank order and re-encode
        root_comp = compressor if summable else self.root_compressor(compressor)
        mine_pk = [packets[i] for i in mine]
        by_rank = [mine_pk if q == me else wire.unpack_packets(got[q], mine_pk, variable) for q in range(n)] if mine else []
        out_packets: list[Packet] = []
        for j, i in enumerate(mine):
            if summable:
                payloads = [t.clone() for t in by_rank[0][j].tensors]
                for q in range(1, n):
                    for a, b in zip(payloads, by_rank[q][j].tensors):
                        a += b
                own = packets[i]
                out_packets.append(Packet(payloads, own.shape, own.dtype, dict(own.meta)))
            else:
                avg = aggregate_packets(compressor, [by_rank[q][j] for q in range(n)], n)
                rctx = dataclasses.replace(ctxs[i], key=root_key(ctxs[i].key), rank=me, world_size=n)
                pk, _ = recompress(root_comp, avg, rctx, feedback, Feedback.key(ROOT, rctx.key))
                out_packets.append(pk)
        # 3. broadcast each root's bytes; everyone decodes them
        def tmpl(i: int) -> Packet:
            if summable:
                return packets[i]
            return template(root_comp, tensors[i].shape, tensors[i].dtype, device)

        mine_buf = wire.pack_packets(out_packets, variable, device) if mine else None
        sizes: list[int] | None = None
        if variable:
            t = time.perf_counter()
            size = torch.tensor([0 if mine_buf is None else mine_buf.numel()], dtype=torch.int64, device=device)
            all_sizes = [torch.empty_like(size) for _ in range(n)]
            dist.all_gather(all_sizes, size, group=self.group)
            comm += time.perf_counter() - t
            sent += 8
            sizes = [int(s) for s in torch.cat(all_sizes).tolist()]
        results: list[torch.Tensor | None] = [None] * len(tensors)
        for root in sorted(owned):
            idxs = owned[root]
            templates = [tmpl(i) for i in idxs]
            if root == me:
                buf = mine_buf
                received = out_packets
            else:
                nbytes = sizes[root] if sizes is not None else sum(p.nbytes for p in templates)
                buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            assert buf is not None
            if buf.numel():
                t = time.perf_counter()
                dist.broadcast(buf, global_rank(self.group, root), group=self.group)
                comm += time.perf_counter() - t
            if root == me:
                sent += buf.numel()
            else:
                received = wire.unpack_packets(buf, templates, variable)
            for i, pk in zip(idxs, received):
                results[i] = compressor.decode(pk) if summable else root_comp.decode(pk)
        compress_s = max(0.0, time.perf_counter() - t0 - comm)
        return ExchangeResult(results, sent, residuals, tensor_bytes, compress_s, comm)  # type: ignore[arg-type]
