"""The exchange engine's state: ``state_dict`` / ``load_state_dict``
(validated fully before anything changes: :mod:`gradpress.exchange.state_check`; rolled back on failure), the
per-step snapshot that ``nonfinite='skip'`` restores, and ``memory_bytes``.

Format ``gradpress-exchange/2``: config, feedback (every residual, every
namespace), compressor and strategy state, plan, stats, ``rank`` (the rank
in the engine's group that saved it: a state is per rank, and another
rank's is refused; a state without it, written before 2026-11-29, loads
anywhere), ``dropped_steps`` (the steps ``nonfinite='skip'``, or
``propagate`` under a loss scaler, dropped: they do not count in the
compressors' Context step; a state without it counts none), and ``keys``
(:data:`~gradpress.exchange.keys.KEYS_FORMAT`: keys built from escaped
names; a state without it is read by :func:`~gradpress.exchange.keys.upgrade_keys`).
Loadable with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import torch

from gradpress.compress import Context
from gradpress.exchange.feedback import WORKER
from gradpress.exchange.keys import KEYS_FORMAT, upgrade_keys
from gradpress.exchange.rollback import Rollback
from gradpress.exchange.state_check import check_contents, check_form

__all__ = ["EngineState", "STATE_FORMAT"]

STATE_FORMAT = "gradpress-exchange/2"


class EngineState:
    """Mixin of :class:`~gradpress.exchange.engine.Synchronizer` (uses its
    compressor, strategies, feedback, plan, choice, stats_counter, config,
    guard, rank, world_size, seed)."""

    #: the step's loss scale (set by the DDP hook while a scaler is attached; 1 otherwise), in every encode Context:
    #: scale-free averages (``scale_degree == 0``) are multiplied by it
    output_scale: float = 1.0
    #: a loss scaler is attached (set by the DDP hook; in every Context): fp16/bf16 overflows become Inf, not saturated
    loss_scaler: bool = False

    def context(self, key: str, step: int) -> Context:
        """The Context of ``key`` at the caller's ``step``: every one the engine builds, and those an
        algorithm builds for its own exchanges (gossip's codec). Its step is the counted one
        (:meth:`~gradpress.exchange.nonfinite.StepGuard.counted`: a dropped step does not count), so a random
        compressor draws after a dropped step k what a run without it draws at step k."""
        return Context(key, self.guard.counted(step), self.rank, self.world_size, self.seed,
                       loss_scale=self.output_scale, loss_scaler=self.loss_scaler)

    def _snapshot_state(self) -> dict[str, Any] | None:
        """The compressor's and strategies' own state (residuals are staged,
        never snapshotted), or None when there is none. A compressor that
        gives its :meth:`~gradpress.compress.Compressor.live_state` has its
        tensors copied into the buffers of the step before
        (``guard.kept``: reused while each keeps its shape, dtype and
        device, allocated otherwise; dropped when the mode stops taking
        copies): no allocation per step. Else one copy of each tensor, the
        one ``state_dict`` takes where it declares ``state_dict_copies``
        (only the containers are copied again), or a deep copy of what it
        returns (it may hold live buffers). A snapshot lives for its step
        only (the next one overwrites the kept buffers); restoring it goes
        through ``load_state_dict``, which copies, so the live state never
        shares a buffer with it."""
        live = self.compressor.live_state()
        if live is None:
            comp, strats = self._owned_state()
        else:
            comp = self.guard.kept = copy_into(live, self.guard.kept)
            strats = {n: _own(st.state_dict(), st.state_dict_copies) for n, st in self.strategies.items()}
        if not comp and not any(strats.values()):
            return None
        return {"compressor": comp, "strategies": strats}

    def _owned_state(self) -> tuple[Any, dict[str, Any]]:
        """The compressor's and each strategy's ``state_dict``, owned: one copy of each tensor (see
        :meth:`_snapshot_state`)."""
        comp = _own(self.compressor.state_dict(), self.compressor.state_dict_copies)
        return comp, {n: _own(st.state_dict(), st.state_dict_copies) for n, st in self.strategies.items()}

    def _restore_state(self, snapshot: Mapping[str, Any]) -> None:
        """Put the snapshot back; ``load_state_dict`` copies its tensors, so the
        live state never shares one with it (a later bad step restores its own)."""
        self.compressor.load_state_dict(snapshot["compressor"])
        for name, st in snapshot["strategies"].items():
            self.strategies[name].load_state_dict(st)

    def rescale(self, factor: float) -> None:
        """Multiply every state kept in the gradient's units by ``factor``, in place and in one fused pass:
        every residual of the feedback store (the worker's, a ring's, a PS root's) and the compressor's
        :meth:`~gradpress.compress.Compressor.gradient_state`. For a loss scale that changed from ``old``
        to ``new`` (``factor = new / old``; the DDP hook's ``scaler``); between steps (nothing staged)."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) \
                or factor <= 0:
            raise ValueError(f"rescale: factor must be a finite number > 0, got {factor!r}")
        if factor == 1:
            return
        seen: set[int] = set()
        held = [t for t in [*self.feedback.residuals.values(), *self.compressor.gradient_state()]
                if id(t) not in seen and not seen.add(id(t))]  # a tensor held twice is multiplied once
        if held:
            torch._foreach_mul_(held, float(factor))

    def memory_bytes(self) -> dict[str, int]:
        """Extra memory kept, in bytes: ``residuals`` (the worker's error
        feedback), ``compressor`` (its own state: momentum, factors...),
        ``strategies`` (ring hop and PS root residuals, root assignment
        excluded) and their ``total``."""
        out = {
            "residuals": self.feedback.nbytes(WORKER),
            "compressor": self.compressor.state_nbytes(),  # counted on the live buffers, no copy
            "strategies": self.feedback.nbytes() - self.feedback.nbytes(WORKER),
        }
        out["total"] = sum(out.values())
        return out

    def state_dict(self) -> dict[str, Any]:
        """All exchange state: config, residuals (every namespace),
        compressor and strategy state, plan, stats."""
        return {
            "format": STATE_FORMAT,
            "config": self.config(),
            "feedback": self.feedback.state_dict(),
            "compressor": self.compressor.state_dict(),
            "strategies": {n: st.state_dict() for n, st in self.strategies.items()},
            "plan": self.plan.to_dict(),
            "stats": self.stats_counter.state_dict(),
            "rank": self.rank,
            "keys": KEYS_FORMAT,
            "dropped_steps": self.guard.dropped,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Refuses a state of another
        configuration (compressor, strategy, world size, parameters...) or
        of another rank (residuals differ between ranks).

        Validates fully, then changes: a malformed state (a missing or
        mistyped part) raises ValueError naming the part, and leaves this
        engine exactly as it was (a part that fails while loading is rolled
        back: :class:`~gradpress.exchange.rollback.Rollback`)."""
        state = self.loadable_state(state)
        with Rollback(self.load_backup, self.restore_backup, "gradpress state dict") as rollback:
            self.load_checked(state, rollback)

    def loadable_state(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
        """``state`` checked (format, form, configuration, rank, and every residual and compressor buffer
        one this engine uses: :mod:`gradpress.exchange.state_check`; ValueError, nothing changed) and with
        today's keys; what :meth:`load_checked` loads."""
        from gradpress.exchange.agree import config_diff, same_config

        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            found = repr(state.get("format")) if isinstance(state, Mapping) else f"a {type(state).__name__}"
            raise ValueError(f"not a gradpress exchange state dict (format {found}; allowed: {STATE_FORMAT!r})")
        check_form(state)
        theirs, mine = state["config"], self.config()
        if not same_config(theirs, mine):
            raise ValueError(f"gradpress state dict is from a different configuration ({config_diff(theirs, mine)})")
        if state.get("rank", self.rank) != self.rank:
            raise ValueError(f"gradpress state dict: rank: saved by rank {state['rank']}, loaded on rank {self.rank}; "
                             "the compression state is per rank (residuals differ between ranks): save each rank's "
                             "state_dict() (e.g. to a file named with dist.get_rank()) and load its own on every "
                             "rank; nothing was loaded")
        state = upgrade_keys(state, [p[0] for p in self.params])  # one written before keys were escaped
        check_contents(state, self.params, self.compressor)  # nothing kept that this engine cannot use
        return state

    def load_checked(self, state: Mapping[str, Any], rollback: Rollback[Any], prefix: str = "") -> None:
        """Load a :meth:`loadable_state` part by part, naming each in ``rollback.part`` (after ``prefix``);
        inside a :class:`~gradpress.exchange.rollback.Rollback` whose backup holds :meth:`load_backup`."""
        from gradpress.exchange.base import same_strategy

        rollback.part = prefix + "feedback"
        self.feedback.load_state_dict(state["feedback"])
        rollback.part = prefix + "compressor"
        self.compressor.load_state_dict(state["compressor"])
        for name, st in state.get("strategies", {}).items():
            # an earlier version's name for the same strategy (its defaults written out)
            name = next((n for n in self.strategies if same_strategy(name, n, self.world_size)), name)
            if name in self.strategies:
                rollback.part = f"{prefix}strategies[{name!r}]"
                self.strategies[name].load_state_dict(st)
        rollback.part = prefix + "plan"
        if state.get("plan") and self.strategy_name == "auto":
            # keep the partitions the residuals are keyed by
            self.plan = self.choice.plan_from_dict(state["plan"], self.plan)
        rollback.part = prefix + "stats"
        self.stats_counter.load_state_dict(state.get("stats", {}))
        self.guard.dropped = state.get("dropped_steps", 0)  # a state written before the count: none

    def load_backup(self) -> dict[str, Any]:
        """What :meth:`restore_backup` puts back, one copy of each tensor: the feedback store's ``state_dict``
        (it clones the residuals), the compressor's and strategies' owned (:meth:`_owned_state`), the stats,
        the plan (an object the load replaces, never changes)."""
        comp, strats = self._owned_state()
        return {"feedback": self.feedback.state_dict(), "compressor": comp, "strategies": strats,
                "stats": copy.deepcopy(self.stats_counter.state_dict()), "plan": self.plan,
                "dropped_steps": self.guard.dropped}

    def restore_backup(self, backup: Mapping[str, Any]) -> None:
        """Put back what :meth:`load_backup` took (this engine's own earlier state)."""
        self.feedback.load_state_dict(backup["feedback"])
        self.compressor.load_state_dict(backup["compressor"])
        for name, st in backup["strategies"].items():
            self.strategies[name].load_state_dict(st)
        self.plan = backup["plan"]
        self.stats_counter.load_state_dict(backup["stats"])
        self.guard.dropped = backup["dropped_steps"]


def _own(state: Any, copies: bool) -> Any:
    """``state`` as a snapshot keeps it: ``copies`` (its tensors are the
    caller's own): its containers copied, tensors as they are, other leaves
    deep-copied; else a deep copy of the whole."""
    if not copies:
        return copy.deepcopy(state)
    if isinstance(state, Mapping):
        return {k: _own(v, True) for k, v in state.items()}
    if type(state) in (list, tuple):
        return type(state)(_own(v, True) for v in state)
    return state if isinstance(state, torch.Tensor) else copy.deepcopy(state)


def copy_into(live: Any, kept: Any) -> Any:
    """``live`` (nested dicts, lists, tuples of tensors and plain values) copied into ``kept`` (the result of
    the call before, or None): a tensor into the kept one at its place when shape, dtype, device and strides
    match (``copy_``, no allocation), else into a new one (``clone``); other values deep-copied. Entries
    ``live`` no longer has are dropped (their buffers freed)."""
    if isinstance(live, torch.Tensor):
        if isinstance(kept, torch.Tensor) and kept.shape == live.shape and kept.dtype == live.dtype \
                and kept.device == live.device and kept.stride() == live.stride():
            return kept.copy_(live)
        return live.clone()
    if isinstance(live, Mapping):
        old = kept if isinstance(kept, Mapping) else {}
        return {k: copy_into(v, old.get(k)) for k, v in live.items()}
    if type(live) in (list, tuple):
        old = kept if type(kept) is type(live) and len(kept) == len(live) else [None] * len(live)
        return type(live)(copy_into(v, o) for v, o in zip(live, old))
    return copy.deepcopy(live)
