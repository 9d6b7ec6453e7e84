"""The algorithm contract: optimizer-level methods over the exchange engine.

An algorithm wraps a model and its (local) optimizer. The user's loop stays
the same: ``loss.backward()`` then ``algo.step()``, which runs the local
optimizer step and this algorithm's exchange (parameters every H steps for
local SGD and DiLoCo, model differences to graph neighbours for gossip...)
through the same :class:`~gradpress.exchange.Synchronizer` as the DDP hook,
with any compressor, error feedback, the NaN/Inf protocol, stats and
checkpointable state. Modelled on PyTorch's ``model_averaging`` (averagers
as siblings of the comm hooks).

Invariants:

* Every rank starts from rank 0's parameters (broadcast at construction,
  as DDP does) and every rank agrees on the configuration (checked at
  construction on every rank, naming the field).
* ``stats`` uses the hook's vocabulary (:data:`~gradpress.exchange.STATS_KEYS`):
  ``steps`` counts optimizer steps, ``dense_bytes`` is what plain DDP would
  have handed to its allreduce for the same steps (every parameter's
  gradient, every step), so ``ratio`` compares across algorithms and
  compressors; ``exchanges`` counts the steps that communicated.
* ``state_dict()`` holds everything this rank needs to continue exactly
  (residuals, anchors, outer optimizer state), loadable with
  ``torch.load(..., weights_only=True)``; the local optimizer's state is
  the caller's to save, as with DDP.
"""

from __future__ import annotations

import copy
import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from gradpress.algorithms.exchange_helpers import ExchangeHelpers
from gradpress.algorithms.loss_scale import AlgorithmScale, check_scaler
from gradpress.compress import Compressor, create
from gradpress.compress.base import Param
from gradpress.compress.spec import close_to, coerce_params
from gradpress.exchange import Synchronizer
from gradpress.exchange.agree import agree, config_diff, same_config
from gradpress.exchange.reshard import Fold, fold_config, fold_leaves, refuse, rule
from gradpress.exchange.rollback import Rollback
from gradpress.transport.groups import own_group

__all__ = ["Algorithm", "Preflight", "STATE_FORMAT", "OPTIONS"]

#: the keyword options every algorithm takes besides its ``PARAMS`` (the keywords of :meth:`Algorithm.__init__`)
OPTIONS = ("compressor", "error_feedback", "strategy", "min_numel", "seed", "nonfinite", "process_group", "timeout",
           "scaler")

STATE_FORMAT = "gradpress-algorithm/1"


@dataclass(frozen=True)
class Preflight:
    """What is known of a run before any worker starts (``gradpress
    train``'s configuration), for :meth:`Algorithm.preflight`.
    ``world_size`` is None where the launcher does not know it yet."""

    optimizer: type[torch.optim.Optimizer]
    compressor: Compressor
    strategy: str
    nonfinite: str
    world_size: int | None


class Algorithm(ExchangeHelpers):
    """Base class. Subclasses set ``name``, ``PARAMS``, ``summary`` (and
    ``default_compressor`` when not ``none``) and implement :meth:`step`;
    they may add state through :meth:`extra_state` / :meth:`load_extra_state`.

    Keyword options shared by every algorithm: ``compressor`` (spec or
    instance; None: ``default_compressor``), ``error_feedback`` (None: the
    compressor's default), ``strategy`` (default ``collective``: every
    eligible tensor compressed as asked; ``auto`` measures the group and
    plans per tensor, as the DDP hook does), ``min_numel``, ``seed``,
    ``nonfinite``, ``process_group`` (default: the world), ``timeout``,
    ``scaler`` (a ``torch.amp.GradScaler`` for fp16 autocast, every rank or none; refused with the reason
    where :attr:`scaler_refusal` says: :mod:`gradpress.algorithms.loss_scale`).

    The helpers a subclass's :meth:`step` calls (``local_step``, ``gradients``,
    ``sync``, ``average_plain``, ``ddp_step``, ``broadcast_model``,
    ``consensus_model``) and the ``restart`` and ``alarm`` attributes come from
    :class:`~gradpress.algorithms.exchange_helpers.ExchangeHelpers`.
    """

    name: ClassVar[str] = ""
    PARAMS: ClassVar[tuple[Param, ...]] = ()
    summary: ClassVar[str] = ""
    default_compressor: ClassVar[str] = "none"
    #: why a checkpoint of this algorithm cannot be resumed on another world size (None: its state folds by
    #: the generic rule of :mod:`gradpress.exchange.reshard`: replicated kept, per-rank floating state averaged)
    reshard_refusal: ClassVar[str | None] = None
    #: why ``scaler=`` (fp16 loss scaling) is refused (None: taken; :mod:`gradpress.algorithms.loss_scale`)
    scaler_refusal: ClassVar[str | None] = None

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        compressor: str | Compressor | None = None,
        error_feedback: bool | None = None,
        strategy: str = "collective",
        min_numel: int = 1024,
        seed: int = 0,
        nonfinite: str = "propagate",
        process_group: dist.ProcessGroup | None = None,
        timeout: float | datetime.timedelta | None = None,
        scaler: Any = None,
        **params: Any,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.group, error = own_group(process_group, timeout)
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self._steps = 0
        self._exchanges = 0
        self._last = {"bytes": 0, "host": 0}
        self._consensus: torch.nn.Module | None = None
        self.engine: Synchronizer | None = None
        #: the loss scaler (``scaler=``, fp16 autocast) this algorithm unscales, agrees and steps; None: none
        self.loss_scale = AlgorithmScale(scaler, optimizer) if scaler is not None else None
        try:  # everything a rank can get wrong alone, before the agreement every rank reaches
            if error is not None:
                raise ValueError(error)
            self._check_inputs(model, optimizer)
            self._set_params(params)
            if scaler is not None:
                check_scaler(self.name, scaler, nonfinite, self.scaler_refusal)
            self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            if not self.named:
                raise ValueError(f"algorithm {self.name!r}: the model has no trainable parameter (none with "
                                 "requires_grad=True): nothing to train or synchronize; allowed: a model with at "
                                 "least one")
            self._dense_per_step = sum(p.numel() * p.element_size() for _, p in self.named)
            self.engine = Synchronizer(
                create(compressor if compressor is not None else self.default_compressor),
                params=self.exchanged_params(), group=self.group, error_feedback=error_feedback,
                strategy=strategy, min_numel=min_numel, seed=seed, nonfinite=nonfinite,
            )
            if scaler is not None:  # an overflowed step leaves no trace in the compressor's and strategies' state
                # (engine.loss_scaler stays False: the exchanged gradient is unscaled, so a value beyond an fp16
                # wire's range is no loss-scale overflow and the codec keeps its saturating bound)
                self.engine.guard.keep_on_propagate = True
            self.setup()
        except Exception as exc:  # noqa: BLE001 - every rank must reach agree(), or the others hang
            error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        # whether a scaler is given is agreed here, not in config() (a checkpoint's: it resumes with or without)
        agree({**self.config(), "scaler": scaler is not None} if error is None else None, error, self.group,
              what=f"algorithm {self.name!r}", stage="construction",
              hints={"scaler": "give scaler= on every rank or on none (an overflow must skip the step everywhere)"})
        assert self.engine is not None
        if self.engine.strategy_name == "auto":
            self.engine.replan()  # collective: every rank measures together, rank 0 fits
        self.broadcast_model()
        self.after_broadcast()

    # ------------------------------------------------------------ parameters
    def _check_inputs(self, model: Any, optimizer: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"algorithm {self.name!r}: model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"algorithm {self.name!r}: optimizer must be a torch.optim.Optimizer, "
                             f"got {type(optimizer).__name__}")
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError(f"algorithm {self.name!r}: pass the plain module, not a DistributedDataParallel "
                             "(the algorithm does its own exchange)")

    def _set_params(self, params: Mapping[str, Any]) -> None:
        # A keyword that is neither a parameter nor a shared option (a typo such as ``compresor=``,
        # or ``scaler=`` copied from ``gradpress.ddp.register``): name both lists, or the message
        # would offer only the parameters and hide that ``compressor=`` exists.
        known = [p.name for p in self.PARAMS]
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise ValueError(f"algorithm {self.name!r}: unknown parameter or option {unknown[0]!r}"
                             + close_to(unknown[0], [*known, *OPTIONS])
                             + f"; allowed parameters: {', '.join(known) or 'none'}; "
                             f"allowed options: {', '.join(OPTIONS)}")
        for key, value in coerce_params(self.PARAMS, params, self.name, "algorithm").items():
            setattr(self, key, value)

    def spec(self) -> str:
        """The spec string that rebuilds this algorithm (``localsgd:period=8``)."""
        cfg = {p.name: getattr(self, p.name) for p in self.PARAMS}
        return self.name + (":" + ",".join(f"{k}={v}" for k, v in cfg.items()) if cfg else "")

    # ----------------------------------------------------------- subclassing
    @classmethod
    def preflight(cls, params: Mapping[str, Any], run: Preflight) -> None:
        """Refuse, before any worker starts, what :meth:`setup` would refuse
        knowing only ``params`` (every parameter, defaults included) and
        ``run``: the same checks, so the same messages. Default: nothing."""

    def exchanged_params(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        """The keyed tensors this algorithm averages through the engine
        (default: one per trainable parameter, keyed by its name)."""
        return [(n, p.shape, p.dtype) for n, p in self.named]

    def setup(self) -> None:
        """Validate and build extra state (runs before the agreement check)."""

    def after_broadcast(self) -> None:
        """Runs once every rank holds rank 0's parameters (anchors...)."""

    def step(self) -> None:
        """After ``loss.backward()``: the local optimizer step and this
        algorithm's exchange."""
        raise NotImplementedError

    def eval_model(self) -> torch.nn.Module:
        """The model to evaluate; algorithms whose replicas drift between
        synchronizations return :meth:`consensus_model`."""
        return self.model

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`extra_state`."""

    # ------------------------------------------------------------- reporting
    @property
    def stats(self) -> dict[str, Any]:
        """The hook's vocabulary (see the module doc) plus ``exchanges``."""
        assert self.engine is not None
        out = self.engine.stats
        out["exchanges"] = out["steps"]
        out["steps"] = self._steps
        out["dense_bytes"] = self._steps * self._dense_per_step
        out["last_step_bytes"] = self._last["bytes"]
        out["last_step_host_bytes"] = self._last["host"]
        # every step is one of DDP's: also the step before a resume (the sent bytes are this process's)
        out["last_step_dense_bytes"] = self._dense_per_step if self._steps else 0
        out["ratio"] = out["dense_bytes"] / out["bytes_sent"] if out["bytes_sent"] else 1.0
        return out

    @property
    def compressor(self) -> Compressor:
        assert self.engine is not None
        return self.engine.compressor

    @property
    def error_feedback(self) -> bool:
        assert self.engine is not None
        return self.engine.error_feedback

    @property
    def strategy_name(self) -> str:
        assert self.engine is not None
        return self.engine.strategy_name

    def describe(self) -> dict[str, Any]:
        """Fields for a run summary."""
        return {"algorithm": self.spec(), "compressor": self.compressor.spec(), "strategy": self.strategy_name,
                "error_feedback": self.error_feedback}

    def config(self) -> dict[str, Any]:
        """Everything that must agree across ranks and across a resume."""
        assert self.engine is not None
        return {"algorithm": self.spec(), **self.engine.config()}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        assert self.engine is not None
        out = {
            "format": STATE_FORMAT, "config": self.config(), "steps": self._steps, "exchanges": self._exchanges,
            "exchange": self.engine.state_dict(), "extra": self.extra_state(),
        }
        if self.loss_scale is not None and self.loss_scale.enabled:  # a resume steps and skips as this run
            out["loss_scaler"] = self.loss_scale.state_dict()
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`; refuses another configuration. All or nothing
        (:class:`~gradpress.exchange.rollback.Rollback`): a state found bad part-way (its extra state after
        the engine's had loaded, a list of the wrong length...) raises ``ValueError`` naming the part and
        leaves this algorithm as it was (engine, counters, extra state, and what :meth:`load_touches`
        names), stepping as one that never saw it."""
        assert self.engine is not None
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            found = repr(state.get("format")) if isinstance(state, Mapping) else f"a {type(state).__name__}"
            raise ValueError(f"not a gradpress algorithm state dict (format {found}; allowed: {STATE_FORMAT!r})")
        if not same_config(state["config"], self.config()):
            raise ValueError(f"algorithm state dict is from a different configuration "
                             f"({config_diff(state['config'], self.config())})")
        exchange = self.engine.loadable_state(state["exchange"])  # checked before anything changes
        # without a scaler (or a disabled one, which holds no scale) the saved scaler state is not used
        scale = self.loss_scale if self.loss_scale is not None and self.loss_scale.enabled else None
        scaled = state.get("loss_scaler") if scale is not None else None
        if scale is not None and scaled is not None:
            scale.check_state(scaled)
        with Rollback(self._load_backup, self._restore_backup, "algorithm state dict") as rollback:
            self.engine.load_checked(exchange, rollback, prefix="exchange: ")
            rollback.part = "steps"
            self._steps = int(state["steps"])
            self._exchanges = int(state["exchanges"])
            rollback.part = "extra"
            self.load_extra_state(state.get("extra", {}))
        if scale is not None and scaled is not None:  # last: checked above, nothing after it can fail
            scale.load_state_dict(scaled)

    def load_touches(self) -> list[torch.Tensor]:
        """Tensors outside :meth:`extra_state` that :meth:`load_extra_state` writes (SGP's parameters, set
        to ``x / w``): a failed load puts them back as they were. Default none."""
        return []

    def _load_backup(self) -> dict[str, Any]:
        """This algorithm's state before a load: the engine's backup (one copy), the counters, a deep copy of
        :meth:`extra_state` (it may hold live tensors that the load overwrites in place), :meth:`load_touches`."""
        assert self.engine is not None
        return {"engine": self.engine.load_backup(), "steps": self._steps, "exchanges": self._exchanges,
                "extra": copy.deepcopy(self.extra_state()),
                "touched": [t.detach().clone() for t in self.load_touches()]}

    def _restore_backup(self, backup: Mapping[str, Any]) -> None:
        assert self.engine is not None
        self.engine.restore_backup(backup["engine"])
        self._steps, self._exchanges = backup["steps"], backup["exchanges"]
        self.load_extra_state(backup["extra"])
        with torch.no_grad():
            for t, kept in zip(self.load_touches(), backup["touched"]):
                t.copy_(kept)

    @classmethod
    def reshard_refused(cls, saved: list[Mapping[str, Any]], world: int) -> str | None:
        """Why the algorithm states ``saved`` (one per saved rank) cannot be folded into ``world`` ranks, or None
        (:func:`_fold_state`). Default :attr:`reshard_refusal`; an algorithm whose state is cut by the world
        size only for some sizes (SGP's copies per graph offset) decides from both sizes."""
        return cls.reshard_refusal

    def close(self) -> None:
        """Nothing runs in the background here; kept for the training loop's contract."""

    def __repr__(self) -> str:
        return f"<algorithm {self.spec()} compressor={self.compressor.spec() if self.engine else '?'}>"


@rule(STATE_FORMAT)
def _fold_state(vals: list[Any], at: Fold) -> dict[str, Any]:
    """An algorithm's state on another world size (:mod:`gradpress.exchange.reshard`): refused when the
    algorithm's :meth:`Algorithm.reshard_refused` says why; ``config.world_size`` set to the new world; ``extra`` by the
    generic rule, named after the algorithm; ``exchange`` by the engine's rule."""
    from gradpress.algorithms.registry import get_class

    spec = vals[0]["config"].get("algorithm") if isinstance(vals[0].get("config"), Mapping) else None
    owner = f"algorithm {spec!r}"
    try:
        why = get_class(str(spec).partition(":")[0]).reshard_refused(vals, at.world)
    except ValueError:
        why = None
    if why:
        raise refuse(vals, at.at("extra", owner), why)
    out: dict[str, Any] = {}
    for key in vals[0]:
        if not all(key in v for v in vals):
            raise refuse(vals, at.at(key, owner), "present on some saved ranks only")
        if key == "config":
            out[key] = fold_config(vals, at)
        elif key == "loss_scaler":
            out[key] = _fold_scaler([v[key] for v in vals], at.at(key, owner))
        else:
            out[key] = fold_leaves([v[key] for v in vals], at.at(key, owner))
    return out


def _fold_scaler(vals: list[Any], at: Fold) -> dict[str, Any]:
    """The saved ranks' ``GradScaler`` states on another world size: the smallest scale (the ranks' scales
    differ after a local step that overflowed on some: the one that backed off is the safe one), its growth
    count restarted; the factors and interval by the generic rule (the same on every rank)."""
    if not all(isinstance(v, Mapping) and "scale" in v for v in vals):
        raise refuse(vals, at, "not a GradScaler state (with 'scale') on every saved rank")
    rest = fold_leaves([{k: x for k, x in v.items() if k not in ("scale", "_growth_tracker")} for v in vals], at)
    out = {**rest, "scale": min(float(v["scale"]) for v in vals)}
    if any("_growth_tracker" in v for v in vals):
        out["_growth_tracker"] = 0
    return out
