"""The DDP comm hook: bucket -> keyed views -> exchange engine -> Future.

Modelled on ``torch.distributed.algorithms.ddp_comm_hooks`` (a small hook
function plus an explicit state object). The hook hands each bucket to a
single communication thread (:mod:`gradpress.ddp.comm_thread`) and returns a
``torch.futures.Future`` that the thread completes. Because DDP calls the hook for buckets in the same order on
every rank and the thread works through them first-in first-out, every rank
issues its collectives in the same order even with several buckets and
multi-round protocols (PyTorch's own PowerSGD hook mixes them up on gloo).

Coalescing (``coalesce``; default: on for multi-round compressors such as
PowerSGD and when a strategy the plan uses pipelines a call with the
compressor, ``hierarchical:chunk=N`` with a one-round compressor between
several hosts' leaders by allreduce or allgather):
the thread holds a step's buckets until DDP hands it the last one, then
averages them in one engine call, so each round of the protocol is
one collective for the whole step (PowerSGD: one allreduce of every bucket's
P with the plain tensors and NaN flags, one of every Q) instead of one per
bucket and round. Every round costs a latency that is paid once per step
instead of once per bucket; what is lost is starting the first buckets'
exchange while backward still computes the others. DDP waits for the
buckets' Futures only when backward ends, so holding them is allowed.

All the exchange work (plan, error feedback, NaN protocol, stats, state) is
the engine's (:class:`gradpress.exchange.Synchronizer`); this module only
turns a ``GradBucket`` into keyed views (in each parameter's own layout) and
keeps the step count. Bound to a DDP model with ``find_unused_parameters`` or
``static_graph``, it also tells the engine which parameters got a gradient
(:mod:`gradpress.ddp.buckets`): one no rank used is not sent. State is
keyed by parameter name (stable across DDP's bucket rebuild after the first
iteration; a wrapper's ``module.`` prefix dropped only when every name has
it), never by ``bucket.index()``.

A hook state is *bound* once it has its engine. ``make_hook(spec, model)``
and ``register`` bind at once (collective); ``make_hook(spec)`` returns an
unbound state, for frameworks that take the hook before the model is
wrapped (Lightning's ``DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)``):
it binds on :meth:`GradpressHook.bind` (keys: parameter names), or else by
itself when the first backward has handed it every bucket (keys:
``param{i}`` in the order of that first step's buckets, the same on every
rank and in every run of the same model). A state loaded while unbound is
applied when it binds (the state dict itself: :mod:`gradpress.ddp.hook_state`);
one that does not load then, on any rank, fails the binding on every rank and
leaves the hook unbound with that state still pending.

Invariant: every bucket DDP hands over is queued, in DDP's order, with the
keys of its parameters and the step of its backward (the step moves once per
backward, at its last bucket); a bound state's keys never change.
"""

from __future__ import annotations

import functools
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

import gradpress.ddp.hook_state as hook_state
from gradpress.ddp.buckets import SPARSE_BUCKET, Job, UnusedWatch, UsedTracker, param_layout, sparse_refusal
from gradpress.ddp.comm_thread import CLOSE_WAIT_S, CommThread
from gradpress.ddp.loss_scale import LossScale, check_attach, check_engine
from gradpress.ddp.state_format import HOOK_FORMAT, strip_module
from gradpress.exchange import Synchronizer
from gradpress.exchange.feedback import Feedback
from gradpress.exchange.planner import Plan
from gradpress.transport.groups import EXIT_STEPS

__all__ = ["GradpressHook", "gradpress_hook", "HOOK_FORMAT"]

#: builds the engine for these (name, parameter) pairs, the hook following a loss scaler or not (part of what
#: the ranks agree on); collective (own group, agreement, plan)
Builder = Callable[[Sequence[tuple[str, torch.nn.Parameter]], bool], Synchronizer]


class GradpressHook:
    """State of the gradpress comm hook; returned by ``register`` and
    ``make_hook``.

    Attributes: ``engine`` (the exchange engine; ``RuntimeError`` while
    not ``bound``), and through it ``compressor``, ``strategy_name``, ``error_feedback``,
    ``plan``, ``memory`` (the residuals), ``stats`` (see ``STATS_KEYS``).
    ``build`` makes the engine for a list of (name, parameter); ``model``:
    bind now (collective). ``coalesce``: average a step's buckets in one
    engine call when the last arrives (see the module doc); None: when the
    compressor has several rounds. Every rank must use the same setting.
    ``nonfinite``: the mode the engine will be built with, known before binding (``make_hook`` gives it), so
    that a scaler attached before binding is refused at once with ``skip``/``raise``.
    """

    def __init__(self, build: Builder, model: torch.nn.Module | None = None, coalesce: bool | None = None,
                 nonfinite: str | None = None) -> None:
        if coalesce is not None and not isinstance(coalesce, bool):
            raise ValueError(f"coalesce must be True, False or None (on for multi-round compressors), got {coalesce!r}")
        self._build = build
        self._coalesce = coalesce
        self._engine: Synchronizer | None = None
        self._names: dict[int, str] = {}
        self._step = 0  # hook-side step (main thread)
        self._unbound_jobs: list[Job] = []  # buckets of the first backward of a state not bound yet
        self._pending_state: Mapping[str, Any] | None = None  # loaded before binding
        self._used: UsedTracker | None = None  # with DDP's find_unused_parameters / static_graph
        self._watch = UnusedWatch()  # without the DDP model's options: warns once of an unused parameter
        self._scale = LossScale()  # the attached loss scaler and the scale the state is kept in (loss_scale.py)
        self._nonfinite = nonfinite  # the engine's mode before it is built (None: not known)
        self._started = False  # a bucket was handed over: attaching or detaching a scaler is refused from then on
        self._comm = CommThread(self)  # averages the queued buckets in order (comm_thread.py)
        self._thread = self._comm.thread
        _OPEN_HOOKS.add(self)
        if model is not None:
            self.bind(model)

    # ------------------------------------------------------------- binding
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

    # --------------------------------------------------------------- views
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

    # ------------------------------------------------------------------ hook
    def submit(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Queue ``bucket`` for the communication thread; return its Future.
        An unbound state keeps the buckets of the first backward and binds
        when the last one arrives (every bucket then seen: every parameter)."""
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._started = True
        buffer = bucket.buffer()
        if buffer.is_sparse:
            raise ValueError(SPARSE_BUCKET)
        params = list(bucket.parameters())
        event = None
        if buffer.is_cuda:
            event = torch.cuda.Event()
            event.record()
        is_last = bucket.is_last()
        grads = [param_layout(g, p) for g, p in zip(bucket.gradients(), params)]
        used = self._used.take(params) if self._used is not None else None
        job = Job(buffer, grads, None, params, self._step, is_last, future, event, used)
        if is_last:
            self._step += 1
            # runs when backward ends, after DDP's own finalization (queued before, at its first bucket)
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._raise_deferred, future))
        if self._engine is None:
            self._unbound_jobs.append(job)
            if is_last:
                self._bind_from_buckets()
            return future
        self._enqueue(job)
        return future

    def _enqueue(self, job: Job) -> None:
        job.keys = [self._names.get(id(p), f"param{i}") for i, p in enumerate(job.params)]
        if job.used is None and (message := self._watch.check(job, self.engine.plan.decisions)) is not None:
            warnings.warn(message, stacklevel=2)
        self._comm.put(job)

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

    def _raise_deferred(self, last: torch.futures.Future[torch.Tensor]) -> None:
        """Re-raise a ``nonfinite='raise'`` error as the documented
        ``FloatingPointError`` from ``loss.backward()`` (DDP would turn an
        exception of the hook's Future into a ``RuntimeError``)."""
        last.wait()
        error = self._comm.take_deferred()
        if error is not None:
            raise error

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """All compression state: the engine's (config, residuals, compressor
        and strategy state, plan, stats), the hook's step and the loss scale the
        state is kept in (``loss_scale``, None without a scaler). Unbound: the
        state loaded and not yet applied, if any."""
        if self._engine is None and self._pending_state is not None:
            return dict(self._pending_state)
        return hook_state.save(self.engine, self._step, self._scale.kept)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict` (also one written before the exchange engine, ``gradpress-hook/1``, or before
        gradients had their parameter's layout: ``upgrade_layout``). Refuses another configuration's state (compressor,
        strategy, world size, parameters...); an unbound state keeps it (format checked) and loads it as it binds
        (refused there: ``ValueError`` from the binding, the hook still unbound with the state kept)."""
        if self._engine is None:
            hook_state.check_format(state)
            self._pending_state = state
            return
        self._step, kept = hook_state.load(self.engine, self._by_name, state)
        self._scale.restore(kept)

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Stop the communication thread once its queued buckets are averaged, waiting at most ``timeout``
        seconds (the hook must not be used after). Called at interpreter exit for every hook still open."""
        self._comm.stop(timeout=timeout)
        if self._used is not None:
            self._used.close()
        self._watch.start(None, 0)
        _OPEN_HOOKS.discard(self)


_OPEN_HOOKS: weakref.WeakSet[GradpressHook] = weakref.WeakSet()


def _close_open_hooks() -> bool:
    """At interpreter exit (a step of :data:`gradpress.transport.groups.EXIT_STEPS`, before the groups go):
    close every hook still open; whether all their threads ended. One deadline, :data:`CLOSE_WAIT_S` from now,
    for all of them (as the background threads' :data:`gradpress.exchange.background.EXIT_WAIT_S`): every
    thread is told to stop first, so their queued buckets finish side by side, then each is waited for what is
    left of it; several hooks stuck on one peer hold the exit that long once, not once per hook."""
    hooks = list(_OPEN_HOOKS)
    deadline = time.monotonic() + CLOSE_WAIT_S
    for hook in hooks:
        hook._comm.request_stop()
    for hook in hooks:
        hook.close(timeout=deadline - time.monotonic())
    return not any(hook._thread.is_alive() for hook in hooks)


EXIT_STEPS.append(_close_open_hooks)


def gradpress_hook(state, bucket):  # noqa: ANN001,ANN201 - DDP inspects these annotations; leave them off
    """The DDP comm hook function; ``state`` is the :class:`GradpressHook`."""
    return state.submit(bucket)
