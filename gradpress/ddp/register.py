"""``gradpress.ddp.register(ddp_model, "topk:ratio=0.01")`` and
``state, hook = gradpress.ddp.make_hook(spec)`` (PyTorch's hook/state
convention: ``ddp_model.register_comm_hook(state, hook)``, Lightning's
``DDPStrategy(ddp_comm_hook=hook, ddp_comm_state=state)``).

One implementation behind both: :func:`register` is :func:`make_hook`
bound to the DDP model's module, then registered. Binding builds the engine
on gradpress's own process group, checks that every rank asked for the same
thing (a mismatch raises ``ValueError`` on every rank), and plans.
"""

from __future__ import annotations

import datetime
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradpress.compress import Compressor, create
from gradpress.ddp.hook import GradpressHook, gradpress_hook
from gradpress.ddp.loss_scale import EVERY_RANK, check_feedback, check_mode, check_scaler
from gradpress.exchange import Synchronizer
from gradpress.exchange.agree import agree
from gradpress.exchange.costs import CostModel
from gradpress.exchange.planner import log_plan
from gradpress.transport.groups import own_group

__all__ = ["register", "make_hook"]

Hook = Callable[[GradpressHook, dist.GradBucket], torch.futures.Future]


def _build(make_compressor: Callable[[], Compressor], process_group: dist.ProcessGroup | None,
           timeout: float | datetime.timedelta | None, options: dict[str, Any],
           named: Sequence[tuple[str, torch.nn.Parameter]], scaled: bool = False) -> Synchronizer:
    """The engine for ``named`` on a group of gradpress's own over the ranks
    of ``process_group`` (default: the world), for a hook that follows a loss
    scaler (``scaled``) or not. Collective; every rank either returns an
    engine of the same configuration (a scaler on every rank or on none) or
    raises ``ValueError``."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call dist.init_process_group first (torchrun does)")
    group, error = own_group(process_group, timeout)
    engine: Synchronizer | None = None
    try:
        if error is not None:
            raise ValueError(error)
        if scaled:
            check_mode(options["nonfinite"])
        engine = Synchronizer(make_compressor(), params=[(n, p.shape, p.dtype) for n, p in named if p.requires_grad],
                              group=group, **options)
    except Exception as exc:  # noqa: BLE001 - every rank must reach agree(), or the others hang
        error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    # whether a loss scaler is attached is agreed here (not part of engine.config(): that is also a checkpoint's)
    agree({**engine.config(), "scaler": scaled} if engine is not None else None, error, group,
          hints={"scaler": f"scaler: True where a loss scaler is attached (register(scaler=), attach_scaler); "
                           f"{EVERY_RANK}"})
    assert engine is not None
    if engine.strategy_name == "auto" and options.get("plan_costs") is None:
        engine.replan()  # collective: every rank measures together, rank 0 fits
    else:
        log_plan(engine.plan, engine.rank)
    return engine


def make_hook(
    spec: str | Compressor = "none",
    model: torch.nn.Module | None = None,
    *,
    error_feedback: bool | None = None,
    strategy: str = "collective",
    min_numel: int = 1024,
    seed: int = 0,
    process_group: dist.ProcessGroup | None = None,
    plan_costs: CostModel | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    nonfinite: str = "propagate",
    timeout: float | datetime.timedelta | None = None,
    coalesce: bool | None = None,
    scaler: Any = None,
    **params: Any,
) -> tuple[GradpressHook, Hook]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    Arguments as :func:`register`. ``model`` (the module or its DDP wrapper):
    bind now, a collective call on every rank (needs the process group).
    Without it nothing collective happens here (``spec`` is checked at once)
    and the state binds later: at ``state.bind(model)`` (what the Lightning
    and Accelerate integrations call; keys are parameter names) or by itself
    at the first backward (keys ``param{i}``). ``process_group``: the ranks
    to average over (default: those of ``model`` when it is a DDP wrapper,
    else the world)."""
    check_scaler(scaler)  # before anything collective: every rank refuses alike
    if scaler is not None:
        check_mode(nonfinite)
    if process_group is None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        process_group = model.process_group
    options = {"error_feedback": error_feedback, "strategy": strategy, "min_numel": min_numel, "seed": seed,
               "plan_costs": plan_costs, "nonfinite": nonfinite}
    if model is None:
        compressor = create(spec, **params)  # a bad spec fails here, before any process starts training
        if scaler is not None:
            check_feedback(compressor, compressor.default_error_feedback if error_feedback is None else error_feedback)
        make_compressor: Callable[[], Compressor] = lambda: compressor  # noqa: E731
    else:
        make_compressor = functools.partial(create, spec, **params)  # inside the agreement: every rank reports
    state = GradpressHook(functools.partial(_build, make_compressor, process_group, timeout, options),
                          coalesce=coalesce, nonfinite=nonfinite)
    state.attach_scaler(scaler)
    if model is not None:
        try:
            state.bind(model)
        except BaseException:
            state.close()
            raise
    return state, gradpress_hook


def register(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    spec: str | Compressor = "none",
    *,
    error_feedback: bool | None = None,
    strategy: str = "collective",
    min_numel: int = 1024,
    seed: int = 0,
    process_group: dist.ProcessGroup | None = None,
    plan_costs: CostModel | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    nonfinite: str = "propagate",
    timeout: float | datetime.timedelta | None = None,
    coalesce: bool | None = None,
    scaler: Any = None,
    **params: Any,
) -> GradpressHook:
    """Register the gradpress comm hook on ``ddp_model`` and return its handle.

    ``spec``: a compressor spec (``"topk:ratio=0.01"``) or instance; extra
    keywords are compressor parameters. ``error_feedback``: None uses the
    compressor's default (on for biased methods). ``strategy``:
    ``collective`` (the default: the named compressor on every eligible
    tensor, by allreduce when its packets are summable, else allgather), a
    name from ``gradpress.exchange.available()`` forced for every eligible
    tensor, or ``auto`` (opt-in: a per-tensor plan from a cost model measured
    on the live group, see :mod:`gradpress.exchange.planner`;
    ``handle.plan.table()`` shows it; it may keep tensors dense when
    compression does not pay on this network).
    ``plan_costs``: inject the cost model for ``auto`` instead of measuring
    (a :class:`~gradpress.exchange.costs.CostModel`, a mapping of its
    fields to ``(overhead, a, b)``, or the path of a file written by
    ``gradpress bench plan``): the same inputs then give the same plan. Tensors with fewer than ``min_numel``
    elements and 1-D tensors go through one fused plain allreduce. ``seed``
    derives shared randomness. Every rank must call this with the same
    arguments: a mismatch raises ``ValueError`` on every rank.
    ``nonfinite``: what to do when a rank's gradient has a NaN/Inf, one of
    ``NONFINITE_MODES``. ``timeout``: seconds (or a timedelta) after which a
    collective that a dead or stuck peer never joins fails with an error
    instead of hanging; default: the timeout of the DDP model's process group.
    ``coalesce``: hold a step's buckets until DDP hands over the last one and
    average them in one call (each protocol round one collective per step,
    not per bucket); None (default): on for multi-round compressors
    (PowerSGD) and when a strategy the plan uses pipelines the call
    (``hierarchical`` with ``chunk`` > 0, a one-round compressor and
    allreduce/allgather between several hosts), off otherwise. Every rank
    must pass the same value.
    ``scaler``: the ``torch.amp.GradScaler`` of fp16 autocast (each rank its
    own): the residuals, kept in the scale of their step, follow its scale
    (read once per step). Every rank gives one or none does; it cannot be
    attached to or detached from the registered (bound) hook afterwards:
    :meth:`GradpressHook.attach_scaler` is for a ``make_hook(spec)`` state
    before it binds. Needs ``nonfinite='propagate'``.
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(f"ddp_model must be torch.nn.parallel.DistributedDataParallel, got {type(ddp_model).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call dist.init_process_group first (torchrun does)")
    state, hook = make_hook(
        spec, ddp_model, error_feedback=error_feedback, strategy=strategy, min_numel=min_numel, seed=seed,
        process_group=process_group if process_group is not None else ddp_model.process_group,
        plan_costs=plan_costs, nonfinite=nonfinite, timeout=timeout, coalesce=coalesce, scaler=scaler, **params)
    ddp_model.register_comm_hook(state, hook)
    return state
