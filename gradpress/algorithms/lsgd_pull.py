"""Leader SGD's pulls (:mod:`gradpress.algorithms.lsgd`): the leaders'
parameters to every rank, and every worker moved toward them.

:class:`Pulls` is a mixin of :class:`~gradpress.algorithms.lsgd.LSGD`
(which sets the attributes declared below in ``setup`` and
``after_broadcast``) and a subclass of the election every pull starts with
(:class:`~gradpress.algorithms.lsgd_election.Election`); kept apart from the
algorithm's configuration and state so that each module stays short.

* the pull at an election: ``x <- (1 - c) x + c x_leader`` (groups: toward
  the local and the global leader from the same ``x``), or with
  ``average=true`` ``x <- (1 - c) mean_i(x_i) + c x_leader`` in one allreduce;
* the per-step pull: ``x <- x + (prox / tau) (x_leader - x)`` toward the
  copy of the last election's leaders each rank already holds;
* the global leader's parameters: one broadcast, or, compressed, the
  engine average of ``N (x_leader - ref)`` added to ``ref``;
* :meth:`Pulls.eval_model`: the model every rank evaluates.

Invariants: a worker with ``c = 1`` holds the leader's parameters bit for
bit after the pull; the per-step pull's targets are bit-identical on every
rank (the broadcast copy, or ``ref``); ``eval_model()`` (collective) is the
same model on every rank.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gradpress.algorithms.lsgd_election import Election
from gradpress.transport.collectives import flat_by_dtype, fused_allreduce
from gradpress.transport.p2p import global_rank


class Pulls(Election):
    """The pulls of :class:`~gradpress.algorithms.lsgd.LSGD` (a mixin: the
    attributes below are set by ``Algorithm.__init__`` and ``LSGD``)."""

    model: torch.nn.Module
    rank: int
    named: list[tuple[str, torch.nn.Parameter]]
    _exchanges: int
    _consensus: torch.nn.Module | None
    compressed: bool
    #: the compressed image of the leaders' parameters (compressed only; bit-identical on every rank)
    ref: list[torch.Tensor]
    #: the per-step pull's targets (the last elected leaders' parameters; the start before the first)
    target: dict[str, list[torch.Tensor]]
    subgroup: dist.ProcessGroup | None
    _hook: Any
    _eval: torch.nn.Module | None
    c: float
    c_local: float
    c_global: float
    tau: int
    tau_global: int
    prox: float
    average: bool
    evaluate: str
    #: Algorithm's exchange helpers (:class:`~gradpress.algorithms.exchange_helpers.ExchangeHelpers`)
    sync: Callable[[list[torch.Tensor]], Any]
    consensus_model: Callable[[], torch.nn.Module]

    @torch.no_grad()
    def prox_pull(self) -> None:
        """One step's pull toward the last election's leaders:
        ``x <- x + (prox / tau_g) (x_g - x) [+ (prox / tau) (x_l - x)]``
        (``tau_g``: ``tau`` with one group, ``tau_global`` with several)."""
        groups = self.groups
        pulls = [(self.prox / (self.tau if groups == 1 else self.tau_global),
                  self.ref if self.compressed else self.target["global"])]
        if groups > 1:
            pulls.append((self.prox / self.tau, self.target["local"]))
        self._move_toward(pulls)

    @torch.no_grad()
    def _move_toward(self, pulls: list[tuple[float, list[torch.Tensor]]]) -> None:
        """``x <- x + sum_k c_k (t_k - x)`` for every parameter, all pulls from
        the same ``x``; one pull is ``lerp_``, or with weight 1 a copy (exactly
        the target's, even from a NaN ``x``, which ``lerp_`` would keep)."""
        for i, (_, p) in enumerate(self.named):
            if len(pulls) == 1:
                p.copy_(pulls[0][1][i]) if pulls[0][0] == 1 else p.lerp_(pulls[0][1][i], pulls[0][0])
            else:
                x = p.detach().clone()
                for c, target in pulls:
                    p.add_(target[i] - x, alpha=c)

    def broadcast_params(self, src: int, group: dist.ProcessGroup, count: bool = True,
                         tensors: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Rank ``src``'s (group rank of ``self.group``) parameters (or its
        ``tensors``), on every rank of ``group``."""
        flats, views = flat_by_dtype(tensors if tensors is not None else [p for _, p in self.named])
        for flat in flats:
            dist.broadcast(flat, global_rank(self.group, src), group=group)
            if count:
                self._count(flat.numel() * flat.element_size())
        return views

    @torch.no_grad()
    def global_leader_params(self, src: int) -> list[torch.Tensor]:
        """The global leader's parameters: a broadcast, or (compressed) the
        engine average to which only the leader contributes, added to ``ref``."""
        if not self.compressed:
            return self.broadcast_params(src, self.group)
        n = self.world_size
        lead = self.rank == src
        diffs = [(p.detach() - r) * n if lead else torch.zeros_like(r) for (_, p), r in zip(self.named, self.ref)]
        self.sync(diffs)
        for r, d in zip(self.ref, diffs):
            r.add_(d)
        return self.ref

    @torch.no_grad()
    def pull(self, due_local: bool, due_global: bool) -> None:
        """Elect, fetch the leaders' parameters, move every worker toward them."""
        self.elect()
        if self.average:
            self.averaged_pull(self.leaders["global"])
            self._exchanges += 1
            self._count(0, end_of_step=True)
            return
        targets: list[tuple[float, list[torch.Tensor]]] = []
        if due_global:
            c = self.c if self.groups == 1 else self.c_global
            targets.append((c, self.global_leader_params(self.leaders["global"])))
            if self.target["global"]:
                self.target["global"] = [t.clone() for t in targets[-1][1]]
        if due_local:
            assert self.subgroup is not None
            src = self.leaders["local"][self.rank // (self.world_size // self.groups)]
            targets.append((self.c_local, self.broadcast_params(src, self.subgroup)))
            if self.target["local"]:
                self.target["local"] = [t.clone() for t in targets[-1][1]]
        self._move_toward(targets)
        if not (self.compressed and due_global):  # no engine call closed this exchange
            self._exchanges += 1
            self._count(0, end_of_step=True)

    @torch.no_grad()
    def averaged_pull(self, src: int) -> None:
        """``x <- (1 - c) mean_i(x_i) + c x_src`` on every rank: one allreduce
        of ``w_i x_i`` with ``w_i = (1 - c) / N + c [i == src]`` (bit-identical
        result on every rank; with ``c = 1`` every other weight is 0 and the
        leader's parameters arrive exactly)."""
        c = self.c
        w = (1 - c) / self.world_size + (c if self.rank == src else 0.0)
        # weight 0 sends zeros, not 0 * x (NaN where a diverged worker's x is)
        summed, sent = fused_allreduce([p.detach() * w if w else torch.zeros_like(p) for _, p in self.named],
                                       self.group)
        self._count(sent)
        for (_, p), s in zip(self.named, summed):
            p.copy_(s)

    # ------------------------------------------------------------ evaluation
    @torch.no_grad()
    def eval_model(self) -> torch.nn.Module:
        """``evaluate=leader``: the last global leader's current model, on
        every rank; ``evaluate=average``: the workers' average (the "center"
        model the authors' code tests). Collective; this traffic is
        evaluation, not training, and is not counted."""
        if self.world_size == 1:
            return self.model
        if self.evaluate == "average":
            if self._consensus is not None:
                return self.consensus_model()
            self._hook.remove()  # the copy must not carry the loss-capturing hook
            try:
                return self.consensus_model()
            finally:
                self._hook = self.model.register_forward_hook(self._tag)
        if self._eval is None:
            self._hook.remove()
            self._eval = copy.deepcopy(self.model)
            self._hook = self.model.register_forward_hook(self._tag)
        params = self.broadcast_params(self.leaders["global"], self.group, count=False)
        for p, src in zip([q for q in self._eval.parameters() if q.requires_grad], params):
            p.copy_(src)
        own = [b for b in self.model.buffers() if b.numel()]  # the leader's too (BatchNorm statistics)
        theirs = self.broadcast_params(self.leaders["global"], self.group, count=False, tensors=own)
        for mine, t in zip([b for b in self._eval.buffers() if b.numel()], theirs):
            mine.copy_(t)
        return self._eval
