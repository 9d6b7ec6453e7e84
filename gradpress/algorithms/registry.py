"""Name -> algorithm class registry: ``gradpress.algorithms.create("localsgd:period=8", model, optimizer)``.

The spec grammar is the compressors' (``name[:key=value,...]``, typed and
validated by the class's ``Param``s); ``compressor=`` takes a compressor spec.
Like timm's ``create_model`` and the compressor registry beside it.
"""

from __future__ import annotations

from typing import Any

import torch

from gradpress.algorithms.base import Algorithm
from gradpress.compress.spec import Registry, coerce_params, parse_stage

__all__ = ["register", "create", "names", "get_class", "describe", "parse", "preflight"]

_REGISTRY: Registry[type[Algorithm]] = Registry("algorithm", "gradpress.algorithms", skip=("base", "registry"), plugins=True)


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: add ``cls`` under ``cls.name``."""
    return _REGISTRY.register(cls)


def names() -> list[str]:
    """Every registered algorithm name, sorted."""
    return _REGISTRY.names()


def get_class(name: str) -> type[Algorithm]:
    return _REGISTRY.get(name)


def parse(spec: str) -> tuple[type[Algorithm], dict[str, Any]]:
    """The class and coerced parameters of ``spec``; raises ValueError naming
    the unknown name, parameter or bad value (nothing is built: usable to
    validate a command line before workers start)."""
    if not isinstance(spec, str):
        raise ValueError(f"algorithm spec must be a string like 'localsgd:period=8', got {spec!r}")
    if ">" in spec:
        raise ValueError(f"algorithm spec {spec!r}: algorithms do not compose ('>' is for compressors)")
    name, raw = parse_stage(spec, kind="algorithm")
    if name == "ddp" and name not in names():  # `--algorithm ddp` of the commands is the hook, not a class here
        raise ValueError("algorithm 'ddp' is not built by gradpress.algorithms: it is DistributedDataParallel with "
                         "the gradpress hook, gradpress.ddp.register(DistributedDataParallel(model), compressor) "
                         f"(docs/integrations.md, \"Your own DDP script\"); allowed here: {', '.join(names())}")
    cls = get_class(name)
    return cls, coerce_params(cls.PARAMS, raw, name, "algorithm", defaults=False)


def preflight(spec: str, run: Any) -> None:
    """Check ``spec`` against what a launcher knows of the run
    (:class:`~gradpress.algorithms.base.Preflight`) before workers start;
    ValueError as the algorithm's construction would raise it."""
    cls, params = parse(spec)
    cls.preflight({p.name: params.get(p.name, p.default) for p in cls.PARAMS}, run)


def create(spec: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **options: Any) -> Algorithm:
    """Build an algorithm: ``create("localsgd:period=8", model, optimizer,
    compressor="topk:ratio=0.01")``. ``options`` are the shared keywords of
    :class:`Algorithm` (compressor, error_feedback, strategy, min_numel,
    seed, nonfinite, process_group, timeout, scaler) and algorithm parameters.
    Collective: every rank calls it with the same arguments."""
    cls, params = parse(spec)
    overlap = sorted(set(params) & set(options))
    if overlap:
        raise ValueError(f"algorithm {cls.name!r}: parameter {overlap[0]!r} given in the spec and as a keyword")
    return cls(model, optimizer, **params, **options)


def describe() -> list[dict[str, Any]]:
    """One row per algorithm: name, summary, params (name, type, default,
    allowed, doc), default compressor."""
    rows = []
    for name in names():
        cls = _REGISTRY.get(name)
        rows.append({
            "name": name, "summary": cls.summary, "default_compressor": cls.default_compressor,
            "params": [{"name": p.name, "type": p.type.__name__, "default": p.default, "allowed": p.allowed,
                        "doc": p.doc} for p in cls.PARAMS],
        })
    return rows
