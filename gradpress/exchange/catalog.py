"""What ``gradpress strategies`` lists: every strategy name the engine
accepts, what it does, its parameters, and which registered compressors it
can carry (asked of the strategy itself, :meth:`Strategy.supports`, the same
check that ``gradpress train`` runs before any worker starts)."""

from __future__ import annotations

import importlib
from typing import Any

from gradpress.compress import registry
from gradpress.compress.base import Compressor
from gradpress.exchange.base import PSEUDO, check_strategy, strategy_class, strategy_names

__all__ = ["describe_strategies"]

#: the pseudo-strategies have no class (and so no module docstring) of their own
_PSEUDO_SUMMARY = {
    "auto": "the planner: per tensor, the strategy (and partition count) its cost model predicts fastest "
            "for the compressor, the tensor's size and the group",
    "collective": "allreduce when the compressor's packets are summable, else allgather",
}


def _summary(name: str) -> str:
    """The first sentence of the strategy module's docstring, without its
    leading ``name``: label."""
    doc = (importlib.import_module(strategy_class(name).__module__).__doc__ or "").strip()
    text = " ".join(doc.split("\n\n")[0].split())
    label = f"``{name}``:"
    if text.startswith(label):
        text = text[len(label):].strip()
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def _params(name: str) -> list[dict[str, Any]]:
    if name in PSEUDO:
        return []
    return [{"name": p.name, "type": p.type.__name__, "default": p.default, "allowed": p.allowed, "doc": p.doc}
            for p in getattr(strategy_class(name), "PARAMS", ())]


def _refusal(name: str, compressor: Compressor) -> str | None:
    """Why strategy ``name`` (with its defaults) cannot carry ``compressor``,
    or None; the pseudo-strategies carry every compressor."""
    try:
        check_strategy(name, compressor)
    except ValueError as exc:
        return str(exc).removeprefix(f"strategy {name!r}: ")
    return None


def describe_strategies(compressor: str | None = None) -> list[dict[str, Any]]:
    """One row per strategy name (the registered strategies in exchange order,
    then ``auto`` and ``collective``): ``name``, ``summary``, ``params``, and
    ``refuses`` (compressor name -> the strategy's reason) over every
    registered compressor with its defaults. Given ``compressor`` (a spec),
    ``refuses`` covers that one compressor only, under its spec.
    ValueError for a bad compressor spec."""
    specs = [compressor] if compressor is not None else registry.names()
    built = {spec: registry.create(spec) for spec in specs}
    rows = []
    for name in [*strategy_names(), *PSEUDO]:
        refuses = {spec: reason for spec, c in built.items() if (reason := _refusal(name, c))}
        summary = _PSEUDO_SUMMARY[name] if name in PSEUDO else _summary(name)
        rows.append({"name": name, "summary": summary, "params": _params(name), "refuses": refuses})
    return rows
