"""An algorithm's exchange helpers: what :class:`~gradpress.algorithms.base.Algorithm`
subclasses call inside their :meth:`~gradpress.algorithms.base.Algorithm.step`.

:class:`ExchangeHelpers` is a mixin of :class:`~gradpress.algorithms.base.Algorithm`
(which builds everything these read: the model, optimizer, group, engine and
step counters) and is imported from there; it is kept apart from the
contract (construction, configuration, state, stats) so that each module
stays short:

* :meth:`~ExchangeHelpers.local_step`, :meth:`~ExchangeHelpers.gradients`:
  the local optimizer step (counted as one of plain DDP's) and the gradients
  every rank exchanges;
* :meth:`~ExchangeHelpers.sync`, :meth:`~ExchangeHelpers.average_plain`:
  averaging through the engine (compressed, counted as an exchange) and
  uncompressed (buffers), bytes counted;
* :meth:`~ExchangeHelpers.ddp_step`: DDP's synchronous step (the synchronous
  phase of ``postlocalsgd`` and ``switch``), with ``nonfinite``'s skip and
  raise for the buffers;
* :meth:`~ExchangeHelpers.broadcast_model`,
  :meth:`~ExchangeHelpers.consensus_model`: rank 0's model to every rank,
  the average model for evaluation.
"""

from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gradpress.algorithms.presence import sync_agreeing
from gradpress.algorithms.sync_guard import SyncGuard
from gradpress.exchange import Synchronizer
from gradpress.transport.collectives import flat_by_dtype, fused_allreduce
from gradpress.transport.p2p import global_rank

if TYPE_CHECKING:
    from gradpress.algorithms.alarm import StateAlarm
    from gradpress.algorithms.loss_scale import AlgorithmScale
    from gradpress.algorithms.restart import LocalCopy

__all__ = ["HELPER_PREFIX", "ExchangeHelpers"]

#: the prefix of the library's helper keys, which ride in an exchange without being registered in
#: ``exchanged_params()`` (1-D flags, sent plain: presence, ``nonfinite='raise'``'s, local SGD's state-missing)
HELPER_PREFIX = "gradpress/"


class ExchangeHelpers:
    """The exchange helpers of :class:`~gradpress.algorithms.base.Algorithm`
    (a mixin: the attributes below are set by ``Algorithm.__init__``)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    group: dist.ProcessGroup | None
    world_size: int
    named: list[tuple[str, torch.nn.Parameter]]
    engine: Synchronizer | None
    _steps: int
    _exchanges: int
    _last: dict[str, int]
    _consensus: torch.nn.Module | None
    loss_scale: AlgorithmScale | None = None
    #: ``nonfinite='skip'``: this rank's copy of the optimizer state and buffers at the last agreed point
    #: (:mod:`gradpress.algorithms.restart`; the model-averaging algorithms set it), which :meth:`ddp_step`
    #: also keeps for the buffers
    restart: LocalCopy | None = None
    #: ``nonfinite='raise'``: the optimizer state and buffers a synchronization checks
    #: (:mod:`gradpress.algorithms.alarm`; the model-averaging algorithms set it; :meth:`ddp_step`: the buffers)
    alarm: StateAlarm | None = None

    def local_step(self) -> None:
        """The local optimizer step, counted as a step of plain DDP's traffic. With a loss scaler
        (:mod:`gradpress.algorithms.loss_scale`) plain AMP's ``scaler.step`` (skipped when this rank's
        gradient overflowed, or, after :meth:`ddp_step`'s agreement, some rank's) and ``scaler.update``."""
        if self.loss_scale is not None:
            self.loss_scale.step()
        else:
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
        raise, before the buffers are averaged.

        With a loss scaler the gradients are unscaled first (the engine and its residuals work in gradient
        units) and the engine's verdict of the exchange (``nonfinite='propagate'``: an overflow on one rank
        is NaN on every rank) is the scaler's found-inf flag on every rank, so every rank skips the step
        and backs off (:meth:`~gradpress.algorithms.loss_scale.AlgorithmScale.agree`)."""
        if self.loss_scale is not None:
            self.loss_scale.unscale()
        grads = self.gradients()
        self._last["bytes"] = self._last["host"] = 0
        # nonfinite: a buffer newly non-finite on this rank drops (skip) or fails (raise) the step on every rank;
        # the optimizer state is identical on every rank here (idx=[]: not checked)
        guard = SyncGuard.before(self, grads, idx=[], buffers=True)
        present = sync_agreeing(self, grads, [p.grad is not None for _, p in self.named], keys, guard.extra)
        guard.check(f"step {self._steps + 1}")
        if self.loss_scale is not None:
            assert self.engine is not None
            self.loss_scale.agree(self.engine.guard.last_bad)
        for (_, p), g, some in zip(self.named, grads, present or []):
            if p.grad is None and some:
                p.grad = g
        skipped = present is None
        guard.settle(list(self.model.buffers()))  # dropped: the buffers back to their copy; else averaged
        sent, host = self._last["bytes"], self._last["host"]
        if skipped:  # nonfinite=skip dropped this step on every rank: DDP skips the optimizer step too
            self._steps += 1
            self._reset_last()
        else:
            self.local_step()
        self._last["bytes"], self._last["host"] = sent, host

    def sync(self, tensors: list[torch.Tensor], keys: list[str] | None = None) -> None:
        """Average ``tensors`` (keyed by parameter name by default) over the
        group through the engine, in place; counts one exchange. Every key
        is one that ``exchanged_params()`` registers (the engine plans them
        and the ranks agree on them) or a library helper key under
        :data:`HELPER_PREFIX` (1-D flags riding in the exchange); another
        raises ``ValueError`` naming it, before any collective."""
        assert self.engine is not None
        keys = keys if keys is not None else [n for n, _ in self.named]
        known = {k for k, _, _ in self.engine.params}
        unknown = [k for k in keys if k not in known and not k.startswith(HELPER_PREFIX)]
        if unknown:
            names = [k for k, _, _ in self.engine.params]
            shown = ", ".join(map(repr, names[:6])) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
            raise ValueError(
                f"algorithm {getattr(self, 'name', type(self).__name__)!r}: sync key {unknown[0]!r} is not "
                "registered by exchanged_params() (an unregistered key would get the engine's default plan and "
                f"be left out of the ranks' agreement); allowed: a key exchanged_params() returns ({shown}), "
                f"or a helper key under {HELPER_PREFIX!r}")
        before = self.engine.stats
        self.engine.sync(keys, tensors, step=self._exchanges)
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
