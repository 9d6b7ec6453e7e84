"""What :meth:`~gradpress.exchange.state.EngineState.load_state_dict` refuses before anything changes.

:func:`check_form`: the parts a state dict must have, of the right types. :func:`check_contents`: every
residual and every per-tensor compressor buffer is one this engine can use. A state that passes both is
loaded; one that fails raises ``ValueError`` naming the entry, what was found and what is allowed, and
"nothing was loaded" (the engine is untouched: the checks run before the load's
:class:`~gradpress.exchange.rollback.Rollback` starts).

Invariant: a loaded state holds nothing the engine keeps without using. Without these checks a residual
under a key no tensor of the engine builds (a typo'd, foreign or renamed parameter's) was kept silently and
written into every later checkpoint, and one of another shape was silently ignored by
:meth:`~gradpress.exchange.feedback.Feedback.compensate` (the saved error lost without a word); a DGC
momentum or AdaComp residue of another shape restarted at zero, a PowerSGD Q of another shape was drawn
afresh, and a Signum momentum of another size failed the first step after the load, mid-exchange.

What is knowable at load time, and checked (``params``: the engine's ``(key, shape, dtype)``; keys as
:mod:`gradpress.exchange.keys` builds them, after :func:`~gradpress.exchange.keys.upgrade_keys`):

* a worker residual is keyed by a parameter's escaped name and has that parameter's shape exactly (the
  engine stages it reshaped to the tensor it averaged, even when the plan partitions it);
* a strategy's residual is in a declared namespace (``ring/``, ``root/``, ``host/``), keyed by a
  parameter's escaped name and a well-formed tail (``#k`` partitions and pieces, then the suffix its
  namespace declares: ``#ps`` for a root's, none for a ring's or a host's), and holds at
  most the parameter's elements (a partition, a piece or a chunk of it: its exact size depends on the plan
  and the layout, so only the bound is certain);
* a compressor's per-tensor buffer (``Compressor.element_state``, ``matrix_state``) is keyed like a
  context the exchange builds (``#ring<c>`` too); whole-tensor keys have the shape
  :meth:`~gradpress.compress.Compressor.state_shape` gives (flat ``(numel,)`` for element buffers; PowerSGD's
  ``(m, r)``), the others at most the parameter's elements;
* every such tensor is floating point. Its dtype is not compared with the parameter's: under mixed
  precision a residual is in the gradient's dtype, and every reader casts (``e.to(g.dtype)``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gradpress.compress import Compressor
from gradpress.exchange.keys import WORKER, key_tail, namespace_tail, namespaces, split_key
from gradpress.exchange.rollback import NOTHING_LOADED

__all__ = ["check_form", "check_contents"]

#: the engine's parameters as ``Synchronizer.params`` holds them: (key, shape, dtype name)
Params = Sequence[tuple[str, Sequence[int], str]]


def check_form(state: Mapping[str, Any]) -> None:
    """The shape of a state dict (before anything is changed): ValueError
    naming the first part that is missing or of the wrong type."""
    def need(ok: bool, what: str, got: Any) -> None:
        if not ok:
            raise ValueError(f"gradpress state dict: {what}, got {type(got).__name__} {str(got)[:80]!r}; "
                             f"{NOTHING_LOADED}")

    for key in ("config", "feedback", "compressor"):
        if key not in state:
            raise ValueError(f"gradpress state dict: missing {key!r}; {NOTHING_LOADED}")
    need(isinstance(state["config"], Mapping), "'config' must be a dict", state["config"])
    fb = state["feedback"]
    need(isinstance(fb, Mapping), "'feedback' must be a dict", fb)
    for key in ("beta", "gamma"):
        if key in fb:
            need(isinstance(fb[key], (int, float)) and not isinstance(fb[key], bool),
                 f"feedback[{key!r}] must be a number", fb[key])
    residuals = fb.get("residuals", {})
    need(isinstance(residuals, Mapping), "feedback['residuals'] must be a dict of tensors", residuals)
    for key, value in residuals.items():
        need(isinstance(value, torch.Tensor), f"feedback['residuals'][{key!r}] must be a tensor", value)
    need(isinstance(state["compressor"], Mapping), "'compressor' must be a dict", state["compressor"])
    strategies = state.get("strategies", {})
    need(isinstance(strategies, Mapping), "'strategies' must be a dict", strategies)
    for name, value in strategies.items():
        need(isinstance(value, Mapping), f"strategies[{name!r}] must be a dict", value)
    plan = state.get("plan")
    need(plan is None or isinstance(plan, Mapping), "'plan' must be a dict", plan)
    stats = state.get("stats", {})
    need(isinstance(stats, Mapping), "'stats' must be a dict", stats)
    for key in ("rank", "dropped_steps"):
        value = state.get(key, 0)
        need(isinstance(value, int) and not isinstance(value, bool) and value >= 0, f"{key!r} must be an integer >= 0",
             value)


def check_contents(state: Mapping[str, Any], params: Params, compressor: Compressor) -> None:
    """Every residual of ``state['feedback']`` and every per-tensor buffer of ``state['compressor']`` is one
    the engine of ``params`` and ``compressor`` uses (the module doc): ValueError naming the first that is
    not, its shape and dtype, and what is allowed. ``state`` has passed :func:`check_form` and has today's
    keys."""
    shapes = {str(k): tuple(int(s) for s in shape) for k, shape, _ in params}
    for key, value in state["feedback"].get("residuals", {}).items():
        _check_residual(str(key), value, shapes)
    comp = state["compressor"]
    for entry in (*compressor.element_state, *compressor.matrix_state):
        held = comp.get(entry, {})
        if not isinstance(held, Mapping):
            raise ValueError(f"gradpress state dict: compressor {compressor.name!r}: {entry!r} must be a dict of "
                             f"tensors by tensor key, got {type(held).__name__}; {NOTHING_LOADED}")
        for key, value in held.items():
            _check_buffer(compressor, entry, str(key), value, shapes)


def _found(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    return f"shape {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _params_named(shapes: Mapping[str, tuple[int, ...]]) -> str:
    names = list(shapes)
    shown = ", ".join(map(repr, names[:6])) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
    return shown or "none"


def _check_residual(key: str, value: torch.Tensor, shapes: Mapping[str, tuple[int, ...]]) -> None:
    where = f"gradpress state dict: feedback['residuals'][{key!r}]"
    space, exchanged = split_key(key)
    if space != WORKER and space not in namespaces():
        raise ValueError(f"{where}: namespace {space!r} is no strategy's (allowed: the worker's own, keyed by a "
                         f"parameter's name, or {', '.join(sorted(namespaces()))}); {NOTHING_LOADED}")
    parsed = key_tail(exchanged, shapes)
    if parsed is None or (space == WORKER and parsed[1]):
        what = "a parameter's name" if space == WORKER else "a parameter's name with its partition/#ps suffix"
        raise ValueError(f"{where}: a residual of a tensor this engine never exchanges (allowed: {what}; this "
                         f"engine's parameters: {_params_named(shapes)}); {NOTHING_LOADED}")
    name, tail = parsed
    ends = namespace_tail(space, tail) if space != WORKER else None
    if ends is not None:
        raise ValueError(f"{where}: not the key of a {space} residual (allowed: {ends}; no strategy builds this "
                         f"one, so it would be kept and never read); {NOTHING_LOADED}")
    expected = shapes[name]
    if not value.is_floating_point():
        raise ValueError(f"{where}: {_found(value)}, allowed: a floating-point tensor (the residual of parameter "
                         f"{name!r}, shape {expected}); {NOTHING_LOADED}")
    if space == WORKER and tuple(value.shape) != expected:
        raise ValueError(f"{where}: {_found(value)}, expected shape {expected} (parameter {name!r}'s: the worker "
                         f"keeps the whole tensor's residual); {NOTHING_LOADED}")
    if space != WORKER and value.numel() > math.prod(expected):
        raise ValueError(f"{where}: {_found(value)}, {value.numel()} elements, expected at most "
                         f"{math.prod(expected)} (parameter {name!r}, shape {expected}: a {space} residual is of "
                         f"the tensor, a partition or a piece of it); {NOTHING_LOADED}")


def _check_buffer(compressor: Compressor, entry: str, key: str, value: Any,
                  shapes: Mapping[str, tuple[int, ...]]) -> None:
    where = f"gradpress state dict: compressor {compressor.name!r}: {entry}[{key!r}]"
    parsed = key_tail(key, shapes, context=True)
    if parsed is None:
        raise ValueError(f"{where}: state of a tensor this engine never exchanges (allowed: keyed by a parameter's "
                         f"name, with its partition, #ps or #ring suffix; this engine's parameters: "
                         f"{_params_named(shapes)}); {NOTHING_LOADED}")
    name, tail = parsed
    shape = shapes[name]
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise ValueError(f"{where}: {_found(value)}, allowed: a floating-point tensor (parameter {name!r}, shape "
                         f"{shape}); {NOTHING_LOADED}")
    if entry in compressor.element_state and value.dim() != 1:
        raise ValueError(f"{where}: {_found(value)}, allowed: a flat (1-D) buffer of the tensor's elements "
                         f"(parameter {name!r}, shape {shape}); {NOTHING_LOADED}")
    expected = compressor.state_shape(entry, torch.Size(shape)) if not tail else None
    if expected is not None and tuple(value.shape) != tuple(expected):
        raise ValueError(f"{where}: {_found(value)}, expected shape {tuple(expected)} (for parameter {name!r} of "
                         f"shape {shape}); {NOTHING_LOADED}")
    if value.numel() > math.prod(shape):
        raise ValueError(f"{where}: {_found(value)}, {value.numel()} elements, expected at most {math.prod(shape)} "
                         f"(parameter {name!r}, shape {shape}: the state of the tensor, a partition, a piece or a "
                         f"hop's chunk of it); {NOTHING_LOADED}")
