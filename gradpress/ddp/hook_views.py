"""The read-only views and the loss-scaler interface of the gradpress DDP
comm hook's state (:class:`~gradpress.ddp.hook.GradpressHook`).

:class:`HookViews` is a mixin of :class:`~gradpress.ddp.hook.GradpressHook`
(which sets the attributes declared below), kept apart from its binding
(:mod:`gradpress.ddp.hook_binding`) and its bucket path so that each module
stays short: what the engine is configured with and has counted (``plan``,
``stats``, ``memory``...), whether a step's buckets are coalesced, and the
attached loss scaler (:mod:`gradpress.ddp.loss_scale` does the arithmetic).

Invariant: every view reads the bound engine (``RuntimeError`` while the
state is unbound) except ``nonfinite``, ``step``, ``scaler`` and
``loss_scale``, which the hook keeps itself; a scaler is attached or
detached only before the hook binds or hands over a bucket.
"""

from __future__ import annotations

from typing import Any

from gradpress.ddp.loss_scale import LossScale, check_attach
from gradpress.exchange import Synchronizer
from gradpress.exchange.feedback import Feedback
from gradpress.exchange.planner import Plan

__all__ = ["HookViews"]


class HookViews:
    """Views and the loss scaler of :class:`~gradpress.ddp.hook.GradpressHook`
    (a mixin: the attributes below are set by its ``__init__`` and binding)."""

    engine: Synchronizer
    _engine: Synchronizer | None
    _coalesce: bool | None
    _nonfinite: str | None
    _step: int
    _scale: LossScale
    _started: bool

    compressor = property(lambda self: self.engine.compressor)
    error_feedback = property(lambda self: self.engine.error_feedback)
    strategy_name = property(lambda self: self.engine.strategy_name)
    strategies = property(lambda self: self.engine.strategies)
    cost_model = property(lambda self: self.engine.cost_model)
    rank = property(lambda self: self.engine.rank)
    world_size = property(lambda self: self.engine.world_size)
    group = property(lambda self: self.engine.group)  # gradpress's own process group

    @property
    def nonfinite(self) -> str | None:
        """The NaN/Inf mode (the engine's; before binding the one given at construction, None if none was)."""
        return self._engine.nonfinite if self._engine is not None else self._nonfinite

    @property
    def memory(self) -> Feedback:
        """The error-feedback store (every residual, by key)."""
        return self.engine.feedback

    @property
    def plan(self) -> Plan:
        return self.engine.plan

    @property
    def stats(self) -> dict[str, Any]:
        """A plain mapping; see ``STATS_KEYS`` for every key."""
        return self.engine.stats

    @property
    def last_step_skipped(self) -> bool:
        """True when the last completed step was dropped on every rank
        (``nonfinite='skip'``): do not call ``optimizer.step()`` then."""
        return self.engine.last_step_skipped

    @property
    def step(self) -> int:
        return self._step

    @property
    def coalescing(self) -> bool:
        """Whether a step's buckets are averaged in one engine call (default:
        for multi-round compressors, and when a strategy the plan uses
        pipelines a call with the compressor, ``Strategy.pipelines``)."""
        if self._coalesce is not None:
            return self._coalesce
        engine = self.engine
        if engine.compressor.rounds > 1:
            return True
        used = {d.strategy for d in engine.plan.decisions.values() if d.compressed}
        return any(engine.strategies[name].pipelines(engine.compressor) for name in used if name in engine.strategies)

    def attach_scaler(self, scaler: Any) -> None:
        """Follow ``scaler``'s loss scale (a ``torch.amp.GradScaler``, or any object with ``get_scale()``;
        None detaches): once per step, before its first bucket is averaged, the scale is read and every
        residual and compressor buffer in the gradient's units is multiplied by new/old, so a scale change
        (growth, the back-off after an overflow) is not fed back off by that factor. Every rank attaches
        its own scaler, before the hook binds (``make_hook(spec)``, then ``bind``; or give it to ``register``):
        every rank or none, agreed at binding; after it, attaching or detaching raises ``ValueError``, as no
        other rank could learn of it without a collective (replacing one scaler by another does not). Needs ``nonfinite='propagate'`` (``ValueError`` otherwise). A scale-free compressor's averages
        (``scale_degree == 0``: signsgd, signum) are multiplied by the step's scale; error feedback on one is refused.
        The scale is in every encode Context (``loss_scale``): ``threshold``'s ``tau`` and DGC's ``clip`` apply to the
        unscaled gradient.
        On CUDA the read (``get_scale()``) syncs the communication thread, not the training thread."""
        check_attach(scaler, self._scale.scaler, self._started or self._engine is not None, self._engine,
                     self.nonfinite)
        self._scale.scaler = scaler

    @property
    def scaler(self) -> Any:
        """The attached loss scaler (None: none)."""
        return self._scale.scaler

    @property
    def loss_scale(self) -> float | None:
        """The loss scale the residuals are kept in (that of the last step's backward; None before a step
        with a scaler attached)."""
        return self._scale.kept

    def follow_scale(self, step: int) -> None:
        """At the first bucket of ``step`` (the communication thread): bring the state into the scaler's
        current scale (:class:`~gradpress.ddp.loss_scale.LossScale`). Nothing without a scaler."""
        self._scale.follow(self.engine, step)

    def replan(self, costs: Any = None) -> Plan:
        """Measure the group (or use ``costs``) and rebuild the plan.
        Collective: call on every rank, between steps (no bucket in flight)."""
        return self.engine.replan(costs)

    def config(self) -> dict[str, Any]:
        return self.engine.config()

    def memory_bytes(self) -> dict[str, int]:
        return self.engine.memory_bytes()
