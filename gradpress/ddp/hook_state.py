"""The DDP hook's state dict: what :meth:`GradpressHook.state_dict` writes
and :meth:`GradpressHook.load_state_dict` reads, older formats upgraded
through :mod:`gradpress.ddp.state_format`.

Invariant: a hook state dict is the engine's state with ``format``
(``HOOK_FORMAT``), the hook's ``step``, the gradients' ``layout`` and the
``loss_scale`` its state is kept in (None without a scaler; a state without
the entry loads as None); a load either changes nothing (``ValueError``
naming what is wrong) or restores the engine's state and returns the step
and loss scale to set with it. A state whose format is
neither ``HOOK_FORMAT`` nor ``gradpress-hook/1`` is refused before anything
else is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gradpress.ddp.loss_scale import check_kept
from gradpress.ddp.state_format import _OLD_FORMAT, HOOK_FORMAT, LAYOUT, _upgrade_v1, upgrade_layout
from gradpress.exchange import Synchronizer
from gradpress.exchange.agree import agree
from gradpress.exchange.keys import upgrade_keys
from gradpress.exchange.reshard import fold_engine, rule
from gradpress.exchange.state import STATE_FORMAT

__all__ = ["save", "check_format", "load", "load_pending"]

# a hook state is the engine's plus the hook's step, layout and loss scale: it folds onto another world
# size by the engine's rule (:mod:`gradpress.exchange.reshard`)
rule(HOOK_FORMAT)(fold_engine)


def save(engine: Synchronizer, step: int, loss_scale: float | None = None) -> dict[str, Any]:
    """The state dict of a bound hook at ``step``, its state kept in ``loss_scale`` (None: no scaler)."""
    return {**engine.state_dict(), "format": HOOK_FORMAT, "step": step, "layout": LAYOUT, "loss_scale": loss_scale}


def check_format(state: Any) -> None:
    """Raise ``ValueError`` unless ``state`` is a mapping in a format a hook loads
    (what an unbound hook checks before keeping it)."""
    fmt = state.get("format") if isinstance(state, Mapping) else None
    if fmt not in (HOOK_FORMAT, _OLD_FORMAT):
        raise ValueError(f"not a gradpress hook state dict (format {fmt!r}; expected {HOOK_FORMAT!r} "
                         f"or {_OLD_FORMAT!r})")


def load(engine: Synchronizer, by_name: Mapping[str, torch.nn.Parameter],
         state: Mapping[str, Any]) -> tuple[int, float | None]:
    """Restore ``engine`` from a hook state dict (``gradpress-hook/1`` and
    states written before gradients had their parameter's layout upgraded);
    ``by_name``: the bound parameters by key. Returns the saved step and the
    loss scale its state is kept in (None: no scaler, or a state written
    before the hook followed one)."""
    check_format(state)
    if state["format"] == _OLD_FORMAT:
        try:
            state = _upgrade_v1(state)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"gradpress hook state dict ({_OLD_FORMAT}) is malformed "
                             f"({type(exc).__name__}: {exc}); nothing was loaded") from None
    step = state.get("step")
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point():
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"gradpress hook state dict: 'step' must be an integer >= 0, got {step!r}; "
                         "nothing was loaded")
    kept = check_kept(state.get("loss_scale"))
    state = upgrade_keys(state, [p[0] for p in engine.params])  # today's keys first: upgrade_layout reads them
    state = upgrade_layout(state, by_name, engine.compressor.element_state, engine.compressor.matrix_state)
    engine_state = {k: v for k, v in state.items() if k not in ("step", "layout", "loss_scale")}
    engine_state["format"] = STATE_FORMAT  # the engine's own (not a copy of its whole state to read it)
    engine.load_state_dict(engine_state)  # validates fully, changes nothing on error
    return step, kept


def load_pending(engine: Synchronizer, by_name: Mapping[str, torch.nn.Parameter],
                 state: Mapping[str, Any] | None) -> tuple[int, float | None] | None:
    """:func:`load` of the state an unbound hook kept (None: none), into the ``engine`` just built for it (not
    yet the hook's); None when there was none. Collective on the engine's group, on every rank whether it kept
    a state or not (a state loaded on some ranks only must not leave the others out of it): the ranks agree on
    the outcome, so a state refused on any rank is refused on every rank (``ValueError`` naming each rank's
    reason); the hook then stays unbound with its pending state and drops this engine."""
    error, restored = None, None
    try:
        restored = load(engine, by_name, state) if state is not None else None
    except ValueError as exc:
        error = str(exc)
    try:
        agree({}, error, engine.group, stage="restore of the state loaded before binding")
    except ValueError as exc:
        raise ValueError(f"{exc}. The hook stays unbound and keeps that state: load a state saved by a hook "
                         "of this model and configuration (load_state_dict), then bind again") from None
    return restored
