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
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from gradpress.algorithms.base import Algorithm, Preflight
from gradpress.algorithms.loss_probe import probe_class
from gradpress.algorithms.registry import register
from gradpress.compress.base import Param
from gradpress.transport.collectives import flat_by_dtype, fused_allreduce
from gradpress.transport.groups import device_of, timeout_of
from gradpress.transport.p2p import global_rank


def _unit(v: float) -> bool:
    return 0 < v <= 1


@register
class LSGD(Algorithm):
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
        groups = self.groups  # type: ignore[attr-defined]
        self.compressed = not self.compressor.identity
        self._probe = probe_class(self.observe)
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
        size = self.world_size // self.groups  # type: ignore[attr-defined]
        self._hook = self.model.register_forward_hook(self._tag)
        self.subgroup: dist.ProcessGroup | None = None
        if self.groups > 1:  # type: ignore[attr-defined]
            ranks = dist.get_process_group_ranks(self.group)
            for g in range(self.groups):  # type: ignore[attr-defined]  # every rank creates every group
                sub = dist.new_group(ranks=ranks[g * size:(g + 1) * size], backend=dist.get_backend(self.group),
                                     timeout=timeout_of(self.group, None))
                if self.rank in range(g * size, (g + 1) * size):
                    self.subgroup = sub
        self.ref = [p.detach().clone() for _, p in self.named] if self.compressed else []
        #: the per-step pull's targets (the last elected leaders' parameters; the start before the first)
        prox = self.prox > 0  # type: ignore[attr-defined]
        self.target = {"global": [p.detach().clone() for _, p in self.named] if prox and not self.compressed else [],
                       "local": [p.detach().clone() for _, p in self.named] if prox and self.groups > 1 else []}  # type: ignore[attr-defined]
        self._eval: torch.nn.Module | None = None

    # ------------------------------------------------------------------ loss
    def _tag(self, module: torch.nn.Module, inputs: Any, output: Any) -> Any:
        if module.training and torch.is_grad_enabled() and type(output) is torch.Tensor:
            return output.as_subclass(self._probe)
        return None

    def observe(self, loss: torch.Tensor) -> None:
        """Count one training loss of this step (gradient accumulation: several)."""
        value = loss.detach().reshape(()).to(torch.float64)
        self._seen[0] = value if self._seen[0] is None else self._seen[0] + value
        self._seen[1] += 1

    def step(self, loss: torch.Tensor | None = None) -> None:
        """After ``loss.backward()``: the local step; every ``tau`` steps the
        election and the pull. ``loss``: this step's training loss (else the
        one captured from ``backward()``)."""
        if loss is not None:
            self._seen = [None, 0]
            self.observe(loss)
        if not self._seen[1]:
            raise RuntimeError(f"algorithm {self.name!r} needs the training loss: call step(loss), or compute "
                               "the loss from the model's output in training mode and call backward() on it")
        mean = self._seen[0] / self._seen[1]
        self._window = [mean if self._window[0] is None else self._window[0] + mean, self._window[1] + 1]
        if self.window:  # type: ignore[attr-defined]
            self._recent = [*self._recent, mean][-self.window:]  # type: ignore[attr-defined]
        self._seen = [None, 0]
        self.local_step()
        if self.prox > 0:  # type: ignore[attr-defined]
            self.prox_pull()
        t, groups = self._steps, self.groups  # type: ignore[attr-defined]
        if groups == 1:
            due_local, due_global = False, t % self.tau == 0  # type: ignore[attr-defined]
        else:
            due_local, due_global = t % self.tau == 0, t % self.tau_global == 0  # type: ignore[attr-defined]
        if due_local or due_global:
            self.pull(due_local, due_global)

    @torch.no_grad()
    def prox_pull(self) -> None:
        """One step's pull toward the last election's leaders:
        ``x <- x + (prox / tau_g) (x_g - x) [+ (prox / tau) (x_l - x)]``
        (``tau_g``: ``tau`` with one group, ``tau_global`` with several)."""
        groups = self.groups  # type: ignore[attr-defined]
        pulls = [(self.prox / (self.tau if groups == 1 else self.tau_global),  # type: ignore[attr-defined]
                  self.ref if self.compressed else self.target["global"])]
        if groups > 1:
            pulls.append((self.prox / self.tau, self.target["local"]))  # type: ignore[attr-defined]
        self._move_toward(pulls)

    @torch.no_grad()
    def _move_toward(self, pulls: list[tuple[float, list[torch.Tensor]]]) -> None:
        """``x <- x + sum_k c_k (t_k - x)`` for every parameter, all pulls from
        the same ``x``; one pull is ``lerp_``, or with weight 1 a copy (exactly
        the target's, even from a NaN ``x``, which ``lerp_`` would keep)."""
        for i, (_, p) in enumerate(self.named):
            if len(pulls) == 1:
                p.copy_(pulls[0][1][i]) if pulls[0][0] == 1 else p.lerp_(pulls[0][1][i], pulls[0][0])
            else:
                x = p.detach().clone()
                for c, target in pulls:
                    p.add_(target[i] - x, alpha=c)

    # ---------------------------------------------------------------- leaders
    def elect(self) -> torch.Tensor:
        """Gather every rank's running loss (one allgather); set ``leaders``."""
        device = device_of(self.group)
        mine = (self._window[0] / self._window[1] if self._window[1] else torch.tensor(math.nan, dtype=torch.float64))
        if self.window and self._recent:  # type: ignore[attr-defined]
            mine = torch.stack(self._recent).mean()
        self._window = [None, 0]
        losses = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(self.world_size)]
        dist.all_gather(losses, mine.reshape(()).to(device), group=self.group)
        self._count(8)
        values = [float(v) for v in losses]
        # NaN after every number, +inf included: a NaN loss never leads unless every loss is NaN
        key = [(math.isnan(v), v if not math.isnan(v) else 0.0, r) for r, v in enumerate(values)]
        size = self.world_size // self.groups  # type: ignore[attr-defined]
        self.leaders = {"global": min(key)[-1],
                        "local": [min(key[g * size:(g + 1) * size])[-1] for g in range(self.groups)]}  # type: ignore[attr-defined]
        self.last_losses = torch.tensor(values, dtype=torch.float64)
        return self.last_losses

    def _count(self, sent: int, end_of_step: bool = False) -> None:
        assert self.engine is not None
        self.engine.stats_counter.record(sent=sent, dense=0, compress_s=0.0, comm_s=0.0, compressed=0, plain=0,
                                         tensor_bytes={}, end_of_step=end_of_step)
        self._last["bytes"] += sent

    def broadcast_params(self, src: int, group: dist.ProcessGroup, count: bool = True,
                         tensors: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Rank ``src``'s (group rank of ``self.group``) parameters (or its
        ``tensors``), on every rank of ``group``."""
        flats, views = flat_by_dtype(tensors if tensors is not None else [p for _, p in self.named])
        for flat in flats:
            dist.broadcast(flat, global_rank(self.group, src), group=group)
            if count:
                self._count(flat.numel() * flat.element_size())
        return views

    @torch.no_grad()
    def global_leader_params(self, src: int) -> list[torch.Tensor]:
        """The global leader's parameters: a broadcast, or (compressed) the
        engine average to which only the leader contributes, added to ``ref``."""
        if not self.compressed:
            return self.broadcast_params(src, self.group)
        n = self.world_size
        lead = self.rank == src
        diffs = [(p.detach() - r) * n if lead else torch.zeros_like(r) for (_, p), r in zip(self.named, self.ref)]
        self.sync(diffs)
        for r, d in zip(self.ref, diffs):
            r.add_(d)
        return self.ref

    @torch.no_grad()
    def pull(self, due_local: bool, due_global: bool) -> None:
        """Elect, fetch the leaders' parameters, move every worker toward them."""
        self.elect()
        if self.average:  # type: ignore[attr-defined]
            self.averaged_pull(self.leaders["global"])
            self._exchanges += 1
            self._count(0, end_of_step=True)
            return
        targets: list[tuple[float, list[torch.Tensor]]] = []
        if due_global:
            c = self.c if self.groups == 1 else self.c_global  # type: ignore[attr-defined]
            targets.append((c, self.global_leader_params(self.leaders["global"])))
            if self.target["global"]:
                self.target["global"] = [t.clone() for t in targets[-1][1]]
        if due_local:
            assert self.subgroup is not None
            src = self.leaders["local"][self.rank // (self.world_size // self.groups)]  # type: ignore[attr-defined]
            targets.append((self.c_local, self.broadcast_params(src, self.subgroup)))  # type: ignore[attr-defined]
            if self.target["local"]:
                self.target["local"] = [t.clone() for t in targets[-1][1]]
        self._move_toward(targets)
        if not (self.compressed and due_global):  # no engine call closed this exchange
            self._exchanges += 1
            self._count(0, end_of_step=True)

    @torch.no_grad()
    def averaged_pull(self, src: int) -> None:
        """``x <- (1 - c) mean_i(x_i) + c x_src`` on every rank: one allreduce
        of ``w_i x_i`` with ``w_i = (1 - c) / N + c [i == src]`` (bit-identical
        result on every rank; with ``c = 1`` every other weight is 0 and the
        leader's parameters arrive exactly)."""
        c = self.c  # type: ignore[attr-defined]
        w = (1 - c) / self.world_size + (c if self.rank == src else 0.0)
        # weight 0 sends zeros, not 0 * x (NaN where a diverged worker's x is)
        summed, sent = fused_allreduce([p.detach() * w if w else torch.zeros_like(p) for _, p in self.named],
                                       self.group)
        self._count(sent)
        for (_, p), s in zip(self.named, summed):
            p.copy_(s)

    # ------------------------------------------------------------ evaluation
    @torch.no_grad()
    def eval_model(self) -> torch.nn.Module:
        """``evaluate=leader``: the last global leader's current model, on
        every rank; ``evaluate=average``: the workers' average (the "center"
        model the authors' code tests). Collective; this traffic is
        evaluation, not training, and is not counted."""
        if self.world_size == 1:
            return self.model
        if self.evaluate == "average":  # type: ignore[attr-defined]
            if self._consensus is not None:
                return self.consensus_model()
            self._hook.remove()  # the copy must not carry the loss-capturing hook
            try:
                return self.consensus_model()
            finally:
                self._hook = self.model.register_forward_hook(self._tag)
        if self._eval is None:
            self._hook.remove()
            self._eval = copy.deepcopy(self.model)
            self._hook = self.model.register_forward_hook(self._tag)
        params = self.broadcast_params(self.leaders["global"], self.group, count=False)
        for p, src in zip([q for q in self._eval.parameters() if q.requires_grad], params):
            p.copy_(src)
        own = [b for b in self.model.buffers() if b.numel()]  # the leader's too (BatchNorm statistics)
        theirs = self.broadcast_params(self.leaders["global"], self.group, count=False, tensors=own)
        for mine, t in zip([b for b in self._eval.buffers() if b.numel()], theirs):
            mine.copy_(t)
        return self._eval

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
