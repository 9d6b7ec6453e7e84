"""Training options: :class:`TrainConfig`, the TOML file, and validation.

:func:`make_config` merges built-in defaults < a TOML file (``config``) <
explicit values, fills the workload's defaults, resolves the compressor
(left out: the algorithm's own default) and validates every field, so that a
bad value fails before any worker starts with a ``ValueError`` that names
the field, the value and what is allowed.

Modules, one job each: this one (the options, which of them a resume may
not change and which a run records, the TOML file, the merge), every
field's check (:mod:`gradpress.train.validate`), the rules every command's
options share (:mod:`gradpress.train.checks`: workers, seeds, output
directories), the command line's flag names (:mod:`gradpress.train.flags`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

# the rules every command shares, and usable_cpus, importable from here as before
from gradpress.train.checks import (
    SEED_MAX,
    check_nproc,
    check_out,
    check_seed,
    nproc_max,
    planned_world,
    probe_writable,
)
from gradpress.train.cpus import usable_cpus
from gradpress.train.validate import NONFINITE, validate

__all__ = ["TrainConfig", "FIELDS", "RESUME_FIXED", "UNRECORDED", "settings", "NONFINITE", "SEED_MAX", "make_config",
           "check_out", "check_seed", "check_nproc", "nproc_max", "planned_world", "probe_writable", "usable_cpus",
           "load_toml"]


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
    precision: str = "fp32"


FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig))
#: changing these between a checkpoint and --resume would not continue the same run
RESUME_FIXED = ("workload", "data", "hidden", "params", "samples", "text_bytes", "algorithm", "compressor",
                "strategy", "error_feedback", "optimizer", "schedule", "batch_size", "seed", "min_numel", "nonfinite",
                "plan_costs", "split", "precision")
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
        return validate(TrainConfig(**merged))
    except ValueError as exc:
        if not isinstance(config, argparse.Namespace):
            raise
        from gradpress.train.flags import name_flags

        # a command line: the error names the flag the user typed (--error-feedback), not the field
        message = name_flags(str(exc), vars(config))
        if message == str(exc):
            raise
        raise ValueError(message) from None
