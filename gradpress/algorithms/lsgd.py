"""``lsgd:tau=4,c=0.75``: Leader SGD, workers pulled toward the worker with
the lowest running training loss.

LSGD (Teng et al. 2019, "Leader Stochastic Gradient Descent for Distributed
Training of Deep Learning Models"): workers train locally; every ``tau``
steps they share their running training loss (its mean since the last
election), the worker with the lowest one is the leader (ties: the lowest
rank; a NaN loss never leads unless every loss is NaN), the leader sends its
parameters and every worker moves ``x <- (1 - c) x + c x_leader``. Pulling
toward the best worker instead of the average (as local SGD or EASGD do)
keeps the workers exploring while dragging them out of worse regions.

Defaults ``tau=4, c=0.75``: of the settings measured on mnist1d-cnn with
4 workers and the workload's defaults (docs/algorithms.md, "Measured"),
the highest mean accuracy over seeds 0-2 among those sending at least 4x
fewer bytes than DDP (the paper's reference sheet had tau 8, c 0.1: 6 points
below DDP there).

Multi-leader variant (``groups=G``): ranks form G consecutive groups; every
``tau`` steps each group's *local* leader pulls its group with ``c_local``
(one broadcast inside the group: fast links, e.g. one machine), and every
``tau_global`` steps the *global* leader pulls everyone with ``c_global``;
when both are due, ``x <- x + c_local (x_l - x) + c_global (x_g - x)``.

Averaging (``average=true``, default false; one group, no compressor,
``prox=0``): the election moves every worker to
``(1 - c) mean_i(x_i) + c x_leader`` (one allreduce of ``w_i x_i``,
``w_i = (1 - c) / N + c [i = leader]``, the same bytes as local SGD's
average) instead of ``(1 - c) x + c x_leader``: all workers then hold the
same parameters, a workers' average weighted toward the leader (c = 1:
the leader's parameters exactly; c -> 0: local SGD).

Election window (``window=W``, default 0): the loss a worker reports is
the mean over its last W steps instead of the steps since the last
election (the authors' code keeps a running mean of the last 10 batches,
``avg_size``, whatever the communication period).

Per-step pull (``prox=P``, default 0): between elections every local step
also moves the worker toward the leaders' parameters of the last election,
``x <- x + (P / tau) (x_leader - x)`` (groups: ``P / tau`` toward the local
leader, ``P / tau_global`` toward the global one, from the same ``x``), so
that a period's per-step pulls add up to about ``P``. This is the paper's
pulling term ``-lambda (x - x_leader)`` of every step's update, taken after
the gradient step with the leader refreshed every ``tau`` steps, as the
authors' code does it (github.com/yunfei-teng/LSGD, ``codes/
worker_stoc_optim.py``: ``p1 / l_comm``, ``p2 / g_comm``, on by default there,
next to the jump ``c`` at each communication). Before the first election the
target is the common starting point. It costs no communication: the target
is the copy each rank already received at the election (compressed: ``ref``).

The global leader's parameters travel dense (one broadcast) with the
default compressor; with another compressor they go through the exchange
engine with error feedback: every rank keeps ``ref``, the compressed image
of the leaders' parameters (bit-identical on every rank), the leader
contributes ``N (x_leader - ref)`` and the others nothing to one engine
average, ``ref`` adds the result, and workers pull toward ``ref``.

The training loss: ``step(loss)`` takes it, or, when the loop calls
``step()`` without it (``gradpress train``), it is captured from
``loss.backward()``: in training mode the model's output is tagged (a
``torch.Tensor`` subclass, values and autograd unchanged) so that the
scalar computed from it reports itself when ``backward()`` is called on it.

``nonfinite`` must be ``propagate``: nothing LSGD exchanges is a gradient or
delta every rank checks, so ``skip`` and ``raise`` would do nothing (a
worker with one Inf gradient stays NaN: it never leads, and the pull keeps
its NaN).

Invariants: every rank elects the same leaders (one allgather of the running
losses; every rank decides from the same vector); a worker with ``c = 1``
holds the leader's parameters bit for bit after the pull; the per-step
pull's targets are bit-identical on every rank (the broadcast copy, or
``ref``); ``eval_model()`` (collective) is the same model on every rank:
the last global leader's current one (``evaluate=leader``, the default) or
the workers' average (``evaluate=average``, as the authors' code tests its
"center" model).

Modules, one job each: this one (the parameters, their checks, the
parameters' copies and the step's schedule, the checkpointed state), the
running loss and the election (:mod:`gradpress.algorithms.lsgd_election`),
the pulls and the evaluated model (:mod:`gradpress.algorithms.lsgd_pull`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from gradpress.algorithms.base import Algorithm, Preflight
from gradpress.algorithms.loss_probe import probe_class
from gradpress.algorithms.lsgd_pull import Pulls
from gradpress.algorithms.registry import register
from gradpress.compress.base import Param
from gradpress.transport.groups import timeout_of


def _unit(v: float) -> bool:
    return 0 < v <= 1


@register
class LSGD(Pulls, Algorithm):
    name = "lsgd"
    reshard_refusal = "its leaders are ranks of the saved world and it keeps one running loss per saved rank"
    PARAMS = (
        Param("tau", int, 4, "integer >= 1", lambda v: v >= 1, "steps between leader elections and pulls"),
        Param("c", float, 0.75, "number in (0, 1]", _unit, "pull strength toward the leader (one group)"),
        Param("groups", int, 1, "integer >= 1 dividing the world size", lambda v: v >= 1,
              "groups of consecutive ranks, each with a local leader"),
        Param("c_local", float, 0.1, "number in (0, 1]", _unit, "pull toward the group's leader (groups > 1)"),
        Param("c_global", float, 0.1, "number in (0, 1]", _unit, "pull toward the global leader (groups > 1)"),
        Param("tau_global", int, 32, "integer >= 1", lambda v: v >= 1,
              "steps between global leader pulls (groups > 1)"),
        Param("prox", float, 0.0, "number in [0, 1]", lambda v: 0 <= v <= 1,
              "per-step pull toward the last election's leader, prox / tau per local step (0: none)"),
        Param("window", int, 0, "integer >= 0", lambda v: v >= 0,
              "the election compares each worker's mean loss over its last `window` steps (0: since the last election)"),
        Param("evaluate", str, "leader", "leader or average", lambda v: v in ("leader", "average"),
              "the model eval_model() returns: the last global leader's, or the workers' average"),
        Param("average", bool, False, "true or false (true: one group, no compressor, prox 0)", None,
              "each election moves every worker to (1 - c) * the workers' average + c * x_leader "
              "(one allreduce instead of the leader's broadcast)"),
    )
    summary = ("leader SGD: every tau steps the worker with the lowest running loss is the leader and "
               "every worker moves x <- (1 - c) x + c x_leader (optional local and global leaders)")

    @classmethod
    def preflight(cls, params: Mapping[str, Any], run: Preflight) -> None:
        if run.nonfinite != "propagate":
            raise ValueError(f"algorithm {cls.name!r}: nonfinite={run.nonfinite!r} is not supported: LSGD "
                             "exchanges no gradient or delta that every rank checks (a diverged worker's NaN "
                             "loss never leads and the pull keeps its NaN), so no step would be skipped or "
                             "raised; allowed: propagate")
        groups = params["groups"]
        if run.world_size is not None and run.world_size % groups:
            raise ValueError(f"algorithm {cls.name!r}: parameter 'groups' got {groups}; allowed: a divisor "
                             f"of the world size {run.world_size}")
        if params["average"]:
            bad = [f"'groups' is {groups}" if groups > 1 else "",
                   f"the compressor is {run.compressor.spec()!r}" if not run.compressor.identity else "",
                   f"'prox' is {params['prox']}" if params["prox"] > 0 else ""]
            bad = [b for b in bad if b]
            if bad:
                raise ValueError(f"algorithm {cls.name!r}: parameter 'average' is true but {', '.join(bad)}; "
                                 "allowed: average=true with groups=1, no compressor and prox=0")

    def setup(self) -> None:
        self.preflight({p.name: getattr(self, p.name) for p in self.PARAMS},
                       Preflight(type(self.optimizer), self.compressor, self.strategy_name, self.engine.nonfinite,
                                 self.world_size))
        groups = self.groups
        self.compressed = not self.compressor.identity
        self._probe = probe_class(self.observe_backward)
        #: losses seen in this step (sum, count) and step means since the election (sum, count);
        #: sums stay on the loss's device (no host sync per step)
        self._seen: list[Any] = [None, 0]
        self._window: list[Any] = [None, 0]
        #: with window > 0: the last `window` step means (float64, on the loss's device)
        self._recent: list[torch.Tensor] = []
        #: leader ranks (group ranks) of the last election: global, then each group's; losses seen
        self.leaders = {"global": 0, "local": [g * (self.world_size // groups) for g in range(groups)]}
        self.last_losses = torch.full((self.world_size,), math.nan, dtype=torch.float64)

    def after_broadcast(self) -> None:
        size = self.world_size // self.groups
        self._hook = self.model.register_forward_hook(self._tag)
        self.subgroup: dist.ProcessGroup | None = None
        if self.groups > 1:
            ranks = dist.get_process_group_ranks(self.group)
            for g in range(self.groups):  # every rank creates every group
                sub = dist.new_group(ranks=ranks[g * size:(g + 1) * size], backend=dist.get_backend(self.group),
                                     timeout=timeout_of(self.group, None))
                if self.rank in range(g * size, (g + 1) * size):
                    self.subgroup = sub
        self.ref = [p.detach().clone() for _, p in self.named] if self.compressed else []
        #: the per-step pull's targets (the last elected leaders' parameters; the start before the first)
        prox = self.prox > 0
        self.target = {"global": [p.detach().clone() for _, p in self.named] if prox and not self.compressed else [],
                       "local": [p.detach().clone() for _, p in self.named] if prox and self.groups > 1 else []}
        self._eval: torch.nn.Module | None = None

    def step(self, loss: torch.Tensor | None = None) -> None:
        """After ``loss.backward()``: the local step; every ``tau`` steps the
        election and the pull. ``loss``: this step's training loss (else the
        one captured from ``backward()``)."""
        self._take_step_loss(loss)
        self.local_step()
        if self.prox > 0:
            self.prox_pull()
        t, groups = self._steps, self.groups
        if groups == 1:
            due_local, due_global = False, t % self.tau == 0
        else:
            due_local, due_global = t % self.tau == 0, t % self.tau_global == 0
        if due_local or due_global:
            self.pull(due_local, due_global)

    # ------------------------------------------------------------------ state
    def extra_state(self) -> dict[str, Any]:
        window = torch.zeros(2, dtype=torch.float64)
        if self._window[1]:
            window[0], window[1] = self._window[0].cpu(), self._window[1]
        recent = torch.stack(self._recent).cpu() if self._recent else torch.zeros(0, dtype=torch.float64)
        return {"window": window, "recent": recent, "leaders": {"global": self.leaders["global"],
                                                             "local": list(self.leaders["local"])},
                "last_losses": self.last_losses.clone(), "ref": [r.clone() for r in self.ref],
                "target": {k: [t.clone() for t in v] for k, v in self.target.items()}}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        if "window" not in state or len(state.get("ref", [])) != len(self.ref):
            raise ValueError("lsgd state: running loss or leader copy missing, or of another model")
        window = state["window"]
        device = next(iter(self.model.parameters())).device
        self._window = [window[0].to(device), int(window[1])] if int(window[1]) else [None, 0]
        self._recent = list(state.get("recent", torch.zeros(0, dtype=torch.float64)).to(device).unbind())
        self.leaders = {"global": int(state["leaders"]["global"]), "local": [int(v) for v in state["leaders"]["local"]]}
        self.last_losses = state["last_losses"].clone()
        for r, saved in zip(self.ref, state["ref"]):
            r.copy_(saved)
        target = state.get("target", {"global": [], "local": []})
        for key, mine in self.target.items():
            if len(target.get(key, [])) != len(mine):
                raise ValueError(f"lsgd state: per-step pull target {key!r} missing or of another model")
            for t, saved in zip(mine, target[key]):
                t.copy_(saved)

    def close(self) -> None:
        self._hook.remove()
