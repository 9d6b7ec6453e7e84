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
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from gradpress.algorithms.alarm import STATE_FLAGS_KEY
from gradpress.algorithms.presence import sync_agreeing
from gradpress.compress import Compressor, create
from gradpress.compress.base import Param
from gradpress.compress.spec import coerce_params
from gradpress.exchange import Synchronizer
from gradpress.exchange.agree import agree, config_diff, same_config
from gradpress.transport.collectives import flat_by_dtype, fused_allreduce
from gradpress.transport.groups import own_group
from gradpress.transport.p2p import global_rank

if TYPE_CHECKING:
    from gradpress.algorithms.alarm import StateAlarm
    from gradpress.algorithms.restart import LocalCopy

__all__ = ["Algorithm", "Preflight", "STATE_FORMAT"]

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


class Algorithm:
    """Base class. Subclasses set ``name``, ``PARAMS``, ``summary`` (and
    ``default_compressor`` when not ``none``) and implement :meth:`step`;
    they may add state through :meth:`extra_state` / :meth:`load_extra_state`.

    Keyword options shared by every algorithm: ``compressor`` (spec or
    instance; None: ``default_compressor``), ``error_feedback`` (None: the
    compressor's default), ``strategy`` (default ``collective``: every
    eligible tensor compressed as asked; ``auto`` measures the group and
    plans per tensor, as the DDP hook does), ``min_numel``, ``seed``,
    ``nonfinite``, ``process_group`` (default: the world), ``timeout``.
    """

    name: ClassVar[str] = ""
    PARAMS: ClassVar[tuple[Param, ...]] = ()
    summary: ClassVar[str] = ""
    default_compressor: ClassVar[str] = "none"
    #: ``nonfinite='skip'``: this rank's copy of the optimizer state and buffers at the last agreed point
    #: (:mod:`gradpress.algorithms.restart`; the model-averaging algorithms set it), which :meth:`ddp_step`
    #: also keeps for the buffers
    restart: LocalCopy | None = None
    #: ``nonfinite='raise'``: the optimizer state and buffers a synchronization checks
    #: (:mod:`gradpress.algorithms.alarm`; the model-averaging algorithms set it; :meth:`ddp_step`: the buffers)
    alarm: StateAlarm | None = None

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
        try:  # everything a rank can get wrong alone, before the agreement every rank reaches
            if error is not None:
                raise ValueError(error)
            self._check_inputs(model, optimizer)
            self._set_params(params)
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
            self.setup()
        except Exception as exc:  # noqa: BLE001 - every rank must reach agree(), or the others hang
            error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        agree(self.config() if error is None else None, error, self.group, what=f"algorithm {self.name!r}")
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

    @torch.no_grad()
    def consensus_model(self) -> torch.nn.Module:
        """A copy of the model holding the average over ranks of the current
        parameters and floating buffers (collective; the local state is not
        touched). Evaluation traffic: not counted in ``stats``, as DDP's
        evaluation is not."""
        if self.world_size == 1:
            return self.model
        if self._consensus is None:
            self._consensus = copy.deepcopy(self.model)
            for p in self._consensus.parameters():
                p.requires_grad_(False)
                p.grad = None
        src = [p.detach() for p in self.model.parameters()] + [b for b in self.model.buffers() if b.is_floating_point()]
        dst = list(self._consensus.parameters()) + [b for b in self._consensus.buffers() if b.is_floating_point()]
        summed, _ = fused_allreduce([t / self.world_size for t in src], self.group)
        for d, s in zip(dst, summed):
            d.copy_(s)
        return self._consensus

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`extra_state`."""

    # ------------------------------------------------------------- helpers
    def local_step(self) -> None:
        """The local optimizer step, counted as a step of plain DDP's traffic."""
        self.optimizer.step()
        self._steps += 1
        self._reset_last()

    def _reset_last(self) -> None:
        """Start the per-step counts of a new step (what ``stats`` reports as the last step)."""
        self._last = {"bytes": 0, "host": 0}

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's local gradient (zeros where ``.grad`` is None, so
        every rank exchanges the same tensors)."""
        return [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self.named]

    @torch.no_grad()
    def ddp_step(self, keys: list[str] | None = None) -> None:
        """DDP's step: average the gradients through the engine (keyed as
        :meth:`sync`), average the floating buffers, then the (identical)
        local optimizer step; the step's bytes are those of the averaging.
        A step the engine skipped (``nonfinite=skip``: some rank's gradient
        was not finite) counts as a step but leaves the optimizer alone on
        every rank (parameters and momentum untouched), as DDP's loop does.
        A parameter whose ``.grad`` is None on some ranks gets the mean with
        zeros there; on every rank, its ``.grad`` stays None, so the optimizer
        skips it (no momentum, no weight decay), as DDP leaves it: one flag per
        parameter rides in the same exchange
        (:func:`~gradpress.algorithms.presence.sync_agreeing`).

        With :attr:`restart` (``nonfinite=skip``) a floating buffer that is
        not finite on some rank (BatchNorm statistics overflowed under
        autocast) drops the step too, while its copy is finite
        (:meth:`~gradpress.algorithms.restart.LocalCopy.flag_into`), and a
        dropped step puts every rank's buffers back to their copy, the
        previous step's average (the step never happened: its forward
        passes' statistics go with it; averaging them carried an Inf buffer,
        or the dropped step's statistics, to every rank); a step that goes
        through refreshes the copy (one copy of the buffers per step). With
        :attr:`alarm` (``nonfinite='raise'``) such a buffer makes every rank
        raise, before the buffers are averaged."""
        grads = self.gradients()
        self._last["bytes"] = self._last["host"] = 0
        kept = self.restart
        if kept is not None:  # a buffer newly non-finite on this rank: every rank drops the step
            kept.flag_into(grads, idx=[], buffers=True)
        alarm = self.alarm.flags(grads[0], idx=[]) if self.alarm is not None else None
        present = sync_agreeing(self, grads, [p.grad is not None for _, p in self.named], keys,
                                [(STATE_FLAGS_KEY, alarm)] if alarm is not None else [])
        if self.alarm is not None:
            self.alarm.check(alarm, f"step {self._steps + 1}", idx=[])
        for (_, p), g, some in zip(self.named, grads, present or []):
            if p.grad is None and some:
                p.grad = g
        skipped = present is None
        if skipped and kept is not None:
            kept.restore(idx=[], buffers=True)
        else:
            self.average_plain(list(self.model.buffers()))
            if kept is not None:
                kept.take(idx=[], buffers=True)
        sent, host = self._last["bytes"], self._last["host"]
        if skipped:  # nonfinite=skip dropped this step on every rank: DDP skips the optimizer step too
            self._steps += 1
            self._reset_last()
        else:
            self.local_step()
        self._last["bytes"], self._last["host"] = sent, host

    def sync(self, tensors: list[torch.Tensor], keys: list[str] | None = None) -> None:
        """Average ``tensors`` (keyed by parameter name by default) over the
        group through the engine, in place; counts one exchange."""
        assert self.engine is not None
        before = self.engine.stats
        self.engine.sync(keys if keys is not None else [n for n, _ in self.named], tensors, step=self._exchanges)
        self._exchanges += 1
        after = self.engine.stats
        self._last["bytes"] += after["bytes_sent"] - before["bytes_sent"]
        self._last["host"] += after["host_bytes"] - before["host_bytes"]

    def average_plain(self, tensors: list[torch.Tensor]) -> None:
        """Average ``tensors`` uncompressed (buffers such as BatchNorm
        statistics), in place; the bytes are counted."""
        floats = [t for t in tensors if t.is_floating_point() and t.numel()]
        if not floats or self.engine is None:
            return
        t0 = time.perf_counter()
        summed, sent = fused_allreduce([t / self.world_size for t in floats], self.group)
        for t, s in zip(floats, summed):
            t.copy_(s)
        self.engine.stats_counter.record(sent=sent, dense=0, compress_s=0.0, comm_s=time.perf_counter() - t0,
                                         compressed=0, plain=0, tensor_bytes={}, end_of_step=False,
                                         by_strategy={"uncompressed": sent})
        self._last["bytes"] += sent

    @torch.no_grad()
    def broadcast_model(self) -> None:
        """Every rank takes rank 0's parameters and buffers (one fused
        broadcast per dtype, as DDP does at construction)."""
        if self.world_size == 1:
            return
        tensors = [p for _, p in self.model.named_parameters()] + [b for b in self.model.buffers()]
        tensors = [t for t in tensors if t.numel()]
        flats, views = flat_by_dtype(tensors)
        for flat in flats:
            dist.broadcast(flat, global_rank(self.group, 0), group=self.group)
        for t, v in zip(tensors, views):
            t.copy_(v)

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
        return {
            "format": STATE_FORMAT, "config": self.config(), "steps": self._steps, "exchanges": self._exchanges,
            "exchange": self.engine.state_dict(), "extra": self.extra_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`; refuses another configuration."""
        assert self.engine is not None
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            found = repr(state.get("format")) if isinstance(state, Mapping) else f"a {type(state).__name__}"
            raise ValueError(f"not a gradpress algorithm state dict (format {found}; allowed: {STATE_FORMAT!r})")
        if not same_config(state["config"], self.config()):
            raise ValueError(f"algorithm state dict is from a different configuration "
                             f"({config_diff(state['config'], self.config())})")
        self.engine.load_state_dict(state["exchange"])
        self._steps = int(state["steps"])
        self._exchanges = int(state["exchanges"])
        self.load_extra_state(state.get("extra", {}))

    def close(self) -> None:
        """Nothing runs in the background here; kept for the training loop's contract."""

    def __repr__(self) -> str:
        return f"<algorithm {self.spec()} compressor={self.compressor.spec() if self.engine else '?'}>"
