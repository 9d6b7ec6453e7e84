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


def _column_order(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor | None:
    """``q``, a factor with one row per column of the old ``shape[0] x m`` matrix (row ``o`` the memory at
    ``o * m``...), re-indexed for today's matrix, or None when no row order does it. Exact when dimension 0
    is the outermost in memory (channels_last: stride ``m``): row ``o`` is then today's row ``o`` with its
    columns permuted alike for every ``o``, column ``j`` (the index of ``shape[1:]``, row-major) at the
    offset ``sum(idx * stride[1:])``, so ``M_old Q_old = M Q`` with ``Q[j] = Q_old[offset(j)]``."""
    m = p.numel() // p.shape[0] if p.dim() >= 2 and p.shape[0] else 0
    if not m or p.stride(0) != m or q.dim() != 2 or q.shape[0] != m:
        return None
    offsets = torch.arange(m, device=q.device).as_strided(p.shape[1:], p.stride()[1:]).reshape(-1)
    return q[offsets].clone()


def _upgraded(entries: Mapping[str, Any], names: Collection[str], moved: Mapping[str, torch.Tensor],
              kind: str, dropped: list[str]) -> dict[str, Any]:
    """``entries`` (by key) with those of a ``moved`` parameter re-indexed: a worker key (the parameter's own)
    holding a tensor of its shape (``kind`` ``residual``), of its size, flat (``element``) or a factor of its
    matrix view (``matrix``: :func:`_column_order`); any other key of it goes to ``dropped``. Store keys
    (residuals) or exchanged keys (compressor state), owned among ``names``, both today's
    (:func:`~gradpress.exchange.keys.upgrade_keys` first)."""
    fixed = {}
    for key, r in entries.items():
        name = owner_among(key, names) if kind == "residual" else tensor_owner(key, names)
        p = moved.get(name) if name is not None else None
        new = None
        if p is None or not isinstance(r, torch.Tensor):
            new = r
        elif key != escape(name):
            pass
        elif kind == "matrix":
            new = _column_order(r, p)
        elif r.shape == p.shape if kind == "residual" else (r.dim() == 1 and r.numel() == p.numel()):
            new = _reindexed(r, p)
        if new is None:
            dropped.append(key)
        else:
            fixed[key] = new
    return fixed


def upgrade_layout(state: Mapping[str, Any], params: Mapping[str, torch.Tensor],
                   element_state: Sequence[str] = (), matrix_state: Sequence[str] = ()) -> Mapping[str, Any]:
    """``state`` (the hook's, with its feedback residuals) with the worker
    residual of each parameter of ``params`` (by key) that DDP lays out in
    its own strides re-indexed like the parameter, when the state was written
    before that layout (no ``layout`` entry: the residual's element ``i`` was
    the one at memory position ``i``), and so the compressor's
    ``element_state`` entries (its flat per-tensor buffers: DGC's momentum
    and velocity, AdaComp's residue, Signum's momentum; ``Compressor.element_state``),
    and the ``matrix_state`` factors (PowerSGD's Q, ``Compressor.matrix_state``)
    where a row order maps the old matrix view to today's (channels_last;
    not a transposed parameter). Such a parameter's other residuals and
    state (a ring's or PS root's, a partition's, a transposed parameter's Q)
    cannot be re-indexed: they are dropped, with a warning (they restart as
    a new parameter's: at zero, PowerSGD's Q drawn afresh)."""
    if state.get("layout") == LAYOUT or not isinstance(state.get("feedback"), Mapping):
        return state
    moved = {k: p for k, p in params.items() if restrided(p)}
    if not moved:
        return state
    dropped: list[str] = []
    out = dict(state)
    residuals = state["feedback"].get("residuals")
    if isinstance(residuals, Mapping):
        out["feedback"] = {**state["feedback"], "residuals": _upgraded(residuals, params, moved, "residual", dropped)}
    compressor = state.get("compressor")
    kinds = {**{n: "matrix" for n in matrix_state}, **{n: "element" for n in element_state}}
    if isinstance(compressor, Mapping):
        out["compressor"] = {name: _upgraded(v, params, moved, kinds[name], dropped)
                             if name in kinds and isinstance(v, Mapping) else v
                             for name, v in compressor.items()}
    if dropped:
        warnings.warn(f"gradpress hook state written before 2026-11-28: the residuals or compressor buffers "
                      f"{', '.join(dropped)} of channels_last or transposed parameters were in DDP's bucket memory "
                      "order and cannot be re-indexed; they restart as a new parameter's (at zero; PowerSGD's Q "
                      "drawn afresh); the worker residuals and buffers were re-indexed", stacklevel=3)
    return out
