"""``gradpress.ddp.register(ddp_model, "topk:ratio=0.01")``: build the hook on
gradpress's own process group, check that every rank asked for the same
thing, plan, and register it with DDP."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from gradpress.compress import Compressor, create
from gradpress.ddp.hook import GradpressHook, gradpress_hook
from gradpress.exchange.agree import agree
from gradpress.exchange.costs import CostModel
from gradpress.exchange.planner import log_plan
from gradpress.transport.groups import own_group

__all__ = ["register"]


def register(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    spec: str | Compressor = "none",
    *,
    error_feedback: bool | None = None,
    strategy: str = "collective",
    min_numel: int = 1024,
    seed: int = 0,
    process_group: dist.ProcessGroup | None = None,
    plan_costs: CostModel | Mapping[str, Any] | None = None,
    nonfinite: str = "propagate",
    timeout: float | datetime.timedelta | None = None,
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
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(f"ddp_model must be torch.nn.parallel.DistributedDataParallel, got {type(ddp_model).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call dist.init_process_group first (torchrun does)")
    group, error = own_group(process_group if process_group is not None else ddp_model.process_group, timeout)
    hook: GradpressHook | None = None
    try:
        if error is not None:
            raise ValueError(error)
        hook = GradpressHook(
            ddp_model.module, create(spec, **params), process_group=group, error_feedback=error_feedback,
            strategy=strategy, min_numel=min_numel, seed=seed, plan_costs=plan_costs, nonfinite=nonfinite,
        )
    except Exception as exc:  # noqa: BLE001 - every rank must reach agree(), or the others hang
        error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    try:
        agree(hook.config() if hook is not None else None, error, group)
    except ValueError:
        if hook is not None:
            hook.close()
        raise
    assert hook is not None
    if hook.strategy_name == "auto" and plan_costs is None:
        hook.replan()  # collective: every rank measures together, rank 0 fits
    else:
        log_plan(hook.plan, hook.rank)
    ddp_model.register_comm_hook(hook, gradpress_hook)
    return hook
