"""What every gossip algorithm shares (SGP, D-PSGD, CHOCO-SGD): posted
point-to-point messages that name a dead peer, the consensus copy for
evaluation, and the options that do or do not apply to gossip.

Messages (:class:`Posted`): every send and receive of a round is posted at
once with ``isend``/``irecv`` (no ordering across ranks can deadlock), a
message whose size the receiver cannot know is preceded by its int64 size
(variable-size compressors), no empty message is ever sent, peers are group
ranks translated to global ranks, and every wait has the group's timeout: a
dead peer (connection closed) or a stuck one (timeout) raises a
``RuntimeError`` that names it, instead of hanging. Unlike
:func:`gradpress.transport.p2p.exchange_bytes`, which it follows, the
receives can be waited on later (SGP's overlap) and one peer at a time.

Evaluation (:meth:`GossipAlgorithm.average_model`): the replicas differ, so
the model to evaluate is the average over ranks of the parameters (and of
the floating buffers) in a copy of the model (the base class's
``consensus_model``: one fused allreduce); the same call measures the
consensus distance
mean_i ||x_i - x_bar|| / ||x_bar||. Collective: every rank calls it (the
training loop evaluates on every rank). Its bytes are counted apart, in
``stats["eval_bytes"]``: ``bytes_sent`` is training traffic, comparable with
DDP's.

Options: ``strategy`` must be ``auto`` or ``collective`` (nothing goes
through a collective strategy), ``nonfinite`` must be ``propagate`` (a
NaN/Inf spreads through gossip as through DDP's allreduce; skipping a step
on every rank needs a collective agreement gossip does not have), and
``error_feedback`` may not be turned off when something is compressed (the
public copies are the error feedback).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from gradpress.algorithms.base import Algorithm, Preflight
from gradpress.algorithms.gossip_codec import Codec, gossip_scale
from gradpress.compress import Compressor
from gradpress.transport.collectives import fused_allreduce
from gradpress.transport.groups import timeout_of
from gradpress.transport.p2p import global_rank, wire_device

__all__ = ["GossipAlgorithm", "Posted"]

_TAG_BASE = 4096  # away from transport.p2p's tags; two tags per round, 256 rounds in flight at most


class Posted:
    """One round's messages: ``sends[peer]`` (uint8) posted to each peer,
    one buffer expected from each peer of ``expect`` (its byte size, or None
    when the sender prefixes it). :meth:`wait` returns the received buffers."""

    def __init__(self, algo: GossipAlgorithm, round_: int, sends: dict[int, torch.Tensor],
                 expect: dict[int, int | None]) -> None:
        self.algo, self.round = algo, round_
        group, dev = algo.group, algo.comm_device
        tag = _TAG_BASE + 2 * (round_ % 256)
        self.sent = 0
        self._sends: list[tuple[int, Any]] = []
        self._keep: list[torch.Tensor] = []
        self._sizes: dict[int, tuple[torch.Tensor, Any]] = {}
        self._expect = dict(expect)
        for peer, buf in sends.items():
            if algo.variable:
                size = torch.tensor([buf.numel()], dtype=torch.int64, device=dev)
                self._keep.append(size)
                self._sends.append((peer, dist.isend(size, global_rank(group, peer), group=group, tag=tag)))
                self.sent += 8
            if buf.numel():
                data = buf.to(dev).contiguous()  # gloo: a host copy (transport.p2p.wire_device)
                self._keep.append(data)
                self._sends.append((peer, dist.isend(data, global_rank(group, peer), group=group, tag=tag + 1)))
                self.sent += data.numel()
        for peer, known in self._expect.items():
            if known is None:
                t = torch.empty(1, dtype=torch.int64, device=dev)
                self._sizes[peer] = (t, dist.irecv(t, global_rank(group, peer), group=group, tag=tag))
        self._data: dict[int, tuple[torch.Tensor, Any]] = {}
        for peer, known in self._expect.items():
            if known is not None:
                self._post_recv(peer, known, tag)
        self._tag = tag

    def _post_recv(self, peer: int, n: int, tag: int) -> None:
        buf = torch.empty(n, dtype=torch.uint8, device=self.algo.comm_device)
        work = dist.irecv(buf, global_rank(self.algo.group, peer), group=self.algo.group, tag=tag + 1) if n else None
        self._data[peer] = (buf, work)

    def _wait(self, work: Any, peer: int, what: str) -> None:
        try:
            work.wait(self.algo.p2p_timeout) if self.algo.p2p_timeout is not None else work.wait()
        except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses with transport text
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RuntimeError(
                f"algorithm {self.algo.name!r}: rank {self.algo.rank} {what} peer rank {peer} (global rank "
                f"{global_rank(self.algo.group, peer)}) in gossip round {self.round} failed within the "
                f"{self.algo.p2p_timeout} timeout: that peer is dead, stuck or out of step ({first})") from None

    def wait(self) -> dict[int, torch.Tensor]:
        """The buffer from every expected peer (waits on the receives only:
        the sends complete when the peers receive, possibly later)."""
        out = {}
        for peer in self._expect:
            if peer not in self._data:
                size, work = self._sizes[peer]
                self._wait(work, peer, "waiting for the message size from")
                self._post_recv(peer, int(size.item()), self._tag)
            buf, work = self._data[peer]
            if work is not None:
                self._wait(work, peer, "waiting for the message from")
            out[peer] = buf.to(self.algo.home_device)
        return out

    def finish_sends(self) -> None:
        for peer, work in self._sends:
            self._wait(work, peer, "sending to")
        self._sends, self._keep = [], []


class GossipAlgorithm(Algorithm):
    """Base of the gossip algorithms: option checks, the codec, posted
    messages, the consensus copy, stats. Subclasses implement ``step``,
    ``setup_gossip`` (validate their graph) and ``init_state``."""

    #: compressed gossip is allowed (CHOCO, SGP); D-PSGD gossips exact parameters
    compresses = True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, strategy: str = "collective",
                 error_feedback: bool | None = None, nonfinite: str = "propagate", **kw: Any) -> None:
        # checked in setup(), inside the base class's agreement step (a bad option fails on every rank)
        self._options = {"strategy": strategy, "error_feedback": error_feedback, "nonfinite": nonfinite}
        self._eval_bytes = 0
        self._distance: float | None = None
        super().__init__(model, optimizer, strategy="collective", error_feedback=False, nonfinite=nonfinite, **kw)

    # ----------------------------------------------------------- construction
    def setup(self) -> None:
        assert self.engine is not None
        opts = self._options
        comp = self.engine.compressor
        self._check_run(opts["strategy"], opts["nonfinite"], comp)
        if opts["error_feedback"] is not None and not isinstance(opts["error_feedback"], bool):
            raise ValueError(f"error_feedback must be True, False or None, got {opts['error_feedback']!r}")
        if not comp.identity:  # refuse an unsound compressor even where the plan compresses nothing
            gossip_scale(comp, max([p.numel() for _, p in self.named] + [1]), self.name)
        if opts["error_feedback"] is False and not comp.identity:
            raise ValueError(f"algorithm {self.name!r}: error_feedback=False is not possible: the public copies "
                             "x^ are this method's error feedback (what Q drops stays in x - x^ and is sent later)")
        decisions = self.engine.plan.decisions
        self.codec = Codec(comp, [n for n, _ in self.named], [p.shape for _, p in self.named],
                           [decisions[n].compressed for n, _ in self.named], self.name, self.engine.context)
        self.home_device = self.named[0][1].device if self.named else torch.device("cpu")
        self.comm_device = wire_device(self.group, self.home_device)
        self.p2p_timeout = timeout_of(self.group, None)  # the group's: the caller's ``timeout`` or the base group's
        self.setup_gossip()

    @classmethod
    def _check_run(cls, strategy: str, nonfinite: str, comp: Compressor) -> None:
        if strategy not in ("auto", "collective"):
            raise ValueError(f"algorithm {cls.name!r}: strategy {strategy!r} does not apply: gossip sends "
                             "point-to-point messages to graph neighbours; allowed: auto, collective (same meaning)")
        if nonfinite != "propagate":
            raise ValueError(f"algorithm {cls.name!r}: nonfinite={nonfinite!r} is not supported: skipping "
                             "or failing a step on every rank needs a collective agreement gossip does not have; "
                             "allowed: propagate")
        if not cls.compresses and not comp.identity:
            raise ValueError(f"algorithm {cls.name!r} gossips exact parameters; compressor {comp.spec()!r} is "
                             "not allowed (allowed: none); use choco or sgp for compressed gossip")

    @classmethod
    def preflight(cls, params: Mapping[str, Any], run: Preflight) -> None:
        cls._check_run(run.strategy, run.nonfinite, run.compressor)
        if run.world_size is not None:
            cls.check_graph(params, run.world_size)

    @classmethod
    def check_graph(cls, params: Mapping[str, Any], world_size: int) -> None:
        """Validate the graph parameters for ``world_size`` workers (ValueError naming them)."""

    @property
    def variable(self) -> bool:
        return self.codec.variable

    def setup_gossip(self) -> None:
        """Validate the graph parameters (raise ValueError naming them)."""

    def after_broadcast(self) -> None:
        self.init_state()

    def init_state(self) -> None:
        """Build the state every rank starts from (all hold rank 0's parameters)."""

    # -------------------------------------------------------------- messages
    def expected_size(self, own: torch.Tensor) -> int | None:
        """What a peer's message of this round weighs: the size of this
        rank's own (fixed-size packets), or None (the sender says)."""
        return None if self.variable else own.numel()

    def account(self, sent: int, compress_s: float, comm_s: float, payload: dict[str, int]) -> None:
        """Count one step's bytes handed to point-to-point sends."""
        assert self.engine is not None
        n_comp = sum(self.codec.compressed)
        self.engine.stats_counter.record(sent=sent, dense=0, compress_s=compress_s, comm_s=comm_s,
                                         compressed=n_comp, plain=len(self.named) - n_comp,
                                         tensor_bytes=payload, end_of_step=True)
        self._last["bytes"] += sent

    @staticmethod
    def payload_bytes(keys: list[str], packets: list[Any]) -> dict[str, int]:
        return {k: p.nbytes for k, p in zip(keys, packets)}

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for _, p in self.named]

    # ---------------------------------------------------------- consensus copy
    @torch.no_grad()
    def average_model(self) -> torch.nn.Module:
        """The base class's :meth:`consensus_model` (the average over ranks
        of the parameters and floating buffers, in a copy; collective), and
        the consensus distance measured against it
        (``stats["consensus_distance"]``); the bytes go to ``eval_bytes``."""
        avg = self.consensus_model()
        mine = [p.detach() for p in self.model.parameters()]
        if avg is self.model:  # one worker: nothing to average
            self._distance = 0.0
            return avg
        means = [p.detach() for p in avg.parameters()]
        diff = sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(mine, means))
        norm = sum(float(b.double().pow(2).sum()) for b in means)
        n = self.world_size
        dist_i = torch.tensor([diff ** 0.5 / max(norm ** 0.5, 1e-30) / n], dtype=torch.float64,
                              device=mine[0].device if mine else None)
        mean, sent = fused_allreduce([dist_i], self.group)
        self._distance = float(mean[0])
        floats = mine + [b for b in self.model.buffers() if b.is_floating_point()]
        self._eval_bytes += sent + sum(t.numel() * t.element_size() for t in floats if t.numel())
        return avg

    def eval_model(self) -> torch.nn.Module:
        """The consensus (averaged) model; collective."""
        return self.average_model()

    @property
    def stats(self) -> dict[str, Any]:
        """The hook's vocabulary (bytes handed to point-to-point sends) plus
        ``eval_bytes`` (consensus averaging for evaluation) and
        ``consensus_distance`` (mean_i ||x_i - x_bar|| / ||x_bar|| at the last
        :meth:`average_model`, None before)."""
        out = super().stats
        out["eval_bytes"] = self._eval_bytes
        out["consensus_distance"] = self._distance
        return out

    def describe(self) -> dict[str, Any]:
        return {"algorithm": self.spec(), "compressor": self.compressor.spec(), "strategy": "gossip",
                "error_feedback": self.codec.any_compressed}

    # ------------------------------------------------------------------ time
    @staticmethod
    def clock() -> float:
        return time.perf_counter()
