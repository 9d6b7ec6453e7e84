"""The DDP hook's state keys and formats: parameter names less a wrapper's
prefix (:func:`strip_module`), the state format tag, and the upgrade of a
state written before the exchange engine (``gradpress-hook/1``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gradpress.exchange.feedback import Feedback

__all__ = ["HOOK_FORMAT", "strip_module"]

HOOK_FORMAT = "gradpress-hook/2"
_OLD_FORMAT = "gradpress-hook/1"


def strip_module(names: Sequence[str]) -> list[str]:
    """``names`` less a wrapper's ``module.`` prefix, only when all have it (never two names one key)."""
    every = bool(names) and all(n.startswith("module.") for n in names)
    return [n[len("module."):] if every else n for n in names]


def _upgrade_v1(state: Mapping[str, Any]) -> dict[str, Any]:
    """A ``gradpress-hook/1`` state (residuals in three stores) in today's
    layout: ring and PS-root residuals move into the one feedback store."""
    memory = dict(state.get("memory", {}))
    residuals = dict(memory.get("residuals", {}))
    strategies = dict(state.get("strategies", {}))
    for name, namespace in (("ring", "ring"), ("ps", "root")):
        old = dict(strategies.get(name, {}))
        residuals.update({Feedback.key(namespace, k): v for k, v in old.pop("residuals", {}).items()})
        if name in strategies:
            strategies[name] = old
    config = dict(state["config"])
    config["parameters"] = [[n, list(s), d] for n, s, d in config.get("parameters", [])]
    config.setdefault("plan_costs", None)
    return {
        **state, "config": config, "strategies": strategies,
        "feedback": {"beta": memory.get("beta", 1.0), "gamma": memory.get("gamma", 1.0), "residuals": residuals},
    }
