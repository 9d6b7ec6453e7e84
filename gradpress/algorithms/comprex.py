"""``comprex:staleness=1,...``: Comprex, the compressed exchange of step t
applied at step t + s while the following steps compute, with the Comprex
optimizer (clipping, momentum before compression, a ratio schedule,
periodic re-broadcast of the weights).

Comprex (Kim et al., "Comprex": compressed ring allreduce with local error
feedback; gradpress's ``ring`` strategy) names two features beyond its ring:

* **Nodes compute and communicate without synchronizing.** Its fast variant
  double-buffers the gradients: the compressed exchange of step t runs in
  the background while step t + 1's forward and backward pass runs, and the
  update applied at step t + 1 is the averaged compressed gradient of step
  t: one step of staleness, the communication hidden behind compute. Here
  ``staleness = s`` in {0, 1, 2}: step t's payload is handed to a
  background thread (:class:`gradpress.exchange.background.Background`)
  that runs ``Synchronizer.sync`` on the algorithm's own process group
  (any strategy the compressor supports: ``ring`` is Comprex's, ``allgather``
  or ``allreduce`` work too), and step t applies the averaged update of step
  t - s (the first s steps apply nothing). ``staleness=0`` is today's
  synchronous exchange, run inline: with ``update=optimizer`` and ``clip=0``
  it is DDP with the gradpress hook, bit for bit (tested).
* **The Comprex optimizer** (``update=comprex``, the default), which
  smooths the effect of compression: the local gradient's norm is clipped
  (``clip``, 5.0), a local momentum buffer ``m <- momentum * m + lr * g``
  (0.9) is kept *before* compression, ``m`` plus the error-feedback residual
  is what is compressed, and the averaged result is the update itself:
  ``x <- x - mean_r C(m_r + e_r)`` (:mod:`.comprex_optim`; ``lr`` and
  ``weight_decay`` are read from the user's optimizer's parameter groups at
  every step, so its learning-rate schedule applies; the optimizer's own
  ``step`` and state are not used). The density follows a schedule from
  ``start_ratio`` to the compressor's ``ratio`` over ``warmup`` exchanges
  (:mod:`.comprex_schedule`; DGC's warm-up is one instance). Every
  ``rebroadcast_every`` steps rank 0's weights and buffers are broadcast:
  the paper's nodes drift apart; here parameters are bit-identical by
  construction, so the broadcast re-aligns floating buffers (BatchNorm
  statistics, which stay local between broadcasts) and guards against
  nondeterministic kernels. ``update=optimizer`` instead writes the averaged
  (stale) gradient into ``.grad`` and calls the user's optimizer (Adam...),
  with DDP's rule for a missing ``.grad`` (presence flags in the exchange;
  docs/comprex.md); the Comprex optimizer takes a missing one as zero.
* **Look-ahead** (``lookahead``, gradpress's addition, on by default with
  the Comprex optimizer and staleness >= 1; :mod:`.comprex_lookahead`): a
  stale update under heavy-ball momentum is stable only for a learning rate
  38x smaller than the synchronous one (momentum 0.9; one step of delay),
  and training at the synchronous rate ends at chance. Each rank therefore
  computes its gradient at the weights the update will meet, ``x`` minus its
  own momentum buffers of the exchanges still in flight (SpecTrain's weight
  prediction); the shared weights ``x`` stay bit-identical on every rank,
  the model holds the rank-local prediction between steps, and evaluation,
  ``close`` and the re-broadcast use ``x`` (:meth:`Comprex.weights`).

Invariants:

* Every rank launches step t's exchange with the same keys, sizes and
  density (the schedule is a function of t) and applies the same averaged
  update in the same step, so the shared weights (and, with
  ``update=optimizer``, the optimizer's state) are bit-identical on every
  rank after every step; without the look-ahead they are the parameters.
* Nothing in flight is lost: ``state_dict`` waits for the exchanges in
  flight and saves their averaged results with the step they are due, the
  momentum buffers and the engine's residuals; a resumed run is
  bit-identical to one that never stopped.
* ``nonfinite='skip'``: a dropped step applies nothing and, with the
  Comprex optimizer, leaves every rank's momentum as it was (restored after
  the inline exchange); it is refused with ``update=comprex`` and
  staleness >= 1, where the next steps' momentum is formed before the
  dropped step's verdict arrives.
* A dead or stuck peer during a background exchange raises
  :class:`~gradpress.exchange.background.BackgroundError` in the training
  thread (after at most the group's ``timeout``), never a hang.
* ``stats`` count an exchange's bytes when its update is applied (so they
  do not depend on the thread's progress); extra keys: see :data:`EXTRA_STATS`.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Mapping
from typing import Any

import torch

from gradpress.algorithms.base import Algorithm
from gradpress.algorithms.comprex_lookahead import LookAhead
from gradpress.algorithms.comprex_optim import LocalMomentum, clip_by_total_norm, load_pending, save_pending
from gradpress.algorithms.comprex_schedule import SCHEDULES, RatioSchedule, ratio_holder
from gradpress.algorithms.presence import PRESENT_KEY, agreed, flags
from gradpress.algorithms.registry import register
from gradpress.compress.base import Param
from gradpress.exchange.background import Background
from gradpress.exchange.base import Encoded

__all__ = ["Comprex", "EXTRA_STATS"]

#: keys of ``Comprex.stats`` beyond ``STATS_KEYS``
EXTRA_STATS: dict[str, str] = {
    "staleness": "steps between an exchange's launch and the step that applies it",
    "in_flight": "exchanges launched and not yet applied",
    "density": "compressor density (ratio) of the last launched exchange (the schedule's value)",
    "exchange_s": "seconds the exchanges ran (background thread, or inline with staleness 0): compression + wire",
    "exposed_s": "seconds the training thread waited for exchanges (communication not hidden)",
    "hidden_s": "exchange_s - exposed_s: exchange time hidden behind compute",
    "overlap": "hidden_s / exchange_s (0 with staleness 0; 1 when the exchange never delays a step)",
    "rebroadcasts": "weight re-broadcasts from rank 0 so far",
}


@register
class Comprex(Algorithm):
    name = "comprex"
    default_compressor = "topk:ratio=0.01"
    #: module doc of gradpress.algorithms.loss_scale
    scaler_refusal = ("the gradient exchange of step t is applied at step t + s, in the background: the scaler "
                      "must decide at step t whether the step is skipped, and an overflow on one rank reaches the "
                      "others only s steps later")
    summary = ("Comprex: the compressed exchange of step t runs in the background and is applied at step t + s; "
               "Comprex optimizer: norm clipping, momentum before compression, ratio schedule, re-broadcast; "
               "gradients at the look-ahead weights the stale update will meet")
    PARAMS = (
        Param("staleness", int, 1, "0, 1 or 2", lambda v: v in (0, 1, 2),
              "steps between an exchange's launch and its update (0: synchronous; 1: Comprex's double buffer)"),
        Param("update", str, "comprex", "comprex or optimizer", lambda v: v in ("comprex", "optimizer"),
              "comprex: the Comprex optimizer, x -= mean C(m + e) with local momentum m (lr from the optimizer's "
              "groups); optimizer: the averaged (stale) gradient goes to the user's optimizer"),
        Param("clip", float, 5.0, "number >= 0 (0: off)", lambda v: v >= 0,
              "clip the local gradient's 2-norm to this before the momentum (5.0 in the paper)"),
        Param("momentum", float, 0.9, "number in [0, 1)", lambda v: 0 <= v < 1,
              "local momentum before compression, m <- momentum * m + lr * g (update=comprex; 0.9 in the paper)"),
        Param("schedule", str, "constant", ", ".join(SCHEDULES), lambda v: v in SCHEDULES,
              "density from start_ratio to the compressor's ratio over warmup exchanges"),
        Param("start_ratio", float, 0.25, "0 < start_ratio <= 1", lambda v: 0 < v <= 1,
              "density of the first exchange when the schedule is not constant (DGC's first stage: 0.25)"),
        Param("warmup", int, 0, "integer >= 0", lambda v: v >= 0,
              "exchanges over which the schedule reaches the compressor's ratio (0: target at once)"),
        Param("stages", int, 0, "integer in [0, warmup]", lambda v: v >= 0,
              "0: the density moves every step; S: it is constant over S equal stages (DGC: one per epoch)"),
        Param("lookahead", str, "auto", "auto, on or off", lambda v: v in ("auto", "on", "off"),
              "compute each gradient at the weights its stale update will meet, predicted from the local momentum "
              "(auto: on with update=comprex and staleness >= 1; needs update=comprex)"),
        Param("rebroadcast_every", int, 0, "integer >= 0 (0: never)", lambda v: v >= 0,
              "broadcast rank 0's weights and buffers every N steps (removes drift; buffers stay local otherwise)"),
    )

    # ------------------------------------------------------------------ build
    def setup(self) -> None:
        assert self.engine is not None
        holder = ratio_holder(self.engine.compressor)
        target = holder.ratio if holder is not None else 1.0  # type: ignore[attr-defined]
        self.schedule_fn = RatioSchedule(self.schedule, self.start_ratio, target,  # type: ignore[attr-defined]
                                         self.warmup, self.stages, self.name)  # type: ignore[attr-defined]
        if self.schedule_fn.moves and holder is None:
            raise ValueError(f"algorithm {self.name!r}: parameter 'schedule' got {self.schedule!r} "  # type: ignore[attr-defined]
                             f"but compressor {self.engine.compressor.spec()!r} has no 'ratio'; allowed: "
                             "schedule=constant, or a compressor with a ratio (topk, randomk, dgc, ...)")
        if self.lookahead == "on" and self.update != "comprex":  # type: ignore[attr-defined]
            raise ValueError(f"algorithm {self.name!r}: parameter 'lookahead' is 'on' but 'update' is "
                             f"{self.update!r}; allowed: lookahead=on with update=comprex (the prediction "  # type: ignore[attr-defined]
                             "uses the local momentum only the Comprex optimizer keeps), or lookahead=auto/off")
        self._skip = self.engine.config().get("nonfinite", "propagate") == "skip"
        if self._skip and self.update == "comprex" and self.staleness > 0:  # type: ignore[attr-defined]
            raise ValueError(f"algorithm {self.name!r}: nonfinite='skip' with update='comprex' needs staleness=0, "
                             f"got staleness={self.staleness}: a skipped step must leave the momentum as it "  # type: ignore[attr-defined]
                             "was, but the next steps' momentum is formed before its verdict arrives; allowed: "
                             "staleness=0, update=optimizer, or nonfinite='propagate'/'raise'")
        self.lookahead_on = self.lookahead == "on" or (  # type: ignore[attr-defined]
            self.lookahead == "auto" and self.update == "comprex" and self.staleness > 0)  # type: ignore[attr-defined]
        self.look: LookAhead | None = None
        self._eval_copy: torch.nn.Module | None = None
        self._holder = holder
        self._target = target
        params = [p for _, p in self.named]
        self._group_of = self._param_groups(params)
        self.momentum_state = LocalMomentum(params, self.momentum)  # type: ignore[attr-defined]
        self.pending: collections.deque[dict[str, Any]] = collections.deque()
        self.background = Background(f"{self.name} rank {self.rank}")
        self.applied_bytes = 0
        self.applied = 0
        self._closed = False
        self.rebroadcasts = 0
        self.density = target

    def after_broadcast(self) -> None:
        if self.lookahead_on:
            self.look = LookAhead([p for _, p in self.named])

    def weights(self) -> list[torch.Tensor]:
        """The shared weights ``x``, bit-identical on every rank (with the
        look-ahead the model's parameters hold this rank's prediction)."""
        return self.look.shadow if self.look is not None else [p.detach() for _, p in self.named]

    def _param_groups(self, params: list[torch.Tensor]) -> list[int]:
        """The index of each trainable parameter's group in the optimizer.
        An index, not the group: ``optimizer.load_state_dict`` replaces the
        group dicts (a resumed run's schedule writes its rates into the new ones)."""
        where = {id(p): i for i, g in enumerate(self.optimizer.param_groups) for p in g["params"]}
        missing = [n for n, p in self.named if id(p) not in where]
        if missing:
            raise ValueError(f"algorithm {self.name!r}: parameter {missing[0]!r} is not in the optimizer; "
                             "allowed: an optimizer over model.parameters() (its groups give lr and weight_decay)")
        return [where[id(p)] for p in params]

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self) -> None:
        """Launch this step's exchange; apply the one launched ``staleness``
        steps ago; re-broadcast when due."""
        t = self._steps
        # nonfinite=skip (staleness 0): a dropped step leaves the momentum as it was on every rank
        before = self.momentum_state.state_dict() if self._skip and self.update == "comprex" else None  # type: ignore[attr-defined]
        item: dict[str, Any] = {"step": t, "exchange": self._exchanges, "ratio": self.schedule_fn(t),
                                "update": self._payload(), "bytes": 0, "skipped": False}
        if self.update == "optimizer" and self.named:  # type: ignore[attr-defined]  # DDP's rule (_apply)
            item["mine"] = [p.grad is not None for _, p in self.named]
            item["flags"] = flags(item["mine"], item["update"][0])
        if self.look is not None:  # this rank's stand-in for the update in flight
            item["proxy"] = self.momentum_state.state_dict()  # copies of the buffers
        self._exchanges += 1
        self.density = item["ratio"]
        name = f"of step {t}"
        if self.staleness == 0:  # type: ignore[attr-defined]
            self.background.run(name, lambda: self._exchange(item))
            if before is not None and item["skipped"]:
                self.momentum_state.load_state_dict(before)
        else:
            # compression here, in the training thread, while the thread's exchange is on the wire
            ahead = self.engine.prepare(*self._keyed(item), step=item["exchange"]) \
                if not self.schedule_fn.moves else None
            item["ticket"] = self.background.submit(name, lambda: self._exchange(item, ahead))
        self.pending.append(item)
        self._steps += 1
        self._reset_last()
        while self.pending and self.pending[0]["step"] + self.staleness <= t:  # type: ignore[attr-defined]
            self._apply(self.pending.popleft())
        every = self.rebroadcast_every  # type: ignore[attr-defined]
        if every and self._steps % every == 0:
            self.rebroadcast()
        if self.look is not None:
            self.look.predict([it["proxy"] for it in self.pending])

    def _payload(self) -> list[torch.Tensor]:
        """This rank's tensors to average: the clipped gradient (update=optimizer), or
        the momentum buffer fed with it (comprex); fresh tensors."""
        params = [p for _, p in self.named]
        grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        clip_by_total_norm(grads, self.clip)  # type: ignore[attr-defined]
        if self.update == "optimizer":  # type: ignore[attr-defined]
            return grads
        groups = [self.optimizer.param_groups[i] for i in self._group_of]
        lrs = [float(g["lr"]) for g in groups]
        wds = [float(g.get("weight_decay", 0.0) or 0.0) for g in groups]
        return self.momentum_state.update(grads, self.weights(), lrs, wds)

    def _keyed(self, item: dict[str, Any]) -> tuple[list[str], list[torch.Tensor]]:
        """The engine keys and tensors of ``item``'s exchange (with the presence flags, if any)."""
        keys, tensors = [n for n, _ in self.named], list(item["update"])
        if "flags" in item:
            keys, tensors = [*keys, PRESENT_KEY], [*tensors, item["flags"]]
        return keys, tensors

    def _exchange(self, item: dict[str, Any], ahead: Encoded | None = None) -> None:
        """Average ``item['update']`` in place at the item's density (runs on
        the background thread, or inline with staleness 0); ``ahead``: its
        encoding by ``engine.prepare`` in the training thread."""
        assert self.engine is not None
        holder = self._holder
        if holder is not None:
            holder.ratio = item["ratio"]  # type: ignore[attr-defined]
        try:
            before = self.engine.stats["bytes_sent"]
            self.engine.sync(*self._keyed(item), step=item["exchange"], prepared=ahead)
            item["bytes"] = self.engine.stats["bytes_sent"] - before
            item["skipped"] = self.engine.last_step_skipped
        finally:
            if holder is not None:
                holder.ratio = self._target  # type: ignore[attr-defined]

    def _apply(self, item: dict[str, Any]) -> None:
        """Wait for ``item``'s exchange and apply its averaged update."""
        ticket = item.pop("ticket", None)
        if ticket is not None:
            self.background.wait(ticket)
        params = [p for _, p in self.named]
        if not item["skipped"]:
            if self.look is not None:
                self.look.apply(item["update"])
            elif self.update == "comprex":  # type: ignore[attr-defined]
                torch._foreach_sub_(params, [u.to(p.dtype) for p, u in zip(params, item["update"])])
            else:
                # DDP's rule: .grad None where no rank has a gradient (the optimizer skips it), unless EF released some
                present = agreed(item.get("mine", [True] * len(params)), item.get("flags"))
                for p, u, some in zip(params, item["update"], present):
                    p.grad = u.to(p.dtype) if some or bool(u.any()) else None
                self.optimizer.step()
        self._last["bytes"] += item["bytes"]
        self.applied_bytes += item["bytes"]
        self.applied += 1

    @torch.no_grad()
    def rebroadcast(self) -> None:
        """Every rank takes rank 0's parameters and buffers (the exchanges in
        flight finish first: they use the same group). Bytes counted."""
        self.background.drain()
        if self.look is not None:
            self.look.write_back()
        self.broadcast_model()
        if self.look is not None:
            self.look.load_state_dict([p.detach() for _, p in self.named])
        sent = sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers()])
        sent = sent if self.world_size > 1 else 0
        self.applied_bytes += sent
        self._last["bytes"] += sent
        self.rebroadcasts += 1

    def eval_model(self) -> torch.nn.Module:
        """Parameters are identical on every rank: the model itself, unless
        it has floating buffers (BatchNorm statistics stay local between
        re-broadcasts): then their average (collective)."""
        model = self.model
        if any(b.is_floating_point() for b in self.model.buffers()) and self.world_size > 1:
            self.background.drain()
            model = self.consensus_model()
        if self.look is None:
            return model
        if self._eval_copy is None:  # the shared weights, not this rank's prediction
            self._eval_copy = copy.deepcopy(self.model)
        with torch.no_grad():
            for d, s in zip(self._eval_copy.buffers(), model.buffers()):
                d.copy_(s)
            names = {n for n, _ in self.named}
            dst = [p for n, p in self._eval_copy.named_parameters() if n in names]
            for d, x in zip(dst, self.look.shadow):
                d.copy_(x)
        return self._eval_copy

    # ------------------------------------------------------------------ stats
    @property
    def stats(self) -> dict[str, Any]:
        """The hook's vocabulary plus :data:`EXTRA_STATS`. ``exchanges``
        counts the exchanges applied; ``bytes_sent`` their bytes and, after
        :meth:`close`, also those of the exchanges still in flight then
        (they finish, so their bytes were sent, but are never applied)."""
        out = super().stats
        out["bytes_sent"] = self.applied_bytes + (sum(it["bytes"] for it in self.pending) if self._closed else 0)
        out["exchanges"] = self.applied
        out["ratio"] = out["dense_bytes"] / out["bytes_sent"] if out["bytes_sent"] else 1.0
        out.update({"staleness": self.staleness, "in_flight": len(self.pending),  # type: ignore[attr-defined]
                    "density": self.density, "rebroadcasts": self.rebroadcasts, **self.background.timing()})
        return out

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "staleness": self.staleness}  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        self.background.drain()  # residuals and stats must not move while they are copied
        return super().state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.background.drain()
        super().load_state_dict(state)

    def extra_state(self) -> dict[str, Any]:
        pending = [save_pending(it) for it in self.pending]
        shared = {"shared_weights": self.look.state_dict()} if self.look is not None else {}
        return {**shared, "momentum": self.momentum_state.state_dict(), "pending": pending, "density": self.density,
                "applied_bytes": self.applied_bytes, "applied": self.applied, "rebroadcasts": self.rebroadcasts}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.momentum_state.load_state_dict(state.get("momentum", []))
        shapes = [tuple(p.shape) for _, p in self.named]
        if self.look is not None:
            if "shared_weights" not in state:
                raise ValueError(f"{self.name} state: 'shared_weights' missing (saved without the look-ahead); "
                                 "allowed: resume with the lookahead setting the checkpoint was made with")
            self.look.load_state_dict(state["shared_weights"])
        self.pending = collections.deque(load_pending(state.get("pending", []), shapes, self.look is not None))
        self.applied_bytes = int(state.get("applied_bytes", 0))
        self.applied = int(state.get("applied", 0))
        self.rebroadcasts = int(state.get("rebroadcasts", 0))
        self.density = float(state.get("density", self._target))

    def close(self) -> None:
        """Wait for the exchanges in flight, stop the background thread and,
        with the look-ahead, leave the shared weights in the model."""
        try:
            self.background.close()
            self._closed = True
        finally:
            if self.look is not None:
                self.look.write_back()
