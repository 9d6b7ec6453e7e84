"""``streaming-diloco:period=H,fragments=F,overlap=T,alpha=A``: Streaming
DiLoCo, DiLoCo's outer step fragment by fragment, at staggered times, its
exchange overlapped with the following inner steps.

Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping
communication: Towards a Distributed Free Lunch"): the parameters are split
into F fragments; fragment p takes its outer step every H inner steps, at
offset ``(p + 1) * H // F`` in the period, so at most one fragment travels
at a time and the peak bandwidth is about 1/F of DiLoCo's. Its outer
gradient ``theta_p - x_p`` is taken at step t, averaged through the
exchange engine (any compressor with error feedback: the paper sends 4-bit
values) while the worker keeps training, and merged at step t + T: the outer
optimizer steps ``theta_p`` with the averaged outer gradient, and the
worker's fragment becomes ``A * x_p + (1 - A) * theta_p`` (A weighs the
local value, which has moved on for T steps; 0.5 in the paper; A = 0 takes
the new outer value). Fragments are whole parameter tensors, assigned
largest first to the lightest fragment (balanced bytes; the paper assigns
layers in a strided pattern). Floating buffers ride with the fragment at
offset 0 (averaged plain, from their value at launch); at its merge every
rank's floating buffers are set to that average, so what the T overlapped
forward passes added since the launch is discarded on every rank (the
replicas agree right after; a buffer gone non-finite in those T steps is
overwritten too, and drops or raises nothing).

Overlap: with T >= 1 the exchanges run, in launch order, on one background
thread that alone issues this algorithm's collectives (its own process
group) while exchanges are in flight; the training thread only waits for a
result when it is due. Launches follow the step counter, identical on every
rank, so every rank issues the same collectives in the same order.

Staleness bound: an outer gradient is applied exactly T steps after it was
taken (T < H, so a fragment's merge always precedes its next launch); a
worker's fragment is never more than H + T inner steps away from the last
outer parameters it merged. ``stats`` count an exchange's bytes when it is
merged (independent of the thread's timing).

``nonfinite='skip'``: a dropped exchange (some rank's outer gradient, or at
its launch the fragment's inner optimizer state or the buffers it carries,
not finite) restarts every fragment from ``theta`` on every rank, each with the
inner optimizer state it had at its own last merge, and the buffers of the
last merge that carried them (:mod:`gradpress.algorithms.restart`): a NaN
in one fragment reaches every fragment at the next forward pass, so
restoring the dropped fragment alone ping-ponged the NaN between fragments.
A merge refreshes this rank's copy of the fragment (and of the buffers) only
where they are finite: a fragment launched before a divergence is merged T
steps later with a finite outer step while its local state already holds
the NaN (copying that made every later restart NaN again: a dead run).
``nonfinite='raise'``: the same state and buffers, not finite on some rank
at the launch, make every rank raise at the merge
(:mod:`gradpress.algorithms.alarm`).

Invariants: ``theta`` and the outer momentum are bit-identical on every rank
(the averages are); with A = 0 the merged fragment is bit-identical on
every rank right after each merge. With F = 1, T = 0, A = 0 this is DiLoCo
(tested). ``state_dict`` waits for the exchanges in flight and saves their
averaged results with their due step, so a resumed run merges them at the
same steps: resume is bit-identical.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Mapping
from typing import Any

import torch

from gradpress.algorithms.diloco import PARAMS as DILOCO_PARAMS
from gradpress.algorithms.diloco import DiLoCo
from gradpress.algorithms.registry import register
from gradpress.algorithms.sync_guard import SyncGuard
from gradpress.compress.base import Param
from gradpress.transport.collectives import fused_allreduce


def balanced_fragments(sizes: list[int], count: int) -> list[list[int]]:
    """Tensor indices per fragment: largest tensor first into the fragment
    with the fewest elements so far (ties: lower index); each fragment's
    indices ascending. Deterministic, so every rank computes the same."""
    frags: list[list[int]] = [[] for _ in range(count)]
    load = [0] * count
    for i in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        f = min(range(count), key=lambda k: (load[k], k))
        frags[f].append(i)
        load[f] += sizes[i]
    return [sorted(f) for f in frags]


@register
class StreamingDiLoCo(DiLoCo):
    name = "streaming-diloco"
    PARAMS = (
        *DILOCO_PARAMS,
        Param("fragments", int, 4, "integer >= 1 (<= period and <= the number of parameter tensors)",
              lambda v: v >= 1, "fragments synchronized at staggered steps (F)"),
        Param("overlap", int, 1, "integer >= 0 (< period)", lambda v: v >= 0,
              "inner steps a fragment's exchange overlaps before it is merged (T; 0: merged at once)"),
        Param("alpha", float, 0.5, "number in [0, 1]", lambda v: 0 <= v <= 1,
              "weight of the local value when a fragment is merged (0: take the outer value)"),
    )
    summary = ("Streaming DiLoCo: DiLoCo's outer step by fragments at staggered steps, each exchange "
               "overlapped with the next inner steps and merged with the local value")

    def setup(self) -> None:
        super().setup()
        period, frags, overlap = self.period, self.fragments, self.overlap  # type: ignore[attr-defined]
        if frags > period or frags > len(self.named):
            raise ValueError(f"algorithm {self.name!r}: parameter 'fragments' got {frags}; allowed: at most "
                             f"period={period} and at most the model's {len(self.named)} parameter tensors")
        if overlap >= period:
            raise ValueError(f"algorithm {self.name!r}: parameter 'overlap' got {overlap}; allowed: "
                             f"below period={period} (a fragment is merged before its next launch)")
        self.frags = balanced_fragments([p.numel() for _, p in self.named], frags)
        #: fragment launched at each offset within the period
        self.launch_at = {((f + 1) * period // frags) % period: f for f in range(frags)}
        self.pending: collections.deque[dict[str, Any]] = collections.deque()
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        #: bytes of the merged exchanges (what ``stats`` reports: independent of the thread's timing)
        self.merged_bytes = 0

    def step(self) -> None:
        self.local_step()
        frag = self.launch_at.get(self._steps % self.period)  # type: ignore[attr-defined]
        if frag is not None:
            self.launch(frag)
        while self.pending and self.pending[0]["due"] <= self._steps:
            self.merge(self.pending.popleft())

    # --------------------------------------------------------------- exchange
    @torch.no_grad()
    def launch(self, frag: int) -> None:
        """Take fragment ``frag``'s outer gradient now and start averaging it."""
        idx = self.frags[frag]
        item: dict[str, Any] = {
            "fragment": frag, "due": self._steps + self.overlap,  # type: ignore[attr-defined]
            "deltas": self.outer_gradient(idx),
            "buffers": [b.detach().clone() for b in self._float_buffers()] if frag == self.launch_at.get(0) else [],
            "exchange": self._exchanges, "bytes": 0,
        }
        # nonfinite: the fragment's inner state, or the buffers it carries, not finite at the launch drops (skip)
        # or fails (raise, checked after the exchange) it; the merge's restore and refresh are its own (below)
        item["guard"] = SyncGuard.before(self, item["deltas"], idx, buffers=bool(item["buffers"]))
        self._exchanges += 1
        if self.overlap == 0:  # type: ignore[attr-defined]
            item["bytes"] = self._exchange(item)
        else:
            if self.pool is None:
                self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"gradpress-{self.name}")
            item["future"] = self.pool.submit(self._exchange, item)
        self.pending.append(item)

    @torch.no_grad()
    def _exchange(self, item: dict[str, Any]) -> int:
        """Average the item's outer gradient (and buffers) in place; the
        bytes handed to collectives. Runs on the exchange thread when T > 0."""
        assert self.engine is not None
        before = self.engine.stats["bytes_sent"]
        guard: SyncGuard = item["guard"]
        keys, tensors = guard.riding([self.named[i][0] for i in self.frags[item["fragment"]]], item["deltas"])
        self.engine.sync(keys, tensors, step=item["exchange"])
        item["skipped"] = guard.skipped  # nonfinite=skip: merged without an outer step
        # nonfinite=raise: re-raised at the merge (or at a drain) on every rank
        guard.check(f"step {item['due'] - self.overlap} (fragment {item['fragment']}'s launch)")  # type: ignore[attr-defined]
        if item["buffers"]:
            t0 = time.perf_counter()
            summed, sent = fused_allreduce([b / self.world_size for b in item["buffers"]], self.group)
            for b, s in zip(item["buffers"], summed):
                b.copy_(s)
            self.engine.stats_counter.record(sent=sent, dense=0, compress_s=0.0, comm_s=time.perf_counter() - t0,
                                             compressed=0, plain=0, tensor_bytes={}, end_of_step=False)
        return self.engine.stats["bytes_sent"] - before

    def _wait(self, item: dict[str, Any]) -> None:
        future = item.pop("future", None)
        if future is not None:
            item["bytes"] = future.result()  # re-raises the exchange thread's error here

    @torch.no_grad()
    def merge(self, item: dict[str, Any]) -> None:
        """Apply an averaged outer gradient: outer step, then mix the local fragment."""
        self._wait(item)
        idx = self.frags[item["fragment"]]
        self._last["bytes"] += item["bytes"]
        self.merged_bytes += item["bytes"]
        # not SyncGuard.settle (which restores and refreshes what the exchange covered): a dropped fragment restores
        # every fragment, and a merge refreshes only the finite part of the copy; the buffers were averaged at launch
        if item.get("skipped", False) and self.restart is not None:
            # some rank diverged (a NaN spreads to its whole model at the next forward pass): theta and its
            # momentum stay, every rank restarts every fragment from theta with the inner state each fragment
            # had at its last merge, and the buffers of the last buffer merge
            for (_, p), a in zip(self.named, self.anchor):
                p.copy_(a)
            self.restart.restore()
            return
        self.apply_outer(idx, item["deltas"])
        weight = 1.0 - self.alpha  # type: ignore[attr-defined]
        for i in idx:  # weight 1: an exact copy (lerp_ would keep a diverged worker's NaN)
            p = self.named[i][1]
            p.copy_(self.anchor[i]) if weight == 1 else p.lerp_(self.anchor[i], weight)
        for b, avg in zip(self._float_buffers(), item["buffers"]):
            b.copy_(avg)
        if self.restart is not None:
            # this rank's copy of the fragment (and of the buffers) is refreshed only where it is finite: a
            # fragment launched before a divergence is merged after it (overlap >= 1) with a finite outer step,
            # while its local state already holds the NaN (a NaN copy made every later restart NaN again)
            self.restart.take(idx if self.restart.finite(idx) else [],
                              buffers=bool(item["buffers"]) and self.restart.buffers_finite())

    def _float_buffers(self) -> list[torch.Tensor]:
        return [b for b in self.model.buffers() if b.is_floating_point() and b.numel()]

    @property
    def stats(self) -> dict[str, Any]:
        """As every algorithm's, but ``bytes_sent`` and ``exchanges`` count
        the merged exchanges only, so they do not depend on how far the
        exchange thread has got."""
        out = super().stats
        out["bytes_sent"] = self.merged_bytes
        out["exchanges"] = self._exchanges - len(self.pending)
        out["ratio"] = out["dense_bytes"] / out["bytes_sent"] if out["bytes_sent"] else 1.0
        return out

    # ------------------------------------------------------------------ state
    def drain(self) -> None:
        """Wait for every exchange in flight (results stay pending until due)."""
        for item in self.pending:
            self._wait(item)

    def state_dict(self) -> dict[str, Any]:
        self.drain()  # the engine's residuals and stats must not move while they are copied
        return super().state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.drain()
        super().load_state_dict(state)

    def extra_state(self) -> dict[str, Any]:
        pending = [{"fragment": it["fragment"], "due": it["due"], "exchange": it["exchange"], "bytes": it["bytes"],
                    "skipped": bool(it.get("skipped", False)),
                    "deltas": [d.clone() for d in it["deltas"]], "buffers": [b.clone() for b in it["buffers"]]}
                   for it in self.pending]
        return {**super().extra_state(), "pending": pending, "merged_bytes": self.merged_bytes}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        super().load_extra_state(state)
        self.merged_bytes = int(state.get("merged_bytes", 0))
        self.pending.clear()
        for it in state.get("pending", []):
            idx = self.frags[int(it["fragment"])]
            if [tuple(d.shape) for d in it["deltas"]] != [tuple(self.named[i][1].shape) for i in idx]:
                raise ValueError(f"{self.name} state: a pending fragment does not match this model")
            self.pending.append({"fragment": int(it["fragment"]), "due": int(it["due"]),
                                 "exchange": int(it["exchange"]), "bytes": int(it["bytes"]),
                                 "skipped": bool(it.get("skipped", False)),
                                 "deltas": [d.clone() for d in it["deltas"]],
                                 "buffers": [b.clone() for b in it["buffers"]]})

    def close(self) -> None:
        """Wait for the exchanges in flight and stop the exchange thread."""
        try:
            self.drain()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)
                self.pool = None
