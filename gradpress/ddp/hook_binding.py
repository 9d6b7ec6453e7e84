"""The binding of the gradpress DDP comm hook's state
(:class:`~gradpress.ddp.hook.GradpressHook`) to a model: its engine built
for the model's parameters, keyed by name (``bind``), or, for a state made
before the model was wrapped, by ``param{i}`` from the buckets of the first
backward (``_bind_from_buckets``); a state loaded while unbound restored
into the new engine (:mod:`gradpress.ddp.hook_state`).

:class:`HookBinding` is a mixin of :class:`~gradpress.ddp.hook.GradpressHook`
(which sets the attributes declared below), kept apart from its views
(:mod:`gradpress.ddp.hook_views`) and its bucket path so that each module
stays short.

Invariants: binding is collective (every rank builds the engine and agrees
on it and on the scaler); a bound state's keys never change (binding again
to the same parameters does nothing, to others raises); a refusal leaves
the hook unbound with its pending state, the built engine dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

import gradpress.ddp.hook_state as hook_state
from gradpress.ddp.buckets import Job, UnusedWatch, UsedTracker, sparse_refusal
from gradpress.ddp.loss_scale import LossScale, check_engine
from gradpress.ddp.state_format import strip_module
from gradpress.exchange import Synchronizer

__all__ = ["Builder", "HookBinding"]

#: builds the engine for these (name, parameter) pairs, the hook following a loss scaler or not (part of what
#: the ranks agree on); collective (own group, agreement, plan)
Builder = Callable[[Sequence[tuple[str, torch.nn.Parameter]], bool], Synchronizer]


class HookBinding:
    """The binding of :class:`~gradpress.ddp.hook.GradpressHook` (a mixin:
    the attributes below are set by its ``__init__``)."""

    _build: Builder
    _engine: Synchronizer | None
    _names: dict[int, str]
    _by_name: dict[str, torch.nn.Parameter]
    _step: int
    _unbound_jobs: list[Job]
    _pending_state: Mapping[str, Any] | None
    _used: UsedTracker | None
    _watch: UnusedWatch
    _scale: LossScale
    #: the bucket path's (GradpressHook): keys the job and queues it for the communication thread
    _enqueue: Callable[[Job], None]

    @property
    def bound(self) -> bool:
        return self._engine is not None

    @property
    def engine(self) -> Synchronizer:
        if self._engine is None:
            raise RuntimeError("this gradpress hook state is not bound to a model yet: it binds at the first "
                               "backward, or call state.bind(model) (the Lightning/Accelerate integrations do)")
        return self._engine

    def bind(self, model: torch.nn.Module) -> None:
        """Build the engine for ``model``'s parameters (a DDP wrapper's
        ``module.`` prefix is dropped). Collective: every rank calls it, before
        the first backward. Binding again to the same parameters does nothing;
        to others raises ``ValueError``. Given the DDP model, it reads
        ``find_unused_parameters`` and ``static_graph`` (module doc)."""
        track, is_ddp = False, isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if is_ddp:
            track = bool(getattr(model, "find_unused_parameters", False) or getattr(model, "static_graph", False))
            model = model.module
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if (refusal := sparse_refusal(model)) is not None:
            raise ValueError(refusal)
        pairs = list(model.named_parameters())
        named = list(zip(strip_module([n for n, _ in pairs]), [p for _, p in pairs], strict=True))
        if self._engine is not None:
            if {id(p): n for n, p in named} != self._names:
                raise ValueError("this gradpress hook state is already bound to another model's parameters; "
                                 "make one state per model")
        else:
            self._bind_named(named)
        if track and self._used is None:  # a parameter no rank used is then not sent (engine.sync's used=)
            self._used = UsedTracker([p for _, p in named if p.requires_grad])
        self._watch.start(None if is_ddp or self._used is not None else [p for _, p in named], self._step)

    def _bind_named(self, named: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        """Build the engine and restore the state loaded before binding into it, then bind. Any refusal
        (the scaler's, or the pending state not loading on some rank: agreed, every rank raises alike)
        leaves the hook unbound with its pending state, the built engine dropped."""
        engine = self._build(named, self._scale.scaler is not None)  # the ranks agree on the scaler too
        if self._scale.scaler is not None:
            check_engine(engine)  # refused: the hook stays unbound
        by_name = dict(named)
        restored = hook_state.load_pending(engine, by_name, self._pending_state)  # collective, pending or not
        self._engine, self._names, self._by_name = engine, {id(p): n for n, p in named}, by_name
        self._pending_state = None
        if restored is not None:
            self._step, kept = restored
            self._scale.restore(kept)

    def _bind_from_buckets(self) -> None:
        jobs, self._unbound_jobs = self._unbound_jobs, []
        named = [(f"param{i}", p) for i, p in enumerate(p for job in jobs for p in job.params)]
        restoring = self._pending_state is not None
        try:
            self._bind_named(named)
        except BaseException as exc:
            for job in jobs[:-1]:
                job.future.set_exception(exc)
            raise
        if restoring:  # this backward is the first step after the restored one
            for job in jobs:
                job.step = self._step
            self._step += 1
        self._watch.start([p for _, p in named], self._step)  # its later steps (this one: by None .grads)
        for job in jobs:
            self._enqueue(job)
