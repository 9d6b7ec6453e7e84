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

Modules of the hook state, one job each: this one (construction, the bucket
path, the state dict, closing), its binding (:mod:`gradpress.ddp.hook_binding`),
its read-only views and loss-scaler interface (:mod:`gradpress.ddp.hook_views`).
"""

from __future__ import annotations

import functools
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

import gradpress.ddp.hook_state as hook_state
from gradpress.ddp.buckets import SPARSE_BUCKET, Job, UnusedWatch, UsedTracker, param_layout
from gradpress.ddp.comm_thread import CLOSE_WAIT_S, CommThread
from gradpress.ddp.hook_binding import Builder, HookBinding
from gradpress.ddp.hook_views import HookViews
from gradpress.ddp.loss_scale import LossScale
from gradpress.ddp.state_format import HOOK_FORMAT
from gradpress.exchange import Synchronizer
from gradpress.transport.groups import EXIT_STEPS

__all__ = ["GradpressHook", "gradpress_hook", "HOOK_FORMAT"]


class GradpressHook(HookBinding, HookViews):
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
