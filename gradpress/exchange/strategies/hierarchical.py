"""``hierarchical``: dense inside a host, compressed between hosts.

Two-level exchange in the manner of Horovod's hierarchical allreduce and
BlueConnect (Cho et al., "BlueConnect: Decomposing All-Reduce for Deep
Learning on Heterogeneous Network Hierarchy", SysML 2019), with compression
on the slow level only (as HiPress and Agarwal et al. 2022 suggest for
multi-GPU hosts). The group's ranks are cut into hosts of L consecutive
ranks (``workers_per_host``; torchrun numbers ranks host by host); the first
rank of each host is its leader.

1. **Inner (dense, fast link)**: the call's tensors are summed onto the
   leader (``reduce`` on the host's group: one fused buffer per dtype unpipelined;
   pipelined, piece by piece in the caller's own tensors, a non-contiguous
   one copied alone). Workers' values enter exactly, so every worker's own
   residual is zero.
2. **Outer (compressed, slow link)**: each leader adds its host residual to
   the host mean ``m_h = S_h / L`` (``q_h = m_h + beta e_h``) and the leaders
   average ``q_h`` with the ``outer`` strategy on the leaders' group
   (``collective``: allreduce for summable compressors, PowerSGD included,
   else allgather; or ``allreduce``, ``allgather``, ``ring``). The host
   residual ``e_h <- q_h - estimate`` is staged in the engine's feedback
   store under ``host/<key>`` on the leader: error feedback at the leader
   (its one NaN rule and its step commit apply). The leader encodes as one
   of H compressing units of a host mean of L workers (``Context``'s
   ``rank``/``world_size`` = host/H, ``unit_workers`` = L). An outer ring keeps its hop
   residuals as usual (``ring/<key>``, leaders only).
3. **Broadcast (dense, fast link)**: the leader broadcasts the average to its
   host (one buffer, or piece by piece when pipelined).

One host (every rank on it: ``workers_per_host`` equal to the group's
size): nothing crosses a slow link, so the mean is exact, one dense
allreduce per dtype, the compressor unused (the engine's stats still count
the tensors as compressed ones); a warning at construction names the
layout. A ``host/`` residual a checkpoint brings is sent once in full.

Pipelining (``chunk``, default :data:`CHUNK` entries; 0: off): the call is
cut into pieces of whole rows (:mod:`gradpress.exchange.pieces`) and three
stages overlap, as in BytePS's partitioned pipelines (Jiang et al., OSDI
2020): every rank posts all pieces' host reduces at once; the leader
encodes piece i + 1 while one wire thread moves piece i between the leaders
(``outer.move``) and the leader combines piece i - 1 (``outer.combine``) and
posts its host broadcast. It applies with ``allreduce``/``allgather``
between the leaders and one-round compressors. Between two leaders the
allgather is a swap on one group per direction: gloo's two-rank allgather
sends both ways over one TCP connection, which ran at ~65% of a shaped
link's rate. The host residual stays per tensor, so checkpoints do not
depend on ``chunk``.

A leader whose part raises (encode, the leaders' exchange, a decode)
broadcasts an abort marker to its host in place of the average, then
raises; its workers raise an error naming it at once (no extra collective
in a healthy call: :mod:`~gradpress.exchange.strategies.hierarchical_abort`).

Invariants: the outer strategy gives every leader the bit-identical average
and the broadcast copies it, so replicas are bit-identical; with equal hosts
the result is the mean over all N ranks (mean over hosts of host means).
Subgroups (one per host, one of the leaders) are made once at construction
with ``dist.new_group`` on every rank in the same order (collective: every
rank of the world constructs the strategy), after one allgather that checks
every rank resolved the same layout (or raises the same error everywhere).

Host layout: ``workers_per_host`` (spec ``hierarchical:workers_per_host=2``),
else the environment ``GRADPRESS_WORKERS_PER_HOST``, else ``LOCAL_WORLD_SIZE``
(torchrun, ``gradpress cluster --workers-per-node``), else 1. It must divide
the group's size; where ``LOCAL_RANK`` is set it must equal ``rank % L``.
On another world size or layout (``--reshard``) every new host starts from
the mean of the saved hosts' residuals (:mod:`.hierarchical_reshard`).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from gradpress.compress.base import Compressor, Context, Param
from gradpress.compress.spec import coerce_params
from gradpress.exchange.background import Background
from gradpress.exchange.base import ExchangeResult, Prelude, Strategy, get_strategy, register_strategy
from gradpress.exchange.costs import CostModel
from gradpress.exchange.feedback import Feedback, namespace
from gradpress.exchange.pieces import Piece, cut
from gradpress.exchange.strategies.allgather import Allgather
from gradpress.exchange.strategies.hierarchical_abort import is_marked, leader_failed, mark_failed
from gradpress.exchange.strategies.hierarchical_costs import predict_seconds
from gradpress.exchange.strategies.hierarchical_layout import (
    check_divides,
    resolved_workers_per_host,
    unit_contexts,
    workers_per_host_from_env,
)
from gradpress.exchange.strategies.hierarchical_pipeline import pipelined
from gradpress.exchange.strategies.hierarchical_reshard import fold_hosts
from gradpress.transport.collectives import flat_by_dtype, fused_allreduce
from gradpress.transport.groups import timeout_of
from gradpress.transport.p2p import swap_bytes

__all__ = ["Hierarchical", "HOST", "OUTER", "workers_per_host_from_env", "check_divides"]

#: the leaders' residuals of the host sums in the engine's feedback store
HOST = namespace("host", suffix="")
#: default piece size of the pipelined exchange (entries; 1 MB of fp32): 2^18, 2^19, 2^20 and 2^21
#: measured within 4% of each other on 2 hosts x 2 workers (docs/results/e2e-hierarchical-2x2.md)
CHUNK = 1 << 18
#: strategies the leaders may use between hosts
OUTER = ("collective", "allreduce", "allgather", "ring")
@register_strategy("hierarchical")
class Hierarchical(Strategy):
    """Dense reduce in the host, compressed exchange between leaders, broadcast
    in the host; see the module docstring."""

    order = 4
    state_dict_copies = True  # numbers and a name
    reshard_fold = staticmethod(fold_hosts)  # host residuals onto another layout (hierarchical_reshard)
    planned = False
    PARAMS = (
        Param("workers_per_host", int, 0, "workers_per_host >= 0 (0: from the environment)", lambda v: v >= 0,
              "ranks per host (consecutive ranks share a host)"),
        Param("outer", str, "collective", ", ".join(OUTER), lambda v: v in OUTER,
              "strategy between the hosts' leaders"),
        Param("chunk", int, CHUNK, "chunk >= 0 (0: no pipelining)", lambda v: v >= 0,
              "pipeline the exchange in pieces of about this many entries (whole rows)"),
    )

    def __init__(self, group: dist.ProcessGroup | None, **params: Any) -> None:
        super().__init__(group)
        values = coerce_params(self.PARAMS, params, "hierarchical", "strategy")
        self.outer_name: str = values["outer"]
        self.chunk: int = int(values["chunk"])
        given = int(values["workers_per_host"])
        layout_error = None
        if self.world_size == 1:  # a world of one (or no group yet: a configuration check) is one host
            self.workers_per_host = 1
        else:
            try:
                self.workers_per_host = resolved_workers_per_host(given, self.world_size)
                self._check_layout()
            except ValueError as exc:
                self.workers_per_host, layout_error = 1, str(exc)
        self.hosts = self.world_size // self.workers_per_host
        self.host = self.rank // self.workers_per_host
        self.is_leader = self.rank % self.workers_per_host == 0
        self.intra: Any = None
        self.leaders: Any = None
        self._outers: dict[str, Strategy] = {}
        self._wire: Background | None = None
        self._toward: list[Any] = []  # two hosts: [group leader 0 sends on, group leader 1 sends on]
        self._leader_global = 0
        if dist.is_initialized() and self.world_size > 1:
            self._agree(layout_error)
            self._build_groups()
            if self.hosts == 1 and self.rank == 0:  # the same layout on every rank (agreed): said once
                warnings.warn(f"strategy 'hierarchical': all {self.world_size} ranks are on one host "
                              f"(workers_per_host={self.workers_per_host}): no slow link to compress for, so the "
                              "average is the exact dense one and the compressor is not used; set workers_per_host "
                              "(or GRADPRESS_WORKERS_PER_HOST) to the ranks per host, or use a flat strategy",
                              stacklevel=2)
        elif layout_error:
            raise ValueError(layout_error)

    # ------------------------------------------------------------ construction
    def _check_layout(self) -> None:
        n, per = self.world_size, self.workers_per_host
        check_divides(n, per)
        local = os.environ.get("LOCAL_RANK", "").strip()
        if local.isdigit() and dist.is_initialized() and os.environ.get("LOCAL_WORLD_SIZE", "").strip() == str(per) \
                and int(local) != self.rank % per:
            raise ValueError(f"strategy 'hierarchical': rank {self.rank} has LOCAL_RANK={local} but "
                             f"workers_per_host={per} puts it at local rank {self.rank % per}; ranks must be numbered host by host")

    def _agree(self, error: str | None) -> None:
        """Every rank's (L, outer, ok): all ranks raise alike on a mismatch."""
        mine = torch.tensor([self.workers_per_host, OUTER.index(self.outer_name), self.chunk, 0 if error else 1],
                            dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine, group=self.group)
        table = torch.stack(everyone)
        bad = [r for r in range(self.world_size) if int(table[r, -1]) == 0]
        if error:
            raise ValueError(error)
        if bad:
            raise ValueError(f"strategy 'hierarchical': rank {bad[0]} has an invalid host layout (see its error)")
        if not bool((table[:, :-1] == mine[:-1]).all()):
            seen = sorted({(int(a), OUTER[int(b)], int(c)) for a, b, c, _ in table.tolist()})
            raise ValueError(f"strategy 'hierarchical': ranks disagree on (workers_per_host, outer, chunk): "
                             f"{seen}; allowed: the same on every rank")

    def _build_groups(self) -> None:
        ranks = dist.get_process_group_ranks(self.group if self.group is not None else dist.group.WORLD)
        backend = dist.get_backend(self.group)
        timeout = timeout_of(self.group, None)
        kw: dict[str, Any] = {"backend": backend}
        if timeout is not None:
            kw["timeout"] = timeout
        per = self.workers_per_host
        for h in range(self.hosts):  # every rank creates every group, in this order
            g = dist.new_group(ranks=ranks[h * per : (h + 1) * per], **kw)
            if h == self.host:
                self.intra = g
        self._leader_global = ranks[self.host * per]
        leaders = [ranks[h * per] for h in range(self.hosts)]
        self.leaders = dist.new_group(ranks=leaders, **kw)
        if self.chunk and self.hosts == 2:  # one group per direction between the two leaders (see _move)
            self._toward = [dist.new_group(ranks=leaders, **kw) for _ in range(2)]

    # ------------------------------------------------------------ contract
    def _outer_for(self, compressor: Compressor) -> str:
        if self.outer_name != "collective":
            return self.outer_name
        return "allreduce" if compressor.is_summable else "allgather"

    def supports(self, compressor: Compressor) -> str | None:
        if compressor.aggregation != "mean":
            return (f"compressor {compressor.name!r} aggregates by {compressor.aggregation} vote, which needs every "
                    "rank's packet; strategy 'hierarchical' sums each host densely first; use 'allgather'")
        name = self._outer_for(compressor)
        reason = get_strategy(name, None).supports(compressor)
        return f"between hosts ({name}): {reason}" if reason else None

    @classmethod
    def predict(cls, costs: CostModel, numel: int, world_size: int, summable: bool, *,
                elem_size: int = 4) -> tuple[float, int]:
        """The bytes over a leader's links (dense reduce and broadcast, the
        leaders' exchange) read off the fits, by the formulas of
        :mod:`~gradpress.exchange.strategies.hierarchical_costs`; L from
        the environment, as the strategy itself takes it."""
        try:
            per = max(1, workers_per_host_from_env())
        except ValueError:
            per = 1
        return predict_seconds(costs, numel, world_size, summable, per, elem_size), 1

    @classmethod
    def resolve_params(cls, values: dict[str, Any], world: int, local_world: int | None = None) -> dict[str, Any]:
        """``workers_per_host`` as the group builds it (0: from the environment; 1 on a world of one)."""
        return dict(values, workers_per_host=resolved_workers_per_host(int(values["workers_per_host"]), world,
                                                                      local_world))

    def state_dict(self) -> dict[str, Any]:
        """The host layout the ``host/`` residuals were kept for."""
        return {"workers_per_host": self.workers_per_host, "outer": self.outer_name}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for field, mine in self.state_dict().items():
            if field in state and state[field] != mine:
                raise ValueError(f"strategy 'hierarchical': checkpoint has {field}={state[field]!r}, this run "
                                 f"{mine!r}; allowed: the same host layout (its residuals live on the leaders)")

    # ------------------------------------------------------------ exchange
    def exchange(
        self, compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context],
        feedback: Feedback | None, *, prelude: Prelude | None = None, out: list[torch.Tensor] | None = None,
    ) -> ExchangeResult:
        if self.hosts == 1 and self.world_size > 1:
            return self._one_host(tensors, ctxs, feedback)
        ctxs = unit_contexts(ctxs, self.host, self.hosts, self.workers_per_host)  # the leaders' encode contexts
        pieces = self._pieces(compressor, tensors)
        if pieces is not None:
            return self._pipelined(compressor, tensors, ctxs, feedback, pieces)
        t0 = time.perf_counter()
        per = self.workers_per_host
        # one fused buffer per dtype (a mixed call keeps each tensor's dtype, as the pipelined path does)
        flats, views = flat_by_dtype(tensors)
        dense = sum(f.numel() * f.element_size() for f in flats)
        comm = 0.0
        sent = host = 0
        if per > 1:
            t = time.perf_counter()
            for flat in flats:
                dist.reduce(flat, dst=self._leader_global, group=self.intra)
            comm += time.perf_counter() - t
            sent += dense
            host += dense
        tensor_bytes = [0 if self.is_leader else t.numel() * t.element_size() for t in tensors]
        failure: Exception | None = None
        if self.is_leader:
            try:
                qs, keys = [], [Feedback.key(HOST, c.key) for c in ctxs]
                for m, k in zip(views, keys):
                    m = m.div_(per)
                    if feedback is not None:
                        m = m.add(feedback.current(k, m), alpha=feedback.beta)
                    qs.append(m)
                outer = self._outer_strategy(compressor)
                t = time.perf_counter()
                res = outer.exchange(compressor, qs, ctxs, feedback)
                comm += max(0.0, time.perf_counter() - t - res.compress_s)
                sent += res.bytes_sent
                tensor_bytes = list(res.tensor_bytes)
                staged = list(zip(keys, res.residuals)) if feedback is not None and res.residuals is not None else []
                for v, a in zip(views, res.tensors):
                    v.copy_(a.reshape(v.shape))
            except Exception as exc:  # noqa: BLE001 - the host is told below (the marker), then it is re-raised
                failure = exc
                for flat in flats:
                    mark_failed(flat)
            else:
                for k, r in staged:
                    feedback.stage(k, r)  # type: ignore[union-attr]
        if per > 1:
            t = time.perf_counter()
            for flat in flats:
                dist.broadcast(flat, src=self._leader_global, group=self.intra)
            comm += time.perf_counter() - t
            sent += dense if self.is_leader else 0
            host += dense if self.is_leader else 0
        if failure is not None:
            raise failure
        if per > 1 and not self.is_leader and flats and is_marked(flats[-1]):
            raise self._leader_failed(ctxs)
        results = views
        # every worker's values entered the host sum exactly: its own residual is zero
        residuals = [t.zero_() for t in tensors] if feedback is not None else None
        total = time.perf_counter() - t0
        return ExchangeResult(results, sent, residuals, tensor_bytes, max(0.0, total - comm), comm, host_bytes=host)

    def _one_host(self, tensors: list[torch.Tensor], ctxs: list[Context], feedback: Feedback | None) -> ExchangeResult:
        """Every rank on one host: the exact mean (one dense allreduce per
        dtype on the host's group), nothing compressed, every residual zero.
        A host residual left by a checkpoint of a compressing run (``host/``
        keys on the leader) is sent once in full, then cleared: nothing of
        it is lost."""
        t0 = time.perf_counter()
        n = self.world_size
        send = list(tensors)
        if feedback is not None and self.is_leader:
            for i, (t, c) in enumerate(zip(tensors, ctxs)):
                key = Feedback.key(HOST, c.key)
                if key in feedback.residuals:
                    # the host mean plus beta * e_h, as the compressing path sends it (the leader's term is / n)
                    send[i] = t.add(feedback.current(key, t), alpha=feedback.beta * n)
                    feedback.stage(key, torch.zeros_like(t))
        summed, dense = fused_allreduce(send, self.intra)
        results = [s.div_(n) for s in summed]
        residuals = [torch.zeros_like(t) for t in tensors] if feedback is not None else None
        return ExchangeResult(results, dense, residuals, [t.numel() * t.element_size() for t in tensors], 0.0,
                              time.perf_counter() - t0, host_bytes=dense)

    def _leader_failed(self, ctxs: list[Context]) -> RuntimeError:
        """A worker's error when its leader's broadcast is the abort marker."""
        first = ctxs[0] if ctxs else Context(key="?")
        return leader_failed(self._leader_global, self.host, first.key, first.step, len(ctxs))

    def pipelines(self, compressor: Compressor) -> bool:
        """``chunk`` set, several hosts (one host is one dense allreduce), a
        one-round compressor and a collective between the leaders
        (``allreduce``/``allgather``; not PowerSGD's rounds, not a ring):
        the same on every rank."""
        return (bool(self.chunk) and self.hosts > 1 and compressor.rounds == 1
                and self._outer_for(compressor) in ("allreduce", "allgather"))

    def _pieces(self, compressor: Compressor, tensors: list[torch.Tensor]) -> list[Piece] | None:
        """The call's pieces when it is pipelined (:meth:`pipelines`; they depend only on the shapes)."""
        return cut(tensors, self.chunk) if self.pipelines(compressor) else None

    def _pipelined(
        self, compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context],
        feedback: Feedback | None, pieces: list[Piece],
    ) -> ExchangeResult:
        keys = [Feedback.key(HOST, c.key) for c in ctxs]
        return pipelined(self, compressor, tensors, ctxs, keys, feedback, pieces)

    def _outer_strategy(self, compressor: Compressor) -> Strategy:
        """The leaders' strategy for ``compressor`` (made once per name; a
        strategy's construction issues no collective)."""
        name = self._outer_for(compressor)
        if name not in self._outers:
            self._outers[name] = get_strategy(name, self.leaders)
        return self._outers[name]

    def _move(self, outer: Strategy, compressor: Compressor, encoded: Any) -> Any:
        """The wire thread's job for one piece: ``outer.move``; between two
        leaders with an allgather, a swap on one connection per direction
        (:func:`~gradpress.transport.p2p.swap_bytes`: gloo's allgather of two
        ranks sends both ways over one connection, which ran at ~65% of the
        link rate here, against ~100% one way per connection)."""
        if not self._toward or not isinstance(outer, Allgather):
            return lambda: outer.move(compressor, encoded)  # type: ignore[attr-defined]
        me = self.host
        size = None if compressor.variable_size else encoded.buffer.numel()

        def swap() -> tuple[list[torch.Tensor], int]:
            theirs, sent = swap_bytes(encoded.buffer, 1 - me, self._toward[me], self._toward[1 - me], size)
            return ([encoded.buffer, theirs] if me == 0 else [theirs, encoded.buffer]), sent

        return swap

    def _wire_thread(self) -> Background:
        """The thread that runs the leaders' collectives of a pipelined call."""
        if self._wire is None:
            self._wire = Background("hierarchical wire")
        return self._wire

