"""``diloco:period=H,outer_lr=0.7,outer_momentum=0.9``: DiLoCo, an outer
Nesterov step on the averaged (compressed) parameter change every H steps.

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models"): every worker runs H steps of its own inner
optimizer (the one the user gives: AdamW in the paper, any
``torch.optim.Optimizer`` here) from the common *outer* parameters
``theta``; the *outer gradient* ``Delta_i = theta - x_i`` is averaged over
the workers and fed to an outer optimizer, SGD with Nesterov momentum
(lr 0.7, momentum 0.9, H = 500 in the paper): ``theta <- outer_step(theta,
mean Delta)``; every worker restarts from the new ``theta``. The inner
optimizer's state stays local, as in the paper.

The outer gradient travels through the exchange engine like every other
exchange in gradpress, so any registered compressor shrinks it further,
with error feedback (``compressor="topk:ratio=0.05"``; the residuals live in
the engine, keyed by parameter name, and survive across synchronizations and
``state_dict``). ``residual_decay=beta`` < 1 decays the residual before each
compression (``p = beta * e + Delta``, send ``C(p)``, keep ``e = p - C(p)``):
the residual becomes a local momentum of the outer gradient applied *before*
compression, as DeMo (Peng et al. 2024) and SparseLoCo (Sarfi et al. 2025,
beta 0.95 with outer lr 1 and no outer momentum) do, instead of only the
outer momentum applied after averaging. ``keep_residual=true``: each worker
restarts from ``theta - e_i`` instead of ``theta`` (its own unsent change
stays in its model and the next outer gradient carries it, so the residual
is not fed back a second time: the outer keys' residuals are dropped before
each compression, the synchronous phase's gradient residuals stay ordinary
error feedback); only the
sent part is averaged, so replicas then differ by their residuals right
after a synchronization (``theta`` stays bit-identical). ``evaluate=average``
(DiLoCo only) evaluates the workers' average instead of each worker's own
model (``theta`` minus the mean residual right after a synchronization).
``select=model`` (DiLoCo only) hands the compressor the whole model's outer
gradient as one tensor (key ``diloco/model``), so top-k selects its entries
across all parameters (biases and small tensors included, which
``select=tensor`` sends plain) instead of within each parameter.
Floating buffers (BatchNorm statistics) are averaged plain at each
synchronization.

``switch=N`` (DiLoCo only, default 0): a synchronous start. The DiLoCo paper
starts its workers from a model pretrained synchronously, and post-local SGD
(Lin et al. 2020, "Don't Use Large Mini-Batches, Use Local SGD") switches to
local steps after a synchronous phase: the first N steps are DDP's steps
(:meth:`~gradpress.algorithms.base.Algorithm.ddp_step`, as ``postlocalsgd``:
gradients averaged through the engine under keys ``grad:<name>``, compressed
by the configured compressor with their own error-feedback residuals, and
counted; ``switch_exchange=dense``: plain, uncompressed, as DDP; buffers
averaged plain, and with ``nonfinite=skip`` put back on every rank at a
dropped step, which a buffer not finite on some rank drops too), then
``theta`` is set to the synchronized model and the outer
optimizer starts with no momentum (it has never stepped); outer steps fall
every H steps counted from the switch. ``inner_state=reset`` (DiLoCo only,
default ``keep``): every outer step zeroes each worker's inner optimizer's
floating state (momentum buffers, Adam's moments; step counts are kept),
which points along the worker's own pre-synchronization trajectory.
``residual_decay`` and ``keep_residual`` act on the outer gradient's
residuals only: the synchronous phase's gradients get plain error feedback
(before this was fixed, ``keep_residual`` zeroed the engine's decay for every
key, so a compressed synchronous start ran without error feedback).

Invariants: during the first ``switch`` steps all replicas hold bit-identical
parameters and inner optimizer state (DDP's invariant). ``theta`` and the outer optimizer's momentum are bit-identical on
every rank at all times (the engine's average is bit-identical on every
rank and the outer step is deterministic), so right after every
synchronization all replicas hold bit-identical parameters (except with
``keep_residual``, where each holds ``theta`` minus its own residual). With
``outer_lr=1, outer_momentum=0, nesterov=false`` DiLoCo is local SGD:
``theta - mean(theta - x_i) = mean(x_i)`` up to rounding (tested in float64).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gradpress.algorithms.alarm import StateAlarm
from gradpress.algorithms.base import Algorithm
from gradpress.algorithms.localsgd import GRAD
from gradpress.algorithms.registry import register
from gradpress.algorithms.restart import LocalCopy
from gradpress.algorithms.sync_guard import SyncGuard
from gradpress.compress.base import Param
from gradpress.exchange.feedback import Feedback

PARAMS = (
    Param("period", int, 100, "integer >= 1", lambda v: v >= 1, "inner steps between outer steps (H; 500 in the paper)"),
    Param("outer_lr", float, 0.7, "number > 0", lambda v: v > 0, "outer SGD learning rate"),
    Param("outer_momentum", float, 0.9, "number in [0, 1)", lambda v: 0 <= v < 1, "outer SGD momentum"),
    Param("nesterov", bool, True, "true or false (true needs outer_momentum > 0)", None, "Nesterov outer momentum"),
    Param("residual_decay", float, 1.0, "number in [0, 1] (below 1 needs error feedback)", lambda v: 0 <= v <= 1,
          "error-feedback residual decay beta: each worker compresses beta * e + Delta (1: plain error feedback; "
          "below 1 the residual is a local momentum of the outer gradient, as in DeMo / SparseLoCo)"),
)


#: DiLoCo's own (Streaming DiLoCo merges fragments its own way)
KEEP_RESIDUAL = Param(
    "keep_residual", bool, False, "true or false (true needs error feedback and residual_decay=1)", None,
    "workers restart from theta minus their own unsent residual (it stays in the local model, not fed back)")
EVALUATE = Param(
    "evaluate", str, "own", "own or average", lambda v: v in ("own", "average"),
    "the model eval_model() returns: each worker's own, or the workers' average (one uncounted allreduce)")
SELECT = Param(
    "select", str, "tensor", "tensor or model (model needs one dtype)", lambda v: v in ("tensor", "model"),
    "what the compressor sees: each parameter's outer gradient, or the whole model's as one tensor "
    "(top-k then selects across all parameters, biases included)")
SWITCH = Param(
    "switch", int, 0, "integer >= 0", lambda v: v >= 0,
    "the first N steps are synchronous (gradients averaged through the compressor, as DDP), then DiLoCo "
    "from the synchronized model with a fresh outer optimizer")
SWITCH_EXCHANGE = Param(
    "switch_exchange", str, "compressed", "compressed or dense", lambda v: v in ("compressed", "dense"),
    "how the synchronous phase's gradients travel: through the configured compressor (with error feedback), "
    "or dense (plain allreduce, as DDP)")
INNER_STATE = Param(
    "inner_state", str, "keep", "keep or reset", lambda v: v in ("keep", "reset"),
    "the inner optimizer's floating state (momentum, moments) at each outer step: kept, or zeroed")
#: the engine key of the whole model's outer gradient (select=model)
MODEL_KEY = "diloco/model"


@register
class DiLoCo(Algorithm):
    name = "diloco"
    PARAMS = (*PARAMS, KEEP_RESIDUAL, EVALUATE, SELECT, SWITCH, SWITCH_EXCHANGE, INNER_STATE)
    summary = ("DiLoCo: H inner optimizer steps, then an outer Nesterov SGD step on the averaged "
               "(compressed, error-compensated) parameter change")

    def exchanged_params(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        if getattr(self, "select", "tensor") == "model":
            dtypes = {p.dtype for _, p in self.named}
            if len(dtypes) != 1:
                raise ValueError(f"algorithm {self.name!r}: parameter 'select' is 'model' but the parameters have "
                                 f"{len(dtypes)} dtypes; allowed: select=tensor, or one dtype")
            # 2-D (1, n): the engine compresses it (1-D tensors travel plain)
            own = [(MODEL_KEY, torch.Size([1, sum(p.numel() for _, p in self.named)]), dtypes.pop())]
        else:
            own = super().exchanged_params()
        if getattr(self, "switch", 0):  # the synchronous phase's gradients: their own keys and residuals
            dense = getattr(self, "switch_exchange", "compressed") == "dense"
            # registered 1-D, the engine's plan sends them plain (uncompressed, no residual)
            own += [(GRAD + n, torch.Size([p.numel()]) if dense else p.shape, p.dtype) for n, p in self.named]
        return own

    def setup(self) -> None:
        if self.nesterov and self.outer_momentum == 0:  # type: ignore[attr-defined]
            raise ValueError(f"algorithm {self.name!r}: parameter 'nesterov' is true but 'outer_momentum' is 0 "
                             "(Nesterov needs momentum); allowed: nesterov=false with outer_momentum=0, "
                             "or outer_momentum > 0")
        assert self.engine is not None
        if getattr(self, "keep_residual", False):
            if not self.engine.error_feedback:
                raise ValueError(f"algorithm {self.name!r}: parameter 'keep_residual' is true but error feedback "
                                 "is off (the residual is what the worker keeps); allowed: keep_residual=false, "
                                 "or a compressor with error feedback on")
            if self.residual_decay != 1.0:  # type: ignore[attr-defined]
                raise ValueError(f"algorithm {self.name!r}: parameter 'keep_residual' is true with "
                                 f"'residual_decay' {self.residual_decay} (the residual stays in the model and "  # type: ignore[attr-defined]
                                 "is not fed back, so there is nothing to decay); allowed: residual_decay=1")
            # the residual rides in the parameters: the next outer gradient already holds it, so
            # outer_step drops the outer keys' residuals before compensating (not a global decay of
            # 0, which would also switch off the synchronous phase's gradient error feedback)
        if self.residual_decay != 1.0:  # type: ignore[attr-defined]
            if not self.engine.error_feedback:
                raise ValueError(f"algorithm {self.name!r}: parameter 'residual_decay' is "
                                 f"{self.residual_decay} but error feedback is off (the decay acts on the "  # type: ignore[attr-defined]
                                 "residual); allowed: residual_decay=1, or a compressor with error feedback on")
            # the engine's residual store: p = beta * e + Delta is compressed, e <- p - C(p)
            self.engine.feedback.beta = self.residual_decay  # type: ignore[attr-defined]

    def after_broadcast(self) -> None:
        #: the outer parameters theta, identical on every rank
        self.anchor = [p.detach().clone() for _, p in self.named]
        self.outer = torch.optim.SGD(self.anchor, lr=self.outer_lr,  # type: ignore[attr-defined]
                                     momentum=self.outer_momentum,  # type: ignore[attr-defined]
                                     nesterov=self.nesterov)  # type: ignore[attr-defined]
        #: nonfinite=skip: this rank's inner optimizer state and buffers at theta (a dropped sync restores them)
        self.restart = LocalCopy.for_skip(self)
        #: nonfinite=raise: a non-finite inner optimizer state or buffer on some rank raises at a synchronization
        self.alarm = StateAlarm.for_raise(self)

    def step(self) -> None:
        switch = getattr(self, "switch", 0)
        if self._steps < switch:  # synchronous start: DDP's step (as postlocalsgd)
            assert self.engine is not None
            feedback, decay = self.engine.feedback, self.engine.feedback.beta
            feedback.beta = 1.0  # residual_decay is the outer gradient's: the gradients get plain error feedback
            try:
                self.ddp_step(keys=[GRAD + n for n, _ in self.named])
            finally:
                feedback.beta = decay
            if self._steps == switch:  # theta = the synchronized model; the outer optimizer never stepped
                with torch.no_grad():
                    for a, (_, p) in zip(self.anchor, self.named):
                        a.copy_(p)
                    if self.restart is not None:
                        self.restart.take()
            return
        self.local_step()
        if (self._steps - switch) % self.period == 0:  # type: ignore[attr-defined]
            guard = self.outer_step(range(len(self.named)))
            # dropped: the period never happened, inner state and buffers as they were at theta; else buffers averaged
            guard.settle(list(self.model.buffers()))
            if getattr(self, "inner_state", "keep") == "reset":
                self.reset_inner_state()

    @torch.no_grad()
    def reset_inner_state(self) -> None:
        """Zero the inner optimizer's floating state tensors (momentum
        buffers, Adam's moments; scalar step counts are kept)."""
        for state in self.optimizer.state.values():
            for t in state.values():
                if torch.is_tensor(t) and t.is_floating_point() and t.dim() > 0:
                    t.zero_()

    @torch.no_grad()
    def outer_gradient(self, idx: Sequence[int]) -> list[torch.Tensor]:
        """``theta - x`` for the parameters ``idx`` (fresh tensors)."""
        return [self.anchor[i] - self.named[i][1].detach() for i in idx]

    @torch.no_grad()
    def apply_outer(self, idx: Sequence[int], mean_delta: Sequence[torch.Tensor]) -> None:
        """The outer optimizer step on ``theta[idx]`` with the averaged outer
        gradient (the other parameters and their momentum are untouched)."""
        for i, d in zip(idx, mean_delta):
            self.anchor[i].grad = d
        self.outer.step()
        for i in idx:
            self.anchor[i].grad = None

    @torch.no_grad()
    def outer_step(self, idx: Sequence[int]) -> SyncGuard:
        """Average the outer gradient of ``idx`` through the engine, step
        ``theta`` and restart those parameters from it. An exchange the
        engine skipped (``nonfinite=skip``: some rank's outer gradient, or
        its inner optimizer state or floating buffers, which
        :meth:`LocalCopy.flag_into` marks in the outer gradient, were not
        finite) leaves ``theta`` and the outer momentum untouched (the
        outer optimizer is not stepped on the zeroed average); the workers
        still restart from ``theta`` (``keep_residual``: minus each one's
        residual of the last agreed point, which stays), and :meth:`step` puts each rank's inner
        optimizer state and buffers back to its copy taken at ``theta``
        (:mod:`gradpress.algorithms.restart`) through the returned guard's
        :meth:`~gradpress.algorithms.sync_guard.SyncGuard.settle`. With
        ``nonfinite='raise'`` a non-finite inner state or buffer on some rank
        raises on every rank after the exchange (:mod:`gradpress.algorithms.alarm`)."""
        idx = list(idx)
        deltas = self.outer_gradient(idx)
        # nonfinite: a non-finite inner state or buffer drops (skip) or fails (raise) the synchronization too
        guard = SyncGuard.before(self, deltas, idx)
        assert self.engine is not None
        keep = getattr(self, "keep_residual", False)
        model = getattr(self, "select", "tensor") == "model"  # DiLoCo only: idx is every parameter
        held: dict[str, torch.Tensor] = {}
        if keep:  # e_i is already in theta - x_i: nothing is fed back (p = Delta_i)
            for key in [MODEL_KEY] if model else [self.named[i][0] for i in idx]:
                store_key = Feedback.of(key)
                e = self.engine.feedback.residuals.pop(store_key, None)
                if e is not None:
                    held[store_key] = e
        if model:
            flat = torch.cat([d.reshape(-1) for d in deltas]).reshape(1, -1)
            keys, tensors = guard.riding([MODEL_KEY], [flat])
            self.sync(tensors, keys=keys)
            deltas = [v.view_as(d) for v, d in zip(flat.reshape(-1).split([d.numel() for d in deltas]), deltas)]
        else:
            keys, tensors = guard.riding([self.named[i][0] for i in idx], deltas)
            self.sync(tensors, keys=keys)
        skipped = guard.check(f"step {self._steps}")  # raise: before anything is applied, the same on every rank
        if keep and skipped:
            # the period never happened: each worker's residual of the last agreed point stays, and it restarts
            # from theta minus it (the store kept zeros for the keys taken out above: the unsent change was lost)
            self.engine.feedback.residuals.update(held)
        if keep and model:
            resid = self.engine.feedback.current(Feedback.of(MODEL_KEY), flat).reshape(-1).split(
                [d.numel() for d in deltas])
            kept = [r.view_as(d) for r, d in zip(resid, deltas)]
        elif keep:
            kept = [self.engine.feedback.current(Feedback.of(self.named[i][0]), self.named[i][1]) for i in idx]
        if not skipped:  # nonfinite=skip: theta and its momentum stay, workers restart
            self.apply_outer(idx, deltas)
        for n, i in enumerate(idx):
            p = self.named[i][1]
            if keep:  # theta - e: the worker keeps the part of its own change it did not send
                p.copy_(self.anchor[i] - kept[n])
            else:
                p.copy_(self.anchor[i])
        return guard

    def eval_model(self) -> torch.nn.Module:
        """``evaluate=own``: this worker's model; ``evaluate=average``: the
        workers' average (:meth:`consensus_model`, collective; evaluation
        traffic, not counted, as DDP's evaluation is not)."""
        if getattr(self, "evaluate", "own") == "average":
            return self.consensus_model()
        return self.model

    def extra_state(self) -> dict[str, Any]:
        out = {"anchor": [a.clone() for a in self.anchor], "outer": copy.deepcopy(self.outer.state_dict())}
        if self.restart is not None:
            out["restart"] = self.restart.state_dict()
        return out

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        anchor = state.get("anchor")
        if anchor is None or len(anchor) != len(self.anchor) or "outer" not in state:
            raise ValueError(f"{self.name} state: outer parameters or outer optimizer missing, or of another model")
        for a, saved in zip(self.anchor, anchor):
            if a.shape != saved.shape:
                raise ValueError(f"{self.name} state: outer parameter of shape {tuple(saved.shape)}, "
                                 f"model has {tuple(a.shape)}")
            a.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        if self.restart is not None:
            self.restart.load_extra(state, self.name)
        if getattr(self, "keep_residual", False):  # checkpoints before the fix saved the engine's decay as 0
            assert self.engine is not None
            self.engine.feedback.beta = 1.0
