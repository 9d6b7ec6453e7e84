"""``sgp:peers=1,overlap=0,gamma=1.0``: Stochastic Gradient Push.

Assran, Loizou, Ballas, Rabbat 2019, "Stochastic Gradient Push for
Distributed Deep Learning" (ICML), Algorithm 1 (and its overlap variant,
Algorithm 3): PushSum gossip on the time-varying directed exponential graph
(:func:`gradpress.algorithms.topology.sgp_peers`). Node i keeps a numerator
x_i and a PushSum weight w_i (float64, 1 at the start); the model holds the
de-biased z_i = x_i / w_i, at which the gradient is taken. One step:

    absorb what arrived from round t - overlap          (overlap >= 1)
    x_i <- x_i + (optimizer step on z_i)           # x - lr * g(z) for SGD
    send gamma/(k+1) of (x_i, w_i) to each of the k out-peers of round t,
    keep the rest; absorb round t now                   (overlap = 0)
    z_i <- x_i / w_i

(The optimizer runs on z, as the reference implementation's runs on the
numerator; weight decay therefore decays z.) ``overlap = tau``: the sends
and receives of round t are posted without waiting and absorbed at the
start of step t + tau, before its optimizer step, so they travel while
tau forward/backward passes run. With tau = 1 nothing is in flight when a
round is sent (w returns to 1 on a regular graph) and the gradient of step
t + 1 is taken at the local, not yet mixed, model: the reference
implementation's overlap (absorb, then start the next gossip). PushSum keeps
the average exact whatever the delay.
``gamma`` < 1 mixes lazily (P_gamma = (1 - gamma) I + gamma P, still column
stochastic); 1 is SGP itself.

Invariant (PushSum): the sums over nodes of x and of w, counting messages in
flight, are preserved by every gossip round exactly (without compression;
the test checks it in float64), so sum_i z_i w_i / sum_i w_i moves only by
the gradient steps, and z_i converges to the average of the x_i.

Compression (a choice where the paper is silent): pushing Q(x) would move
mass the receiver cannot de-bias, so each directed edge e = (i -> j) keeps a
*public copy* x^_e, the same on both ends (initially the common x_0):
the sender sends q = Q(x_i - x^_e), both ends do x^_e <- x^_e + D(q), the
sender gives away gamma/(k+1) x^_e and the receiver absorbs exactly that
(CHOCO-SGD's copies, Koloskova et al. 2019, per edge: Taheri et al. 2020,
"Quantized decentralized stochastic learning over directed graphs", does this
with one copy per node on a static graph). Mass is conserved exactly for any
compressor; the copies track x only for a contractive Q, so the compressors
of :mod:`gradpress.algorithms.gossip_codec` are accepted (unbiased ones as
Q/(1 + omega)); gamma < 1 damps, as in CHOCO. The weights w travel exact
(8 bytes per message). Memory: one copy per out- and per in-offset (2 L
models, L = floor(log2(n - 1)) + 1) besides x.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from gradpress.algorithms.gossip import GossipAlgorithm, Posted
from gradpress.algorithms.gossip_codec import Codec
from gradpress.algorithms.registry import register
from gradpress.algorithms.topology import exponential_offsets, sgp_offsets
from gradpress.compress.base import Param


class _Round:
    """The messages of one round until they are absorbed: posted (waiting),
    or received and decoded (after a checkpoint drained them)."""

    def __init__(self, round_: int, offsets: list[int], posted: Posted | None, templates: list[Any]) -> None:
        self.round, self.offsets, self.posted, self.templates = round_, offsets, posted, templates
        self.decoded: dict[int, tuple[list[torch.Tensor], torch.Tensor]] | None = None

    def receive(self, algo: SGP) -> dict[int, tuple[list[torch.Tensor], torch.Tensor]]:
        """(values, weight share) per in-offset, decoded."""
        if self.decoded is None:
            assert self.posted is not None
            bufs = self.posted.wait()
            self.decoded = {}
            for o in self.offsets:
                values, scalars = algo.codec.decode(bufs[(algo.rank - o) % algo.world_size], self.templates)
                self.decoded[o] = ([v.clone() for v in values], scalars[0].clone())
            self.templates = []
        return self.decoded


@register
class SGP(GossipAlgorithm):
    name = "sgp"
    PARAMS = (
        Param("peers", int, 1, "integer >= 1 (at most floor(log2(n - 1)) + 1 on n workers)", lambda v: v >= 1,
              "out-neighbours per round on the directed exponential graph"),
        Param("overlap", int, 0, "0 <= overlap <= 64", lambda v: 0 <= v <= 64,
              "steps after which a message is absorbed (0: synchronous)"),
        Param("gamma", float, 1.0, "0 < gamma <= 1", lambda v: 0 < v <= 1,
              "mixing step: P_gamma = (1 - gamma) I + gamma P (1: SGP)"),
    )
    summary = ("Stochastic Gradient Push (Assran et al. 2019): PushSum on the time-varying directed exponential "
               "graph, optional overlap and compressed pushes through per-edge public copies")

    @classmethod
    def check_graph(cls, params: Mapping[str, Any], world_size: int) -> None:
        offs = exponential_offsets(world_size)
        if world_size > 1 and params["peers"] > len(offs):
            raise ValueError(f"algorithm 'sgp': parameter 'peers' got {params['peers']}; allowed: 1 <= peers <= "
                             f"{len(offs)} on {world_size} workers (distinct offsets {offs})")

    @classmethod
    def reshard_refused(cls, saved: list[Mapping[str, Any]], world: int) -> str | None:
        """Compressed pushes keep a public copy per hop offset of the exponential graph (``out_copy``,
        ``in_copy``): a checkpoint folds onto a world size of the same offsets only (N in 2^(k-1)+1 .. 2^k).
        Uncompressed, there are no copies, and a message in flight is absorbed whatever its offset."""
        n = len(saved)
        before, after = exponential_offsets(n), exponential_offsets(world)
        if before == after or not any((s.get("extra") or {}).get("out_copy") for s in saved):
            return None
        k = (n - 1).bit_length()
        same = f"{(1 << (k - 1)) + 1} to {1 << k} workers" if n > 1 else "1 worker"
        return (f"its compressed pushes keep a public copy per hop offset of the exponential graph: offsets {before} "
                f"on {n} worker(s), {after} on {world}, so some copies have no edge on the other graph (the same "
                f"offsets: {same})")

    def setup_gossip(self) -> None:
        self.check_graph({"peers": self.peers}, self.world_size)  # type: ignore[attr-defined]

    def init_state(self) -> None:
        with torch.no_grad():
            self.x = [p.detach().clone() for p in self.params]
        self.w = torch.ones((), dtype=torch.float64, device=self.x[0].device if self.x else None)
        offs = exponential_offsets(self.world_size) if self.world_size > 1 else []
        copies = self.codec.any_compressed
        self.out_copy = {o: self._copies() for o in offs} if copies else {}
        self.in_copy = {o: self._copies() for o in offs} if copies else {}
        self.inflight: deque[_Round] = deque()

    def _copies(self) -> list[torch.Tensor | None]:
        return [x.clone() if c else None for x, c in zip(self.x, self.codec.compressed)]

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        t = self._steps  # this step's gossip round
        comm = 0.0
        with torch.no_grad():
            before = [p.detach().clone() for p in self.params]
            if self.world_size > 1 and self.overlap:  # type: ignore[attr-defined]
                t0 = self.clock()  # round t - overlap travelled while this step's forward/backward ran
                self._absorb_until(t - self.overlap)  # type: ignore[attr-defined]
                comm = self.clock() - t0
        self.local_step()
        with torch.no_grad():
            for x, p, b in zip(self.x, self.params, before):
                x.add_(p.detach() - b)
            if self.world_size > 1:
                t0 = self.clock()
                offs, sends, packets = self._push(t)
                t1 = self.clock()
                expect = {(self.rank - o) % self.world_size: self.expected_size(next(iter(sends.values())))
                          for o in offs}
                posted = Posted(self, t, sends, expect)
                self.inflight.append(_Round(t, offs, posted, Codec.light(packets)))
                self._pending_sends.append(posted)
                self._absorb_until(t - self.overlap)  # type: ignore[attr-defined]
                comm += self.clock() - t1
                self.account(posted.sent, t1 - t0, comm, self.payload_bytes(self.codec.keys, packets))
            for p, x in zip(self.params, self.x):
                p.copy_(x / self.w)

    def _absorb_until(self, last: int) -> None:
        while self.inflight and self.inflight[0].round <= last:
            self._absorb(self.inflight.popleft())

    def _push(self, t: int) -> tuple[list[int], dict[int, torch.Tensor], list[Any]]:
        """Give away gamma/(k+1) of (x, w) per out-peer of round ``t``:
        the offsets, the buffer per peer, this rank's packets (templates)."""
        offs = sgp_offsets(t, self.world_size, self.peers)  # type: ignore[attr-defined]
        a = self.gamma / (self.peers + 1)  # type: ignore[attr-defined]
        keep = 1.0 - len(offs) * a
        w_share = self.w * a
        sends: dict[int, torch.Tensor] = {}
        packets: list[Any] = []
        if not self.codec.any_compressed:
            buf, packets = self.codec.encode([x * a for x in self.x], t, [w_share])
            sends = {(self.rank + o) % self.world_size: buf for o in offs}
            for x in self.x:
                x.mul_(keep)
        else:
            shares = [x * a if not c else None for x, c in zip(self.x, self.codec.compressed)]
            gone: list[torch.Tensor | None] = [None] * len(self.x)
            for o in offs:
                copies = self.out_copy[o]
                diffs = [x - e if e is not None else s for x, e, s in zip(self.x, copies, shares)]
                buf, packets = self.codec.encode(diffs, t, [w_share])  # type: ignore[arg-type]
                for i, e in enumerate(copies):
                    if e is not None:
                        e.add_(self.codec.decode_one(i, packets[i]))
                        gone[i] = e * a if gone[i] is None else gone[i].add_(e, alpha=a)  # type: ignore[union-attr]
                sends[(self.rank + o) % self.world_size] = buf
            for x, g, c in zip(self.x, gone, self.codec.compressed):
                if c:
                    x.sub_(g)  # type: ignore[arg-type]
                else:
                    x.mul_(keep)
        self.w.mul_(keep)
        return offs, sends, packets

    def _absorb(self, rnd: _Round) -> None:
        a = self.gamma / (self.peers + 1)  # type: ignore[attr-defined]
        for o, (values, w_share) in rnd.receive(self).items():
            copies = self.in_copy.get(o)
            for i, (x, v) in enumerate(zip(self.x, values)):
                if self.codec.compressed[i]:
                    e = copies[i]  # type: ignore[index]
                    e.add_(v)  # type: ignore[union-attr]
                    x.add_(e, alpha=a)  # type: ignore[arg-type]
                else:
                    x.add_(v)
            self.w.add_(w_share.to(self.w.device))
        while self._pending_sends and self._pending_sends[0].round <= rnd.round:
            self._pending_sends.popleft().finish_sends()

    # ----------------------------------------------------------------- state
    def after_broadcast(self) -> None:
        self._pending_sends: deque[Posted] = deque()
        super().after_broadcast()

    def extra_state(self) -> dict[str, Any]:
        """x, w, the edge copies and the messages in flight (received and
        decoded now: every rank checkpoints at the same step, so their
        senders posted them already)."""
        inflight = []
        for rnd in self.inflight:
            dec = rnd.receive(self)
            inflight.append({"round": rnd.round, "offsets": list(rnd.offsets),
                             "values": {str(o): [v.clone() for v in dec[o][0]] for o in rnd.offsets},
                             "weights": {str(o): dec[o][1].clone() for o in rnd.offsets}})
        return {"x": [x.clone() for x in self.x], "w": self.w.clone(),
                "out_copy": {str(o): [c for c in cs if c is not None] for o, cs in self.out_copy.items()},
                "in_copy": {str(o): [c for c in cs if c is not None] for o, cs in self.in_copy.items()},
                "inflight": inflight}

    def _load_backup(self) -> dict[str, Any]:
        """Before a load changes anything: finish this rank's sends of the rounds in flight, then the backup
        (whose ``extra_state()`` receives those rounds). The load replaces the rounds in flight (a failed one
        puts the backup's back, decoded), and with them the handles of their sends; gloo sends a buffer only
        once the peer posts its receive (for variable-size messages, when the peer waits for the round), and a
        send whose handle is dropped before that never arrives: the peer's wait for it fails at the p2p
        timeout. A peer receives them in its own load (its backup) or when it absorbs the round, neither of
        which waits for this rank, so this waits for no cycle; a dead peer fails here, at the timeout, with
        nothing loaded."""
        while self._pending_sends:
            self._pending_sends[0].finish_sends()
            self._pending_sends.popleft()
        return super()._load_backup()

    def load_touches(self) -> list[torch.Tensor]:
        """The parameters: a load sets them to ``x / w`` (a failed one puts them back)."""
        return list(self.params)

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Load what :meth:`extra_state` wrote. A tensor of another shape than the one it replaces (``copy_``
        would broadcast it), a list of another length, or a round in flight whose values, weights and offsets
        disagree (a message would be absorbed in part: mass lost) raises ``ValueError`` naming it (the
        algorithm's load then rolls back)."""
        if "x" not in state or len(state["x"]) != len(self.x):
            raise ValueError("sgp state: numerators x missing or of another model")
        _like("x", state["x"], self.x)
        _like("w", [state["w"]], [self.w])
        for x, s in zip(self.x, state["x"]):
            x.copy_(s)
        self.w.copy_(state["w"])
        for name, mine in (("out_copy", self.out_copy), ("in_copy", self.in_copy)):
            saved = state.get(name, {})
            if sorted(saved) != sorted(str(o) for o in mine):
                raise ValueError(f"sgp state: {name} has offsets {sorted(saved)}, this run {sorted(mine)}")
            for o, cs in mine.items():
                live = [c for c in cs if c is not None]
                _like(f"{name}[{str(o)!r}]", saved[str(o)], live)
                for c, s in zip(live, saved[str(o)]):
                    c.copy_(s)
        self.inflight.clear()
        self._pending_sends.clear()  # finished by _load_backup, before the load began
        for rec in state.get("inflight", []):
            rnd = _Round(int(rec["round"]), [int(o) for o in rec["offsets"]], None, [])
            if not sorted(rec["values"]) == sorted(rec["weights"]) == sorted(str(o) for o in rnd.offsets):
                raise ValueError(f"sgp state: inflight round {rnd.round}: offsets {rnd.offsets}, values of "
                                 f"{sorted(rec['values'])}, weights of {sorted(rec['weights'])}; allowed: the same")
            for o in rec["values"]:
                _like(f"inflight round {rnd.round} values[{o!r}]", rec["values"][o], self.x)
                _like(f"inflight round {rnd.round} weights[{o!r}]", [rec["weights"][o]], [self.w])
            rnd.decoded = {int(o): ([v.clone() for v in rec["values"][o]], rec["weights"][o].clone())
                           for o in rec["values"]}
            self.inflight.append(rnd)
        with torch.no_grad():
            for p, x in zip(self.params, self.x):
                p.copy_(x / self.w)

    @property
    def stats(self) -> dict[str, Any]:
        out = super().stats
        out["push_sum_weight"] = float(self.w)
        return out


def _like(what: str, saved: Any, live: list[torch.Tensor]) -> None:
    """``saved`` is a list of tensors of ``live``'s length, each of its counterpart's shape and dtype kind:
    ValueError naming the first that is not (``copy_`` would broadcast a smaller one silently)."""
    if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
        got = f"{len(saved)} entries" if isinstance(saved, (list, tuple)) else f"a {type(saved).__name__}"
        raise ValueError(f"sgp state: {what}: {got}, expected {len(live)} tensors")
    for i, (s, t) in enumerate(zip(saved, live)):
        if not isinstance(s, torch.Tensor) or s.shape != t.shape or s.is_floating_point() != t.is_floating_point():
            got = f"shape {tuple(s.shape)} {s.dtype}" if isinstance(s, torch.Tensor) else f"a {type(s).__name__}"
            raise ValueError(f"sgp state: {what}[{i}]: {got}, expected shape {tuple(t.shape)} {t.dtype}")
