"""Every field of a :class:`~gradpress.train.config.TrainConfig` checked
and completed (:func:`validate`, which :func:`~gradpress.train.config.make_config`
calls on the merged options): the workload and its defaults, the numbers,
the exchange (algorithm, compressor resolved to the algorithm's default,
strategy, host layout, error feedback, NaN/Inf mode, plan costs), the precision
(:mod:`gradpress.train.precision`), then the device, flags, output, data split, TensorBoard directory and data file.

Invariant: whatever a worker would refuse is refused here, before any
worker starts, with a ``ValueError`` that names the field, the value and
what is allowed (the rules shared by every command: :mod:`gradpress.train.checks`).
"""

from __future__ import annotations

import inspect
import math
import os
from typing import TYPE_CHECKING

import torch

import gradpress.train.algorithm as algorithms
from gradpress import workloads
from gradpress.compress.spec import spelled_as
from gradpress.train.checks import _choice, _int, check_nproc, check_out, check_seed, planned_world
from gradpress.train.optim import OPTIMIZERS, SCHEDULES

if TYPE_CHECKING:
    from gradpress.train.config import TrainConfig

__all__ = ["NONFINITE", "validate"]

#: what a step does when a rank's gradient has a NaN/Inf (``gradpress.ddp.NONFINITE_MODES``)
NONFINITE = ("propagate", "skip", "raise")


def _validate_workload(cfg: TrainConfig) -> None:
    if cfg.data is not None:
        if cfg.workload not in (None, "data-mlp"):
            raise ValueError(f"data: --data trains the 'data-mlp' workload, but workload={cfg.workload!r} was given")
        cfg.workload = "data-mlp"
        if not isinstance(cfg.data, (str, os.PathLike)):
            raise ValueError(f"data must be a path to a .npz file, got {cfg.data!r}")
        cfg.data = str(cfg.data)
    if cfg.workload is None:
        cfg.workload = workloads.DEFAULT
    if not isinstance(cfg.workload, str) or cfg.workload not in workloads.names():
        raise ValueError(f"unknown workload {cfg.workload!r}{spelled_as(cfg.workload, workloads.names())}; "
                         f"allowed: {', '.join(workloads.names())}")
    if cfg.workload == "data-mlp" and cfg.data is None:
        raise ValueError("data: workload 'data-mlp' needs --data PATH.npz (arrays x and y)")
    for key, value in workloads.defaults(cfg.workload).items():
        if getattr(cfg, key) is None:
            setattr(cfg, key, value)
    takes = inspect.signature(workloads.get(cfg.workload).build).parameters
    for key in ("hidden", "text_bytes"):  # params: checked with its parser below
        if getattr(cfg, key) is not None and key not in takes:
            users = [n for n in workloads.names() if key in inspect.signature(workloads.get(n).build).parameters]
            raise ValueError(f"{key} sets the model or data of {', '.join(map(repr, users))} only; workload is "
                             f"{cfg.workload!r}")


def _validate_numbers(cfg: TrainConfig) -> None:
    cfg.epochs = _int("epochs", cfg.epochs, 1)
    cfg.steps = _int("steps", cfg.steps, 1, optional=True)
    cfg.batch_size = _int("batch_size", cfg.batch_size, 1)
    cfg.seed = check_seed(cfg.seed)
    cfg.log_every = _int("log_every", cfg.log_every, 1)
    cfg.eval_every = _int("eval_every", cfg.eval_every, 0)
    cfg.nproc = None if cfg.nproc is None else check_nproc(cfg.nproc)
    cfg.min_numel = _int("min_numel", cfg.min_numel, 0)
    cfg.hidden = _int("hidden", cfg.hidden, 1, optional=True)
    cfg.samples = _int("samples", cfg.samples, 1, optional=True)
    cfg.text_bytes = _int("text_bytes", cfg.text_bytes, 1000, optional=True)
    if isinstance(cfg.lr, bool) or not isinstance(cfg.lr, (int, float)) or not math.isfinite(cfg.lr) or cfg.lr <= 0:
        raise ValueError(f"lr must be a positive finite number, got {cfg.lr!r}")
    cfg.lr = float(cfg.lr)
    if (isinstance(cfg.timeout, bool) or not isinstance(cfg.timeout, (int, float)) or not math.isfinite(cfg.timeout)
            or cfg.timeout <= 0):
        raise ValueError(f"timeout must be a positive finite number of seconds, got {cfg.timeout!r}")
    cfg.timeout = float(cfg.timeout)


def _check_host_layout(spec: str, world: int) -> None:
    """Refuse a ``hierarchical`` strategy whose ``workers_per_host`` (given,
    or ``GRADPRESS_WORKERS_PER_HOST``) does not divide ``world``, as every
    rank would at registration. A world of one is one host; ``LOCAL_WORLD_SIZE``
    is the workers' (the launcher sets it)."""
    from gradpress.compress.spec import coerce_params
    from gradpress.exchange.base import parse_strategy
    from gradpress.exchange.strategies import hierarchical, hierarchical_layout

    name, params = parse_strategy(spec)
    if name != "hierarchical" or world <= 1:
        return
    per = int(coerce_params(hierarchical.Hierarchical.PARAMS, params, "hierarchical", "strategy")["workers_per_host"])
    if not per and os.environ.get(hierarchical_layout.ENV_VARS[0], "").strip():
        per = hierarchical_layout.workers_per_host_from_env()
    if per:
        hierarchical_layout.check_divides(world, per)


def _validate_exchange(cfg: TrainConfig) -> None:
    """Algorithm, compressor (resolved to the algorithm's default when left
    out), strategy, error feedback, NaN/Inf mode."""
    if isinstance(cfg.error_feedback, bool):
        cfg.error_feedback = "on" if cfg.error_feedback else "off"
    cfg.error_feedback = _choice("error_feedback", cfg.error_feedback, ("on", "off", "auto"))
    cfg.nonfinite = _choice("nonfinite", cfg.nonfinite, NONFINITE)
    cfg.algorithm = algorithms.check_spec(cfg.algorithm)  # raises naming the algorithm / parameter
    if cfg.compressor is None:
        cfg.compressor = algorithms.default_compressor(cfg.algorithm)
    if not isinstance(cfg.compressor, str):
        raise ValueError(f"compressor must be a spec string like 'topk:ratio=0.01', got {cfg.compressor!r}")
    from gradpress.compress import create

    create(cfg.compressor)  # raises ValueError naming the bad name / parameter
    from gradpress.exchange.base import check_strategy

    cfg.strategy = check_strategy(cfg.strategy, create(cfg.compressor))  # a forced strategy that cannot carry it: now
    world = planned_world(cfg.nproc)
    if world is not None:  # a host layout the world size cannot have: the workers' own refusal, now
        _check_host_layout(cfg.strategy, world)
    if cfg.algorithm != "ddp":  # what the algorithm would refuse at construction, refused before workers start
        from gradpress.algorithms.base import Preflight
        from gradpress.train.optim import optimizer_class

        algorithms.preflight(cfg.algorithm, Preflight(optimizer_class(cfg.optimizer), create(cfg.compressor),
                                                      cfg.strategy, cfg.nonfinite, world))
    if cfg.plan_costs is not None:
        if cfg.strategy != "auto" or cfg.algorithm != "ddp":
            raise ValueError(f"plan_costs is used by --strategy auto with --algorithm ddp; this run has strategy "
                             f"{cfg.strategy!r} and algorithm {cfg.algorithm!r}")
        if not isinstance(cfg.plan_costs, (str, os.PathLike)):
            raise ValueError(f"plan_costs must be the path of a cost file, got {cfg.plan_costs!r}")
        from gradpress.exchange.costs import load_costs

        cfg.plan_costs = str(cfg.plan_costs)
        # fails before workers start; the world size too when it is known (--nproc, WORLD_SIZE): it was
        # refused only in the workers, once per rank in one message
        load_costs(cfg.plan_costs, compressor=create(cfg.compressor).spec(), world_size=world)


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check and complete every field of ``cfg`` in place (the order: module doc); ``cfg``."""
    _validate_workload(cfg)
    _validate_numbers(cfg)
    cfg.optimizer = _choice("optimizer", cfg.optimizer, OPTIMIZERS)
    cfg.schedule = _choice("schedule", cfg.schedule, SCHEDULES)
    cfg.device = _choice("device", cfg.device, ("cpu", "cuda"))
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False; allowed here: cpu")
    for name in ("resume", "reshard", "progress", "allow_divergence"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(cfg, name)!r}")
    if cfg.reshard and not cfg.resume:
        raise ValueError("reshard: true without resume; allowed: --reshard with --resume (it folds a checkpoint "
                         "of another world size into this run's)")
    if not isinstance(cfg.out, (str, os.PathLike)) or not str(cfg.out):
        raise ValueError(f"out must be a directory path, got {cfg.out!r}")
    cfg.out = str(cfg.out)
    check_out(cfg.out)
    if cfg.params is not None:
        if cfg.workload != "wide-mlp":
            raise ValueError(f"params sets the size of 'wide-mlp' only; workload is {cfg.workload!r}")
        from gradpress.workloads.wide import parse_count

        parse_count(cfg.params)
        cfg.params = str(cfg.params)
    _validate_exchange(cfg)
    from gradpress.train import precision, splits

    precision.check(cfg)  # after the exchange: fp16's scaler needs nonfinite propagate and an algorithm taking it

    split = splits.parse_split(cfg.split)  # bad kinds and values: refused here, naming the field
    splits.check_workload(split, cfg.workload, workloads.get(cfg.workload).labels)
    cfg.split = split.spec()
    if cfg.tensorboard is not None:
        if not isinstance(cfg.tensorboard, (str, os.PathLike)) or not str(cfg.tensorboard):
            raise ValueError(f"tensorboard must be a directory path, got {cfg.tensorboard!r}")
        from gradpress.tensorboard import require_tensorboard

        cfg.tensorboard = str(cfg.tensorboard)
        require_tensorboard()  # fail before starting workers when the extra is missing
        check_out(cfg.tensorboard, "tensorboard")  # the workers would create it: one they cannot, now
    if cfg.data is not None:
        from gradpress.workloads.userdata import check_header

        # fail before starting workers, from the headers: the launcher's preload reads the arrays, once
        check_header(cfg.data)
    return cfg
