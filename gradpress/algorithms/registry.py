"""Name -> algorithm class registry: ``gradpress.algorithms.create("localsgd:period=8", model, optimizer)``.

The spec grammar is the compressors' (``name[:key=value,...]``, typed and
validated by the class's ``Param``s); ``compressor=`` takes a compressor spec.
Like timm's ``create_model`` and the compressor registry beside it.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import torch

from gradpress.algorithms.base import Algorithm
from gradpress.compress.spec import parse_stage

__all__ = ["register", "create", "names", "get_class", "describe", "parse"]

_REGISTRY: dict[str, type[Algorithm]] = {}
_LOADED = False


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: add ``cls`` under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no registry name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"algorithm name {cls.name!r} is already registered by {_REGISTRY[cls.name].__name__}")
    _REGISTRY[cls.name] = cls
    return cls


def _load_builtin() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    import gradpress.algorithms as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name not in ("base", "registry"):
            importlib.import_module(f"gradpress.algorithms.{mod.name}")


def names() -> list[str]:
    """Every registered algorithm name, sorted."""
    _load_builtin()
    return sorted(_REGISTRY)


def get_class(name: str) -> type[Algorithm]:
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown algorithm {name!r}; allowed: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def parse(spec: str) -> tuple[type[Algorithm], dict[str, Any]]:
    """The class and coerced parameters of ``spec``; raises ValueError naming
    the unknown name, parameter or bad value (nothing is built: usable to
    validate a command line before workers start)."""
    if not isinstance(spec, str):
        raise ValueError(f"algorithm spec must be a string like 'localsgd:period=8', got {spec!r}")
    if ">" in spec:
        raise ValueError(f"algorithm spec {spec!r}: algorithms do not compose ('>' is for compressors)")
    name, raw = parse_stage(spec, kind="algorithm")
    cls = get_class(name)
    known = {p.name: p for p in cls.PARAMS}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"algorithm {name!r}: unknown parameter {unknown[0]!r}; "
                         f"allowed parameters: {', '.join(known) or 'none'}")
    return cls, {k: known[k].coerce(v, name, kind="algorithm") for k, v in raw.items()}


def create(spec: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **options: Any) -> Algorithm:
    """Build an algorithm: ``create("localsgd:period=8", model, optimizer,
    compressor="topk:ratio=0.01")``. ``options`` are the shared keywords of
    :class:`Algorithm` (compressor, error_feedback, strategy, min_numel,
    seed, nonfinite, process_group, timeout) and algorithm parameters.
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
        cls = _REGISTRY[name]
        rows.append({
            "name": name, "summary": cls.summary, "default_compressor": cls.default_compressor,
            "params": [{"name": p.name, "type": p.type.__name__, "default": p.default, "allowed": p.allowed,
                        "doc": p.doc} for p in cls.PARAMS],
        })
    return rows
