"""``scaffold:period=K,global_lr=1``: SCAFFOLD, local steps corrected by
control variates, models averaged every K steps.

SCAFFOLD (Karimireddy et al., ICML 2020, "SCAFFOLD: Stochastic Controlled
Averaging for Federated Learning"), with every worker participating in every
round: each worker i holds a control variate ``c_i`` (its own) and every
worker holds the same server control variate ``c``, both one tensor per
trainable parameter, zero at the start. From the common model ``x`` each
worker takes K local steps on the *corrected* gradient ``g_i - c_i + c``
(its local optimizer steps with that as ``.grad``), reaching ``y_i``; then,
with the paper's option II,

* ``c_i+ = c_i - c + (x - y_i) / (K * lr)``,
* ``x <- x + global_lr * mean_i(y_i - x)``,
* ``c <- c + mean_i(c_i+ - c_i)`` and ``c_i <- c_i+``.

Non-IID data makes plain local SGD drift towards each worker's own optimum;
``c - c_i`` estimates the difference between the mean gradient and worker
i's, and cancels that drift.

The local learning rate is read from the optimizer's ``param_groups`` at
every step, before the optimizer steps (what that step uses): ``K * lr``
is, per parameter, the sum of the learning rates of the K steps of its
group (so a scheduler that changes ``lr`` within a period, and per-group
learning rates, are followed exactly: with plain SGD ``(x - y_i) / sum(lr)``
is the lr-weighted mean of the corrected gradients and ``c_i+`` the
lr-weighted mean of the local gradients, the paper's quantity; with a
constant lr it is the paper's ``K * lr``). A step where a parameter's
``.grad`` is None does not step it (torch's rule, left None: no correction)
and adds nothing to its sum; a parameter whose sum is 0 over the period
(never stepped, or lr 0) keeps its ``c_i`` (``c_i+ - c_i = 0``: 0/0 has no
estimate). An optimizer with ``maximize=True`` is refused (the
correction's sign assumes descent).

``control``: how ``c_i+`` is computed. Option II reads it from the
displacement, which is the lr-weighted mean of the corrected gradients only
for plain SGD; with momentum the displacement is up to ``1 / (1 -
momentum)`` times longer (a constant gradient g over K = 8 steps of momentum
0.9 from a zero buffer: ``c_i+ = 3.59 g``), the correction ``c - c_i`` is
inflated by as much and then amplified by the momentum again: on
mnist1d-cnn's defaults (momentum SGD 0.9, 2 workers, K = 8) option II
diverged at step 103. ``control=gradients`` computes ``c_i+ =
sum_k(lr_k g_k) / sum_k(lr_k)`` from the period's local gradients (``.grad``
before the correction, plus ``weight_decay * y`` for ``torch.optim.SGD``,
whose weight decay is an L2 term of the gradient it descends; one more
model-sized tensor per rank), which for plain SGD, with or without weight
decay, equals option II (``x - y_i = sum_k lr_k (g_k + wd y_k - c_i + c)``;
tested) and for any other optimizer is the gradient estimate the method
needs (0.942 on that run, local SGD 0.938; one seed). ``auto`` (the default): option II for
``torch.optim.SGD`` without momentum in every group (the paper's setting),
``gradients`` otherwise. The local optimizer's state stays local.

Exchange: one engine call per synchronization carries the model change
``y_i - x`` (keyed by parameter name) and the control change
``c_i+ - c_i`` (keyed ``control:<name>``), so a compressor shrinks both,
each with its own error-feedback residual: twice local SGD's bytes per
synchronization. With compression ``c`` is the running sum of the averaged
*compressed* control changes (identical on every rank) and no longer equals
``mean_i c_i`` exactly; error feedback sends the rest later. Floating
buffers are averaged plain at each synchronization, as local SGD's.

``warmup=W``: the period grows linearly from 1 to K over the first W steps
(as ``postlocalsgd``'s). ``nonfinite='skip'``: a synchronization dropped
(some rank's change, optimizer state or floating buffer not finite) puts
every replica back at ``x``, leaves ``c`` and every ``c_i`` as they were, and
restores each rank's optimizer state and buffers from ``x``
(:mod:`gradpress.algorithms.restart`); ``raise`` raises on every rank,
naming the tensor (:mod:`gradpress.algorithms.alarm`).

``scaler=`` (fp16 autocast with ``GradScaler``, :mod:`gradpress.algorithms.loss_scale`): the gradient is
unscaled before it is corrected (``c`` and ``c_i`` are in gradient units); a local step this rank's scaler
skips (its gradient overflowed) adds nothing to the period's lr and gradient sums, so ``c_i+`` is the
estimate from the steps taken (one host read of the scaler's flag per step, as ``scaler.step`` makes).

Invariants (tests/test_scaffold.py, float64 references computed there):
after every synchronization all replicas hold bit-identical parameters and
``c``; with K = 1 and zero control variates the first period is one step of
synchronous SGD on the mean gradient; resume from ``state_dict`` (``x``,
``c``, ``c_i``, the period's lr sums and gradient sums) is bit-identical.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gradpress.algorithms.alarm import StateAlarm
from gradpress.algorithms.base import Algorithm
from gradpress.algorithms.localsgd import warmed_period
from gradpress.algorithms.registry import register
from gradpress.algorithms.restart import LocalCopy
from gradpress.algorithms.sync_guard import SyncGuard
from gradpress.compress.base import Param

#: the engine key prefix of the control variates' changes
CONTROL = "control:"


@register
class Scaffold(Algorithm):
    name = "scaffold"
    PARAMS = (
        Param("period", int, 8, "integer >= 1", lambda v: v >= 1, "local steps between averages (K)"),
        Param("global_lr", float, 1.0, "number > 0", lambda v: v > 0,
              "server learning rate: x <- x + global_lr * mean(y_i - x)"),
        Param("warmup", int, 0, "integer >= 0", lambda v: v >= 0,
              "the period grows linearly from 1 to K over this many steps"),
        Param("control", str, "auto", "auto, displacement or gradients",
              lambda v: v in ("auto", "displacement", "gradients"),
              "c_i+ from the displacement (the paper's option II: c_i - c + (x - y_i) / (K lr)) or as the "
              "lr-weighted mean of the period's local gradients (SGD's weight decay included; equal for plain SGD); auto: displacement for "
              "plain SGD (no momentum), gradients for any other optimizer"),
    )
    summary = ("SCAFFOLD: K local steps on the gradient corrected by control variates (g - c_i + c), then the "
               "model change and the control change are averaged (2x local SGD's bytes)")
    period: int
    global_lr: float
    warmup: int
    control: str

    def exchanged_params(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        own = super().exchanged_params()
        return own + [(CONTROL + n, shape, dtype) for n, shape, dtype in own]

    def setup(self) -> None:
        for i, group in enumerate(self.optimizer.param_groups):
            if group.get("maximize", False):
                raise ValueError(f"algorithm {self.name!r}: optimizer param_groups[{i}] has maximize=True "
                                 "(the control variates correct a descent direction); allowed: maximize=False")
        plain_sgd = type(self.optimizer) is torch.optim.SGD and all(
            not g.get("momentum", 0) for g in self.optimizer.param_groups)
        #: how c_i+ is computed: ``displacement`` (option II) or ``gradients`` (``control`` resolved)
        self.control_from = self.control if self.control != "auto" else (
            "displacement" if plain_sgd else "gradients")

    def after_broadcast(self) -> None:
        params = [p for _, p in self.named]
        #: the model x every rank agreed on at the last synchronization
        self.anchor = [p.detach().clone() for p in params]
        #: the server control variate c (identical on every rank) and this rank's own c_i
        self.c = [torch.zeros_like(p) for p in params]
        self.c_local = [torch.zeros_like(p) for p in params]
        #: c - c_i, added to each gradient (recomputed from c and c_i at each synchronization and load)
        self.correction = [torch.zeros_like(p) for p in params]
        #: per parameter, the learning rates of this period's steps that stepped it (K * lr with a constant lr)
        self.lr_sums = [0.0] * len(params)
        #: control=gradients: per parameter, the sum of lr * g over this period's steps (g before the correction)
        self.grad_sums = [torch.zeros_like(p) for p in params] if self.control_from == "gradients" else []
        #: local steps since the last synchronization
        self.since = 0
        self.restart = LocalCopy.for_skip(self)
        self.alarm = StateAlarm.for_raise(self)

    def step(self) -> None:
        scale = self.loss_scale  # fp16 loss scaling: the correction and the sums are in gradient units
        if scale is not None:
            scale.unscale()
        # a local step this rank's scaler skips (its gradient overflowed) is no step: no lr, no gradient in the
        # period's sums (the period still ends at the same step on every rank: ``since`` counts it)
        if scale is None or not scale.found_inf():
            self.correct_gradients()
        self.local_step()
        self.since += 1
        if self.since >= warmed_period(self.period, self.warmup, self._steps):
            self.average()

    @torch.no_grad()
    def correct_gradients(self) -> None:
        """``g_i - c_i + c`` in place in each ``.grad``, and this step's
        learning rate (read now, before the optimizer steps) added to the
        period's sum of every parameter it steps; ``control=gradients``: ``lr
        g`` added to the gradient sums (``lr (g + wd y)`` with SGD's weight
        decay)."""
        group_of = {id(p): group for group in self.optimizer.param_groups for p in group["params"]}
        # torch's SGD descends g + wd * y (weight decay as an L2 term of the gradient): so does c_i+
        l2 = type(self.optimizer) is torch.optim.SGD
        for i, (_, p) in enumerate(self.named):
            if p.grad is None:
                continue
            group = group_of.get(id(p), {})
            lr = float(group.get("lr", 0.0))
            if self.grad_sums:
                self.grad_sums[i].add_(p.grad.to(self.grad_sums[i].dtype), alpha=lr)
                wd = float(group.get("weight_decay", 0) or 0) if l2 else 0.0
                if wd:
                    self.grad_sums[i].add_(p.detach().to(self.grad_sums[i].dtype), alpha=lr * wd)
            p.grad.add_(self.correction[i].to(p.grad.dtype))
            self.lr_sums[i] += lr

    @torch.no_grad()
    def average(self) -> None:
        """Average the model change and the control change (one engine call);
        every replica restarts from the new ``x``."""
        names = [n for n, _ in self.named]
        deltas = [p.detach() - a for (_, p), a in zip(self.named, self.anchor)]  # y_i - x
        controls = self.control_changes(deltas)
        own = [t.clone() for t in controls]
        # nonfinite: a non-finite optimizer state or buffer drops (skip) or fails (raise) the synchronization too
        guard = SyncGuard.before(self, deltas)
        keys, tensors = guard.riding([*names, *(CONTROL + n for n in names)], [*deltas, *controls])
        self.sync(tensors, keys=keys)
        skipped = guard.check(f"step {self._steps}")  # raise: before anything is applied, the same on every rank
        for i, (_, p) in enumerate(self.named):
            if not skipped:
                self.anchor[i].add_(deltas[i], alpha=self.global_lr)
                self.c[i].add_(controls[i])
                self.c_local[i].add_(own[i])
                torch.sub(self.c[i], self.c_local[i], out=self.correction[i])
            p.copy_(self.anchor[i])
        self.lr_sums = [0.0] * len(self.named)
        for t in self.grad_sums:
            t.zero_()
        self.since = 0
        # dropped: the period never happened, optimizer state and buffers as they were at x; else buffers averaged
        guard.settle(list(self.model.buffers()))

    def control_changes(self, deltas: list[torch.Tensor]) -> list[torch.Tensor]:
        """``c_i+ - c_i`` per parameter (fresh tensors): option II,
        ``(x - y_i) / (K lr) - c``, or ``sum(lr g) / sum(lr) - c_i``; 0 where
        nothing stepped the parameter this period (its sum of lrs is 0)."""
        if self.grad_sums:
            return [g / s - ci if s > 0 else torch.zeros_like(ci)
                    for g, s, ci in zip(self.grad_sums, self.lr_sums, self.c_local)]
        return [-d / s - c if s > 0 else torch.zeros_like(c) for d, s, c in zip(deltas, self.lr_sums, self.c)]

    def eval_model(self) -> torch.nn.Module:
        """Right after a synchronization the replicas are identical: the
        model itself; otherwise their average (collective)."""
        return self.model if self.since == 0 else self.consensus_model()

    def extra_state(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "anchor": [a.clone() for a in self.anchor], "c": [t.clone() for t in self.c],
            "c_local": [t.clone() for t in self.c_local], "lr_sums": list(self.lr_sums), "since": self.since,
        }
        if self.grad_sums:
            out["grad_sums"] = [t.clone() for t in self.grad_sums]
        if self.restart is not None:
            out["restart"] = self.restart.state_dict()
        return out

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        for key in ["anchor", "c", "c_local"] + (["grad_sums"] if self.grad_sums else []):
            saved, mine = state.get(key), getattr(self, key)
            if not isinstance(saved, list) or [tuple(t.shape) for t in saved] != [tuple(t.shape) for t in mine]:
                raise ValueError(f"{self.name} state: {key!r} missing or of another model (expected "
                                 f"{len(mine)} tensors shaped as the trainable parameters)")
            for t, s in zip(mine, saved):
                t.copy_(s)
        lr_sums = state.get("lr_sums")
        if not isinstance(lr_sums, list) or len(lr_sums) != len(self.named):
            raise ValueError(f"{self.name} state: 'lr_sums' missing or of another model "
                             f"(expected {len(self.named)} numbers)")
        self.lr_sums = [float(v) for v in lr_sums]
        self.since = int(state.get("since", 0))
        for c, ci, corr in zip(self.c, self.c_local, self.correction):
            torch.sub(c, ci, out=corr)
        if self.restart is not None:
            self.restart.load_extra(state, self.name)
