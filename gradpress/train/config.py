"""Training options: :class:`TrainConfig`, the TOML file, and validation.

:func:`make_config` merges built-in defaults < a TOML file (``config``) <
explicit values, fills the workload's defaults, resolves the compressor
(left out: the algorithm's own default) and validates every field, so that a
bad value fails before any worker starts with a ``ValueError`` that names
the field, the value and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import os
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

import gradpress.train.algorithm as algorithms
from gradpress import workloads
from gradpress.compress.spec import spelled_as
from gradpress.train.cpus import usable_cpus
from gradpress.train.optim import OPTIMIZERS, SCHEDULES

__all__ = ["TrainConfig", "FIELDS", "RESUME_FIXED", "UNRECORDED", "settings", "NONFINITE", "SEED_MAX", "make_config", "check_out", "check_seed", "check_nproc", "nproc_max", "planned_world",
           "load_toml"]

#: what a step does when a rank's gradient has a NaN/Inf (``gradpress.ddp.NONFINITE_MODES``)
NONFINITE = ("propagate", "skip", "raise")
#: the largest --seed: numpy's global generator (seeded from it) takes 32-bit seeds
SEED_MAX = 2**32 - 1


@dataclasses.dataclass
class TrainConfig:
    """Every training option. ``None`` means "the workload's default"
    (``compressor``: the algorithm's default compressor)."""

    workload: str | None = None
    data: str | None = None
    algorithm: str = "ddp"
    compressor: str | None = None
    strategy: str = "collective"
    plan_costs: str | None = None
    error_feedback: str = "auto"
    epochs: int | None = None
    steps: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    optimizer: str | None = None
    schedule: str | None = None
    seed: int = 0
    out: str = "runs/train"
    resume: bool = False
    reshard: bool = False
    device: str = "cpu"
    log_every: int = 10
    eval_every: int = 0
    nproc: int | None = None
    min_numel: int = 1024
    nonfinite: str = "propagate"
    hidden: int | None = None
    params: str | None = None
    samples: int | None = None
    text_bytes: int | None = None
    progress: bool = True
    timeout: float = 300.0
    allow_divergence: bool = False
    tensorboard: str | None = None
    split: str = "iid"


FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig))
#: changing these between a checkpoint and --resume would not continue the same run
RESUME_FIXED = ("workload", "data", "hidden", "params", "samples", "text_bytes", "algorithm", "compressor",
                "strategy", "error_feedback", "optimizer", "schedule", "batch_size", "seed", "min_numel", "nonfinite",
                "plan_costs", "split")
#: options that change no figure of a run (where it writes, whether it resumed, what it prints or logs, how
#: long it waits for a peer): left out of the settings a run records (:func:`settings`)
UNRECORDED = ("out", "resume", "reshard", "progress", "timeout", "tensorboard", "log_every")


def settings(cfg: TrainConfig) -> dict[str, Any]:
    """The settings a run records (``summary.json``'s and the checkpoint's ``settings``): every option but
    :data:`UNRECORDED`, as validated. ``gradpress compare --resume`` reuses or resumes a run only when these
    equal its plan's."""
    return {k: getattr(cfg, k) for k in FIELDS if k not in UNRECORDED}


def load_toml(path: str) -> dict[str, Any]:
    """The options of a ``--config`` TOML file, keys as field names (``-`` -> ``_``);
    ValueError for a missing or invalid file or an unknown key."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path!r} is not valid TOML: {exc}") from None
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in FIELDS or name == "config":
            raise ValueError(f"config file {path!r}: unknown key {key!r}; allowed: {', '.join(FIELDS)}")
        if name in spelled:  # log-every and log_every: TOML sees two keys, the option is one
            raise ValueError(f"config file {path!r}: keys {spelled[name]!r} and {key!r} set the same option "
                             f"{name!r}; allowed: one of them")
        spelled[name] = key
        out[name] = value
    return out


def _int(name: str, value: Any, low: int | None = None, optional: bool = False, high: int | None = None) -> int | None:
    if value is None and optional:
        return None
    allowed = "" if low is None else f" >= {low}"
    if high is not None:
        allowed = f" from {low} to {high}"
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer{allowed}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be an integer{allowed}, got {value!r}")
    return int(value)


def nproc_max() -> int:
    """The most local workers one command starts on this machine: max(64, 8 x its usable cores,
    :func:`usable_cpus`). More is a typo (``--nproc 4000`` forked 4000 workers), not a run anyone wants."""
    return max(64, 8 * usable_cpus())


def check_nproc(value: Any, name: str = "nproc") -> int:
    """The rule of every count of local workers (train and compare ``--nproc``, ``bench plan --nproc``, bench
    e2e's nodes x workers per node): an integer from 1 to :func:`nproc_max`; ValueError naming ``name``."""
    n = _int(name, value, 1)
    cap = nproc_max()
    if n > cap:
        raise ValueError(f"{name} must be an integer from 1 to {cap} (local workers on one machine: at most "
                         f"max(64, 8 x {usable_cpus()} cores)), got {n}")
    return n


def planned_world(nproc: int | None) -> int | None:
    """The number of workers a run will have: ``nproc`` (local workers), else
    the ``WORLD_SIZE`` of a launcher such as torchrun, else None (unknown)."""
    if nproc is not None:
        return nproc
    env_world = os.environ.get("WORLD_SIZE", "")
    return int(env_world) if env_world.isdigit() else None


def check_seed(value: Any, name: str = "seed") -> int:
    """The rule every ``--seed`` follows (train, compare, every bench): an integer from 0 to
    :data:`SEED_MAX`; ValueError naming ``name``, the value and the range otherwise."""
    return _int(name, value, 0, high=SEED_MAX)


def check_out(out: str, field: str = "out") -> None:
    """Fail (ValueError, one line) unless ``out`` is a directory this process
    can create and write in: checked before any data, model or worker. Nothing
    is created: a probe file is written and removed in ``out``, or in its
    nearest existing ancestor. ``field`` names the option in the message."""
    path = os.path.abspath(out)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{field}: {out!r} exists and is not a directory")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{field}: cannot create {out!r}: {existing!r} is a file, not a directory")
    probe_writable(existing, field, repr(out))


def probe_writable(directory: str, field: str, shown: str) -> None:
    """ValueError naming ``field`` unless a file can be created in
    ``directory`` (a probe file, written and removed: permissions, a
    read-only mount, a full disk all show)."""
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".gradpress-probe-")
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise ValueError(f"{field}: cannot write to {shown}: {exc.strerror or exc} (in {directory!r})") from None


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def make_config(config: Mapping[str, Any] | argparse.Namespace | TrainConfig | None = None,
                **overrides: Any) -> TrainConfig:
    """Merge defaults < the TOML file named by ``config`` (key ``config``) <
    explicit values, fill workload defaults and validate everything.
    Raises ValueError naming the field, the value and what is allowed; for
    an ``argparse.Namespace`` (a command line), the flag of each field it
    sets (:func:`gradpress.train.flags.name_flags`)."""
    if config is None:
        given: dict[str, Any] = {}
    elif isinstance(config, TrainConfig):
        given = dataclasses.asdict(config)
    elif isinstance(config, argparse.Namespace):
        given = {k: v for k, v in vars(config).items() if k in FIELDS or k == "config"}
    elif isinstance(config, Mapping):
        given = {str(k).replace("-", "_"): v for k, v in config.items()}
    else:
        raise ValueError(f"config must be a dict, an argparse.Namespace or a TrainConfig, got {type(config).__name__}")
    given.update({k.replace("-", "_"): v for k, v in overrides.items()})
    unknown = [k for k in given if k not in FIELDS and k != "config"]
    if unknown:
        raise ValueError(f"unknown training option(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(FIELDS)}")
    try:
        merged: dict[str, Any] = {}
        if given.get("config"):
            merged.update(load_toml(str(given["config"])))
        merged.update({k: v for k, v in given.items() if k != "config"})
        return _validate(TrainConfig(**merged))
    except ValueError as exc:
        if not isinstance(config, argparse.Namespace):
            raise
        from gradpress.train.flags import name_flags

        # a command line: the error names the flag the user typed (--error-feedback), not the field
        message = name_flags(str(exc), vars(config))
        if message == str(exc):
            raise
        raise ValueError(message) from None


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


def _validate(cfg: TrainConfig) -> TrainConfig:
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
    from gradpress.train import splits

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
