"""The DDP hook's state keys and formats: parameter names less a wrapper's
prefix (:func:`strip_module`), the state format tag, the upgrade of a
state written before the exchange engine (``gradpress-hook/1``), and of one
written before gradients were handed over in their parameter's layout
(:func:`upgrade_layout`: no ``layout`` entry)."""

from __future__ import annotations

import warnings
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from gradpress.ddp.buckets import restrided
from gradpress.exchange.feedback import Feedback, escape, owner_among, tensor_owner

__all__ = ["HOOK_FORMAT", "LAYOUT", "strip_module", "upgrade_layout"]

HOOK_FORMAT = "gradpress-hook/2"
_OLD_FORMAT = "gradpress-hook/1"
#: the ``layout`` entry of a state whose residuals are indexed like their parameter (2026-11-28 on); a
#: state without it indexed a channels_last or transposed parameter's residual in DDP's bucket memory order
LAYOUT = "parameter"


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


def _reindexed(r: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``r`` (``p``'s shape, or flat), whose element ``i`` is the one at ``p``'s memory position ``i``, indexed
    like ``p`` (shaped as ``r``). From ``r``'s own place in its storage (a loaded view may start at an offset)."""
    flat = r.contiguous().reshape(-1)
    return flat.as_strided(p.shape, p.stride(), flat.storage_offset()).contiguous().reshape(r.shape)


def _upgraded(entries: Mapping[str, Any], names: Collection[str], moved: Mapping[str, torch.Tensor],
              shaped: bool, dropped: list[str]) -> dict[str, Any]:
    """``entries`` (by key) with those of a ``moved`` parameter re-indexed: a worker key (the parameter's own)
    holding a tensor of its shape (``shaped``) or of its size, flat; any other key of it goes to ``dropped``.
    Store keys (``shaped``: residuals) or exchanged keys (compressor buffers), owned among ``names``, both
    today's (:func:`~gradpress.exchange.keys.upgrade_keys` first)."""
    fixed = {}
    for key, r in entries.items():
        name = owner_among(key, names) if shaped else tensor_owner(key, names)
        p = moved.get(name) if name is not None else None
        if p is None or not isinstance(r, torch.Tensor):
            fixed[key] = r
        elif key == escape(name) and (r.shape == p.shape if shaped else (r.dim() == 1 and r.numel() == p.numel())):
            fixed[key] = _reindexed(r, p)
        else:
            dropped.append(key)
    return fixed


def upgrade_layout(state: Mapping[str, Any], params: Mapping[str, torch.Tensor],
                   element_state: Sequence[str] = ()) -> Mapping[str, Any]:
    """``state`` (the hook's, with its feedback residuals) with the worker
    residual of each parameter of ``params`` (by key) that DDP lays out in
    its own strides re-indexed like the parameter, when the state was written
    before that layout (no ``layout`` entry: the residual's element ``i`` was
    the one at memory position ``i``), and so the compressor's
    ``element_state`` entries (its flat per-tensor buffers: DGC's momentum
    and velocity, AdaComp's residue, Signum's momentum; ``Compressor.element_state``).
    Such a parameter's other residuals and buffers (a ring's or PS root's, a
    partition's) cannot be re-indexed: they are dropped, with a warning (they
    restart at zero, as a new parameter's)."""
    if state.get("layout") == LAYOUT or not isinstance(state.get("feedback"), Mapping):
        return state
    moved = {k: p for k, p in params.items() if restrided(p)}
    if not moved:
        return state
    dropped: list[str] = []
    out = dict(state)
    residuals = state["feedback"].get("residuals")
    if isinstance(residuals, Mapping):
        out["feedback"] = {**state["feedback"], "residuals": _upgraded(residuals, params, moved, True, dropped)}
    compressor = state.get("compressor")
    if isinstance(compressor, Mapping):
        out["compressor"] = {name: _upgraded(v, params, moved, False, dropped)
                             if name in element_state and isinstance(v, Mapping) else v
                             for name, v in compressor.items()}
    if dropped:
        warnings.warn(f"gradpress hook state written before 2026-11-28: the residuals or compressor buffers "
                      f"{', '.join(dropped)} of channels_last or transposed parameters were in DDP's bucket memory "
                      "order and cannot be re-indexed; they restart at zero (the worker residuals and buffers were "
                      "re-indexed)", stacklevel=3)
    return out
