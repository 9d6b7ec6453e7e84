"""What 1-bit Adam and 0/1 Adam share: an Adam the algorithm owns, whose
momentum (or gradient) travels compressed through the exchange engine.

Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale Training
with Adam's Convergence Speed"; Lu et al. 2022, "Maximizing Communication
Efficiency for Large-scale Training via 0/1 Adam". Compressing the gradient
of Adam breaks it: the nonlinear second moment amplifies the compression
error. Both papers keep the variance ``v`` exact (warm-up) and then frozen
(or updated ever more rarely), so that the update ``m / (sqrt(v) + eps)`` is
linear in the exchanged quantity and error feedback works as it does for SGD.

Design (why an :class:`~gradpress.algorithms.base.Algorithm`, not an
optimizer under the DDP hook): the exchanged tensor is the *momentum* (or
0/1 Adam's accumulated local update), which only exists inside the optimizer
step, and the warm-up must average the gradient exactly while the compressed
stage must not average it at all. An algorithm owns the step, so one class
does both phases; DDP would allreduce every gradient bucket first.

The user's ``torch.optim.Adam`` / ``AdamW`` only supplies hyperparameters:
``lr``, ``betas``, ``eps``, ``weight_decay`` are read from its
``param_groups`` at every step (LR schedulers keep working); ``AdamW`` (or
``decoupled_weight_decay``) decays the parameters, ``Adam`` adds ``wd * p``
to the gradient, as torch does. The algorithm keeps ``m``, ``v``, the step
counters and (in the engine) both residuals; the optimizer's own state stays
empty. ``amsgrad``, ``maximize`` and other optimizers are refused, and so
is a trainable parameter the optimizer holds but the model does not (the
algorithm never calls ``optimizer.step()``: it would never be trained).

Bias correction: torch's. The update is ``p -= lr / (1 - b1^t) * m /
(sqrt(v / (1 - b2^s)) + eps)`` with ``t`` the steps taken and ``s`` the
number of variance updates; once the variance stops changing, ``s`` stops
too, so the corrected variance is frozen as a whole (the paper freezes
``v_{T_w}``; DeepSpeed omits the correction, harmless at its freeze steps of
~10^4, not at a freeze step of 60). ``1 - b1^t`` tends to 1 (the papers omit
it). ``bias_correction=false`` gives DeepSpeed's uncorrected form.

Compressed exchange: the paper's compressed allreduce (worker-side error
feedback on the whole tensor, then a compressed reduce-scatter where each
chunk's owner averages the N decoded chunks, re-compresses with a
server-side residual of its own, and an allgather of the owners' bytes) is
the engine's ``ps`` strategy with one partition per rank (``name#k``, roots
round robin): worker residuals under the parameter's name, owner residuals
under ``root/name#k#ps`` in the same store, both in ``state_dict``. With
the default ``strategy="collective"`` that is what runs; any other strategy
(``allgather``, ``ring``, ``auto``) is honoured as given. Tensors below
``min_numel`` and 1-D tensors (biases, norms) travel uncompressed, as in
every gradpress exchange.

A parameter whose ``.grad`` is None: torch's Adam skips it (the
parameter, ``m``, ``v`` and its step count stay). These optimizers decide
on what every rank agrees on, with DDP's rule: the ranks exchange one flag
per parameter inside a collective the step makes anyway (the gradient's
allreduce on exact steps; on a compressed exchange a 1-D tensor under
:data:`PRESENT_KEY`, in the engine's plain allreduce); a rank that has
every gradient reads nothing back, one that lacks some reads the flags.
Missing on every rank: skipped as torch does (``p``, ``m``, ``v``, its
counts and residuals stay; a compressed exchange carried it, every rank
issuing the same collectives, and its residuals and ``m`` are put back).
Missing on some ranks only: a zero gradient there (DDP's average),
and every rank steps it. Bias correction counts each parameter's own steps
(``steps``) and variance updates (``v_steps``), as torch's per-parameter
``step`` does. 0/1 Adam's local steps exchange nothing per step: there a
missing gradient skips the parameter on that rank alone (its local Adam
step), and the step counts advance on every rank so they stay equal.

Invariants: ``m``, ``v`` and the parameters are bit-identical on every rank
after every synchronized step (the engine's average is); with an identity
compressor and no freeze the update is distributed Adam's (tested in
float64); ``state_dict`` holds everything needed to resume bit-identically.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from gradpress.algorithms.base import Algorithm, Preflight
from gradpress.algorithms.presence import PRESENT_KEY, agreed, flags, sync_agreeing
from gradpress.compress import Compressor, create
from gradpress.compress.base import Param, all_finite
from gradpress.exchange.nonfinite import nonfinite_gradient_error
from gradpress.exchange.planner import Decision, Plan
from gradpress.exchange.strategies.recompress import unsupported_reason

__all__ = ["CompressedAdam", "BIAS_PARAM", "PRESENT_KEY"]

BIAS_PARAM = Param("bias_correction", bool, True, "true or false", None,
                   "torch's bias correction (false: DeepSpeed's uncorrected update)")


def _require_adam(name: str, optimizer: type) -> None:
    if not issubclass(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(f"algorithm {name!r}: optimizer must be torch.optim.Adam or AdamW "
                         f"(it supplies lr, betas, eps, weight_decay), got {optimizer.__name__}")


class CompressedAdam(Algorithm):
    """Adam owned by the algorithm; subclasses implement :meth:`step` with
    :meth:`gradients` (base class), :meth:`_exact_average`, :meth:`_moments`, :meth:`_apply`."""

    default_compressor = "efsignsgd"
    reshard_refusal = ("its compressed allreduce cuts the momentum into one partition per saved rank, whose "
                       "owners keep the server-side residuals")

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 compressor: str | Compressor | None = None, strategy: str = "collective",
                 process_group: dist.ProcessGroup | None = None,
                 timeout: float | datetime.timedelta | None = None, **options: Any) -> None:
        self._chunked = False
        try:
            built = create(compressor if compressor is not None else self.default_compressor)
        except ValueError:
            built = None  # the base class raises it again, on every rank, before agreeing
        if built is not None:
            compressor = built
            if strategy == "collective" and not built.identity and unsupported_reason(built, "ps") is None:
                strategy, self._chunked = "ps", True  # the paper's compressed allreduce
        super().__init__(model, optimizer, compressor=compressor, strategy=strategy,
                         process_group=process_group, timeout=timeout, **options)

    # ---------------------------------------------------------------- setup
    @classmethod
    def preflight(cls, params: Mapping[str, Any], run: Preflight) -> None:
        _require_adam(cls.name, run.optimizer)

    def setup(self) -> None:
        opt = self.optimizer
        _require_adam(self.name, type(opt))
        for i, group in enumerate(opt.param_groups):
            for flag in ("amsgrad", "maximize"):
                if group.get(flag):
                    raise ValueError(f"algorithm {self.name!r}: optimizer param_groups[{i}] has {flag}=True; "
                                     f"allowed: {flag}=False")
        owner = {id(p): g for g, group in enumerate(opt.param_groups) for p in group["params"]}
        missing = [n for n, p in self.named if id(p) not in owner]
        if missing:
            raise ValueError(f"algorithm {self.name!r}: parameter {missing[0]!r} is not in the optimizer; "
                             "the optimizer must hold every trainable parameter of the model")
        mine = {id(p) for _, p in self.named}
        for g, group in enumerate(opt.param_groups):  # this class steps self.named, never optimizer.step()
            for p in group["params"]:
                if p.requires_grad and id(p) not in mine:
                    raise ValueError(f"algorithm {self.name!r}: optimizer param_groups[{g}] holds a parameter of "
                                     f"shape {tuple(p.shape)} that is not a trainable parameter of the model; it "
                                     "would never be trained (the algorithm steps the model's parameters itself): "
                                     "register it in the model or freeze it (requires_grad=False)")
        self._group_of = [owner[id(p)] for _, p in self.named]
        self.exp_avg = [torch.zeros_like(p, memory_format=torch.preserve_format) for _, p in self.named]
        self.exp_avg_sq = [torch.zeros_like(p, memory_format=torch.preserve_format) for _, p in self.named]
        self.t = 0  # the algorithm's steps (its schedule: freeze, intervals)
        self.steps = [0] * len(self.named)  # Adam steps each parameter took (torch's per-parameter ``step``)
        self.v_steps = [0] * len(self.named)  # variance updates of each parameter
        assert self.engine is not None
        if self._chunked and self.world_size > 1:
            n = self.world_size
            self.engine.plan = Plan({
                k: Decision(k, d.numel, "ps", min(n, d.numel), reason="compressed allreduce (Tang et al. 2021)")
                if d.compressed else d
                for k, d in self.engine.plan.decisions.items()
            }, "compressed allreduce: one partition per rank")

    # -------------------------------------------------------------- helpers
    def _hyper(self, i: int) -> tuple[float, float, float, float, float, bool]:
        """(lr, beta1, beta2, eps, weight_decay, decoupled) of parameter ``i``, read now."""
        g = self.optimizer.param_groups[self._group_of[i]]
        b1, b2 = g["betas"]
        decoupled = isinstance(self.optimizer, torch.optim.AdamW) or bool(g.get("decoupled_weight_decay", False))
        return float(g["lr"]), float(b1), float(b2), float(g["eps"]), float(g["weight_decay"]), decoupled

    def _flags(self, mine: list[bool], like: torch.Tensor) -> torch.Tensor:
        """:func:`gradpress.algorithms.presence.flags`."""
        return flags(mine, like)

    @staticmethod
    def _agreed(mine: list[bool], summed: torch.Tensor | None) -> list[bool]:
        """:func:`gradpress.algorithms.presence.agreed`."""
        return agreed(mine, summed)

    def _sync_agreeing(self, tensors: list[torch.Tensor], mine: list[bool]) -> list[bool] | None:
        """Average ``tensors`` (one per parameter) through the engine with the
        presence flags in the same call (:func:`gradpress.algorithms.presence.sync_agreeing`)."""
        return sync_agreeing(self, tensors, mine)

    def _exact_average(self, grads: list[torch.Tensor]) -> list[bool] | None:
        """Average ``grads`` uncompressed, in place (DDP's reduction; a
        missing gradient counts as zeros), with the engine's NaN/Inf
        protocol: a non-finite gradient on any rank makes the sums
        non-finite on every rank, so every rank decides the same. Returns
        which parameters some rank has a gradient for (:meth:`_agreed`: the
        flags ride in the same allreduce), or None: drop this step
        (``nonfinite='skip'``); ``raise`` raises ``FloatingPointError``
        naming the tensors; ``propagate`` never drops."""
        mine = [p.grad is not None for _, p in self.named]
        flags = self._flags(mine, grads[0]) if grads else None
        self.average_plain([*grads, flags] if flags is not None else grads)
        self._exchanges += 1
        present = self._agreed(mine, flags)
        assert self.engine is not None
        if self.engine.nonfinite == "propagate":
            return present
        bad = [n for (n, _), g in zip(self.named, grads) if not bool(all_finite(g))]
        if bad and self.engine.nonfinite == "raise":
            raise nonfinite_gradient_error(bad, f"{self.name} step {self.t}")
        return None if bad else present

    @torch.no_grad()
    def _moments(self, grads: list[torch.Tensor], update_v: bool, present: list[bool]) -> None:
        """``m <- b1 m + (1 - b1) g`` (and ``v <- b2 v + (1 - b2) g^2`` when
        ``update_v``, counted in ``v_steps``), with Adam's L2 term ``g + wd
        p`` unless decoupled; only the parameters ``present`` says."""
        for i, (g, (_, p)) in enumerate(zip(grads, self.named)):
            if not present[i]:
                continue
            _, b1, b2, _, wd, decoupled = self._hyper(i)
            if wd and not decoupled:
                g = g.add(p, alpha=wd)
            self.exp_avg[i].lerp_(g, 1 - b1)
            if update_v:
                self.exp_avg_sq[i].mul_(b2).addcmul_(g, g, value=1 - b2)
                self.v_steps[i] += 1

    def _denom(self, i: int) -> torch.Tensor:
        """``sqrt(v / (1 - b2^s)) + eps`` of parameter ``i`` (a fresh tensor)."""
        _, _, b2, eps, _, _ = self._hyper(i)
        s = self.v_steps[i]
        bc2 = 1 - b2 ** s if self.bias_correction and s else 1.0  # type: ignore[attr-defined]
        return (self.exp_avg_sq[i].sqrt() / bc2 ** 0.5).add_(eps)

    def _bc1(self, i: int) -> float:
        b1 = self._hyper(i)[1]
        return 1 - b1 ** self.steps[i] if self.bias_correction else 1.0  # type: ignore[attr-defined]

    @torch.no_grad()
    def _apply(self, present: list[bool], count: list[bool] | None = None) -> None:
        """The Adam update of the parameters ``present`` says (torch's order:
        decay, then the step); ``steps`` counts one for those ``count`` says
        (default: ``present``), before the update, as torch does."""
        for i, c in enumerate(present if count is None else count):
            self.steps[i] += int(c)
        for i, (_, p) in enumerate(self.named):
            if not present[i]:
                continue
            lr, _, _, _, wd, decoupled = self._hyper(i)
            if wd and decoupled:
                p.mul_(1 - lr * wd)
            p.addcdiv_(self.exp_avg[i], self._denom(i), value=-lr / self._bc1(i))

    @torch.no_grad()
    def _mask_unseen(self, tensors: list[torch.Tensor], idx: list[int] | None = None) -> None:
        """Zero ``tensors`` where ``v == 0``: coordinates whose gradient has
        always been exactly 0 (embedding rows of tokens never seen). One bit
        cannot say 0, so a compressed exchange gives them +-scale, and with
        ``v = 0`` Adam would step them by ``lr * scale / eps``. The automatic
        form of DeepSpeed's user-given ``exp_avg_mask``; a no-op without
        compression (their momentum is exactly 0 then). ``idx``: the
        parameters ``tensors`` belong to (default: all, in order)."""
        for t, i in zip(tensors, range(len(tensors)) if idx is None else idx):
            t.masked_fill_(self.exp_avg_sq[i] == 0, 0.0)

    def _begin_step(self) -> None:
        self.t += 1
        self._steps += 1
        self._reset_last()

    def _overflowed(self, bad: torch.Tensor | None) -> bool:
        """With a loss scaler (:mod:`gradpress.algorithms.loss_scale`): ``bad``, an exchange's verdict (the
        same on every rank: the exact sums', or the engine's ``StepGuard.last_bad``), becomes the scaler's
        found-inf flag; whether every rank skips the step. False without a scaler."""
        if self.loss_scale is None:
            return False
        self.loss_scale.agree(bad)
        return self.loss_scale.found_inf()

    def _scaled_end(self) -> None:
        """``scaler.update()`` at the end of every step with a loss scaler: these classes step the parameters
        themselves (the scaler's ``step`` would run torch's Adam), so their skips are the scaler's."""
        if self.loss_scale is not None:
            self.loss_scale.update()

    # ------------------------------------------------------------ reporting
    @property
    def stats(self) -> dict[str, Any]:
        out = super().stats
        out["exchanges"] = self._exchanges  # exact (plain) averages count too
        return out

    # ---------------------------------------------------------------- state
    def extra_state(self) -> dict[str, Any]:
        return {"exp_avg": [m.clone() for m in self.exp_avg], "exp_avg_sq": [v.clone() for v in self.exp_avg_sq],
                "t": self.t, "steps": list(self.steps), "v_steps": list(self.v_steps), "phase": self.phase_state()}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        for field in ("exp_avg", "exp_avg_sq"):
            saved = state.get(field)
            if saved is None or len(saved) != len(self.named):
                raise ValueError(f"{self.name} state: {field!r} missing or of another model "
                                 f"(expected {len(self.named)} tensors)")
            for (name, p), s in zip(self.named, saved):
                if tuple(s.shape) != tuple(p.shape):
                    raise ValueError(f"{self.name} state: {field!r} of {name!r} has shape {tuple(s.shape)}, "
                                     f"the model's is {tuple(p.shape)}")
            setattr(self, field, [s.to(p.device, p.dtype).clone() for (_, p), s in zip(self.named, saved)])
        self.t = int(state["t"])
        n = len(self.named)
        # a state saved before per-parameter counts held one count for every parameter
        steps, v_steps = state.get("steps", self.t), state["v_steps"]
        for field, value in (("steps", steps), ("v_steps", v_steps)):
            counts = [int(value)] * n if isinstance(value, (int, float)) else [int(c) for c in value]
            if len(counts) != n:
                raise ValueError(f"{self.name} state: {field!r} has {len(counts)} counts, the model has {n} "
                                 "parameters")
            setattr(self, field, counts)
        self.load_phase_state(state.get("phase", {}))

    def phase_state(self) -> dict[str, Any]:
        """The subclass's own counters (freeze step, intervals...)."""
        return {}

    def load_phase_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`phase_state`."""
