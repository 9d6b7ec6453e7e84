"""Leader SGD's election (:mod:`gradpress.algorithms.lsgd`): each rank's
running training loss, and the leaders every rank picks from all of them.

:class:`Election` is a mixin of :class:`~gradpress.algorithms.lsgd.LSGD`
(which sets the attributes declared below in ``setup``) through the pulls
(:mod:`gradpress.algorithms.lsgd_pull`, whose every pull starts with an
election), kept apart from them and from the algorithm's configuration and
state so that each module stays short. Its :meth:`Election._count` records
the bytes every LSGD collective sends.

The training loss reaches :meth:`Election.observe` from ``step(loss)`` or,
when the loop calls ``step()`` without it, from ``loss.backward()``
(:meth:`Election.observe_backward`: unscaled under a loss scaler): the
forward hook :meth:`Election._tag` tags the model's output in training mode
(a ``torch.Tensor`` subclass, values and autograd unchanged) so that the
scalar computed from it reports itself when ``backward()`` is called on it.

Invariant: every rank elects the same leaders (Teng et al. 2019: the worker
with the lowest running loss; ties: the lowest rank; a NaN loss never leads
unless every loss is NaN): one allgather of the running losses, then every
rank decides from the same vector.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gradpress.exchange import Synchronizer

if TYPE_CHECKING:
    from gradpress.algorithms.loss_scale import AlgorithmScale
from gradpress.transport.groups import device_of


class Election:
    """The running loss and the election of :class:`~gradpress.algorithms.lsgd.LSGD`
    (a mixin: the attributes below are set by ``Algorithm.__init__`` and ``LSGD.setup``)."""

    name: str
    group: dist.ProcessGroup | None
    world_size: int
    groups: int
    window: int
    _probe: type[torch.Tensor]
    #: losses seen in this step (sum, count) and step means since the election (sum, count)
    _seen: list[Any]
    _window: list[Any]
    #: with window > 0: the last `window` step means
    _recent: list[torch.Tensor]
    leaders: dict[str, Any]
    last_losses: torch.Tensor
    engine: Synchronizer | None
    _last: dict[str, int]
    loss_scale: AlgorithmScale | None

    # ------------------------------------------------------------------ loss
    def _tag(self, module: torch.nn.Module, inputs: Any, output: Any) -> Any:
        if module.training and torch.is_grad_enabled() and type(output) is torch.Tensor:
            return output.as_subclass(self._probe)
        return None

    def observe_backward(self, loss: torch.Tensor) -> None:
        """A loss captured from ``backward()`` (the probe's sink): under a loss scaler (``scaler=``) the root of
        the loop's ``scaler.scale(loss).backward()`` is the scaled loss, so it is unscaled first; ranks whose
        scales differ (a local overflow backs off one rank's) then elect on the same quantity."""
        self.observe(loss if self.loss_scale is None else self.loss_scale.unscaled_loss(loss))

    def observe(self, loss: torch.Tensor) -> None:
        """Count one training loss of this step (gradient accumulation: several)."""
        value = loss.detach().reshape(()).to(torch.float64)
        self._seen[0] = value if self._seen[0] is None else self._seen[0] + value
        self._seen[1] += 1

    def _take_step_loss(self, loss: torch.Tensor | None) -> None:
        """Close this step's losses: their mean joins the running loss of the
        election (``loss``: this step's, else those captured from ``backward()``)."""
        if loss is not None:
            self._seen = [None, 0]
            self.observe(loss)
        if not self._seen[1]:
            raise RuntimeError(f"algorithm {self.name!r} needs the training loss: call step(loss), or compute "
                               "the loss from the model's output in training mode and call backward() on it")
        mean = self._seen[0] / self._seen[1]
        self._window = [mean if self._window[0] is None else self._window[0] + mean, self._window[1] + 1]
        if self.window:
            self._recent = [*self._recent, mean][-self.window:]
        self._seen = [None, 0]

    # ---------------------------------------------------------------- leaders
    def elect(self) -> torch.Tensor:
        """Gather every rank's running loss (one allgather); set ``leaders``."""
        device = device_of(self.group)
        mine = (self._window[0] / self._window[1] if self._window[1] else torch.tensor(math.nan, dtype=torch.float64))
        if self.window and self._recent:
            mine = torch.stack(self._recent).mean()
        self._window = [None, 0]
        losses = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(self.world_size)]
        dist.all_gather(losses, mine.reshape(()).to(device), group=self.group)
        self._count(8)
        values = [float(v) for v in losses]
        # NaN after every number, +inf included: a NaN loss never leads unless every loss is NaN
        key = [(math.isnan(v), v if not math.isnan(v) else 0.0, r) for r, v in enumerate(values)]
        size = self.world_size // self.groups
        self.leaders = {"global": min(key)[-1],
                        "local": [min(key[g * size:(g + 1) * size])[-1] for g in range(self.groups)]}
        self.last_losses = torch.tensor(values, dtype=torch.float64)
        return self.last_losses

    def _count(self, sent: int, end_of_step: bool = False) -> None:
        """``sent`` bytes handed to a collective, in the engine's stats (``end_of_step``: an exchange ends)."""
        assert self.engine is not None
        self.engine.stats_counter.record(sent=sent, dense=0, compress_s=0.0, comm_s=0.0, compressed=0, plain=0,
                                         tensor_bytes={}, end_of_step=end_of_step)
        self._last["bytes"] += sent
