"""``lgc:dense_steps=200,ae_steps=200,ratio=0.003,variant=ring``: Learned Gradient Compression.

Abrahamyan, Chen, Bekoulis, Deligiannis, "Learned Gradient Compression for
Distributed Deep Learning", IEEE TNNLS 2021. The workers' gradients are
highly correlated, so an autoencoder trained *during* training on the
exchanged sparse gradients compresses them far beyond top-k. Three phases on
a step schedule (step t counts optimizer steps from 0):

1. ``t < dense_steps``: synchronous data parallel SGD; the gradients are
   averaged through the exchange engine with the algorithm's compressor
   (default ``none``: dense; any ``--compressor`` applies to this phase only).
2. ``t < dense_steps + ae_steps``: top-k with error feedback, a quota of
   ceil(ratio * numel) per parameter tensor (``per_tensor=true``; false: one
   top-k over the whole model), all kept values forming one vector of k for
   the autoencoder, in the leader's order of decreasing value: the leader's
   indices are broadcast, every rank allgathers its values there
   (:func:`~gradpress.algorithms.lgc_exchange.shared_topk`). Every rank then
   trains the autoencoder (:mod:`~gradpress.algorithms.lgc_autoencoder`)
   on the gathered (N, k) values with its own Adam optimizer: the same data,
   weights and ops on every rank, so no autoencoder weights travel.
3. afterwards: the encoder and decoders are frozen; at the first phase-3 step
   rank 0 broadcasts their weights once (counted in ``stats['ae_bytes']``),
   so the frozen codec is identical even where floating point differs
   between machines. ``variant=ps``: the master sends its indices, latent
   and scale; every rank sends a small innovation top-k (ratio
   ``innovation``) of what the master's reconstruction misses for it.
   ``variant=ring``: the leader sends indices and scale; latents are averaged
   by allreduce and decoded once.

The leader (master) is ``t mod N`` (rotating) or the fixed rank ``master``.
Error feedback is on in phases 2 and 3 (one flat residual per rank); at the
first phase-2 step it takes over what phase 1's compressor left in the
engine's residuals, so nothing phase 1 dropped is abandoned.
Defaults (ring, ratio 3e-3, 200 dense steps) are the ones measured in
docs/lgc.md: on mnist1d-cnn the paper's PS setting (ratio 1e-3, innovation
1e-5) loses several points of accuracy; ring at 3e-3 stays near DDP.

Invariants: every rank applies the bit-identical averaged gradient at every
step (so parameters and optimizer state stay identical: ``replicated``);
every byte handed to a collective is in ``stats`` (``ae_bytes`` is the
autoencoder's own share, zero but for the one broadcast at the freeze);
``state_dict`` holds the residual, the autoencoder and its optimizer.
A parameter whose ``.grad`` is None follows DDP's rule in every phase: one
float32 flag per parameter rides in the step's collective (phase 2: the
values' allgather; ring: the latents' allreduce; ps: the innovations'
allgather, or an allreduce of its own without innovations); a parameter no
rank has a gradient for keeps ``.grad`` None (the optimizer skips it) and
its residual; one some rank lacks gets zeros there. Where a selection spans
several parameters (``per_tensor=false``; ps's innovation top-k) the flags
are summed first, in an allreduce of their own, and such a parameter's
entries rank below every other in the selection: it takes no slot.
Limits: one floating dtype for all trainable parameters; NaN/Inf gradients
are not screened in phases 2 and 3 (``nonfinite`` must be ``propagate``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import torch

from gradpress.algorithms.base import Algorithm
from gradpress.algorithms.lgc_autoencoder import LGCAutoencoder, rms, train_step
from gradpress.algorithms.lgc_exchange import Exchanged, Wire, ps_latent, ring_latent, shared_topk, total
from gradpress.algorithms.presence import agreed
from gradpress.algorithms.registry import register
from gradpress.compress.base import Param
from gradpress.exchange.feedback import Feedback


@register
class LGC(Algorithm):
    name = "lgc"
    #: module doc of gradpress.algorithms.loss_scale
    scaler_refusal = ("its compressed phase exchanges autoencoder latents of accumulated gradients and trains the "
                      "autoencoder on them; an overflowed step's agreement is not wired into that exchange")
    PARAMS = (
        Param("dense_steps", int, 200, "integer >= 0", lambda v: v >= 0, "phase 1: synchronous steps first"),
        Param("ae_steps", int, 200, "integer >= 1", lambda v: v >= 1,
              "phase 2: top-k steps while the autoencoder trains; phase 3 follows"),
        Param("ratio", float, 3e-3, "0 < ratio <= 1", lambda v: 0 < v <= 1,
              "top-k density over the whole model (k = ceil(ratio * d)); latent ceil(k/4)"),
        Param("per_tensor", bool, True, "true or false", lambda v: isinstance(v, bool),
              "top-k quota per parameter tensor (ceil(ratio * numel) each, so every tensor moves every step) "
              "instead of one top-k over the whole model"),
        Param("innovation", float, 1e-5, "0 <= innovation <= 1", lambda v: 0 <= v <= 1,
              "ps variant: density of each rank's innovation top-k (0: none; else at least 1 element)"),
        Param("variant", str, "ring", "ps or ring", lambda v: v in ("ps", "ring"),
              "phase 3: parameter server (master latent + innovations) or ring (allreduced latents)"),
        Param("master", int, -1, "-1 (rotate) or a rank >= 0", lambda v: v >= -1,
              "the leader/master rank: -1 rotates it (t mod N), r >= 0 fixes it"),
        Param("ae_lr", float, 3e-3, "float > 0", lambda v: v > 0, "the autoencoder's Adam learning rate"),
        Param("ae_iters", int, 2, "integer >= 1", lambda v: v >= 1, "autoencoder optimizer steps per phase-2 step"),
        Param("channels", int, 8, "integer >= 1", lambda v: v >= 1, "channels of the autoencoder's convolutions"),
    )
    summary = ("learned gradient compression (Abrahamyan et al. 2021): dense, then top-k while an autoencoder "
               "learns the exchanged values, then latents (ps: master latent + innovations; ring: allreduced)")
    #: every rank applies the same averaged gradient: parameters and optimizer state stay identical
    replicated = True

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        dtypes = {p.dtype for _, p in self.named}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ValueError(f"algorithm 'lgc': all trainable parameters must share one floating dtype, "
                             f"got {sorted(str(d) for d in dtypes)}")
        assert self.engine is not None
        if self.engine.config().get("nonfinite", "propagate") != "propagate":
            raise ValueError("algorithm 'lgc': nonfinite must be 'propagate' (phases 2 and 3 do not screen "
                             "NaN/Inf gradients)")
        master = self.master  # type: ignore[attr-defined]
        if master >= self.world_size:
            raise ValueError(f"algorithm 'lgc': master={master} is not a rank of this group; allowed: -1 "
                             f"(rotate) or 0..{self.world_size - 1}")
        self.numel = sum(p.numel() for _, p in self.named)
        ratio = self.ratio  # type: ignore[attr-defined]
        if self.per_tensor:  # type: ignore[attr-defined]
            sizes = [p.numel() for _, p in self.named]
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            self.quotas = [(o, n, math.ceil(ratio * n)) for o, n in zip(offsets, sizes) if n]
        else:
            self.quotas = [(0, self.numel, math.ceil(ratio * self.numel))]
        self.k = total(self.quotas)
        if self.k < 4:
            raise ValueError(f"algorithm 'lgc': ratio={ratio} keeps k={self.k} of {self.numel} values; the latent "
                             f"needs k >= 4: allowed ratio >= {4 / self.numel:.3g} for this model")
        inn = self.innovation  # type: ignore[attr-defined]
        self.k_inn = 0 if inn == 0 or self.variant == "ring" else max(1, math.ceil(inn * self.numel))  # type: ignore[attr-defined]
        self.ae = LGCAutoencoder(self.k, self.world_size if self.variant == "ps" else 1,  # type: ignore[attr-defined]
                                 self.channels, seed=self.engine.seed)  # type: ignore[attr-defined]
        self.ae_optimizer = torch.optim.Adam(self.ae.parameters(), lr=self.ae_lr)  # type: ignore[attr-defined]
        device = next(iter(self.named))[1].device
        self.ae.to(device)
        self.residual = torch.zeros(self.numel, dtype=next(iter(dtypes)), device=device)
        self.wire = Wire(self.group, self.world_size, self.rank)
        self.frozen = False
        self.ae_bytes = 0
        self.ae_losses: list[torch.Tensor] = []
        #: phase 3: relative reconstruction error of this rank's own values (ps: when it is the master)
        self._err: tuple[torch.Tensor | float, int] = (0.0, 0)

    # --------------------------------------------------------------- schedule
    def phase_at(self, step: int) -> int:
        """The phase (1, 2 or 3) of optimizer step ``step`` (counted from 0)."""
        if step < self.dense_steps:  # type: ignore[attr-defined]
            return 1
        return 2 if step < self.dense_steps + self.ae_steps else 3  # type: ignore[attr-defined]

    def leader_at(self, step: int) -> int:
        """The leader (master) rank of step ``step``."""
        return self.master if self.master >= 0 else step % self.world_size  # type: ignore[attr-defined]

    @property
    def phase(self) -> int:
        """The phase of the next step."""
        return self.phase_at(self._steps)

    # ------------------------------------------------------------------- step
    def step(self) -> None:
        if self.phase == 1:
            self.dense_step()
        else:
            self.compressed_step()

    def dense_step(self) -> None:
        """Phase 1: DDP's step (gradients averaged through the engine)."""
        self.ddp_step()

    @torch.no_grad()
    def compressed_step(self) -> None:
        """Phases 2 and 3: the LGC exchange of the accumulated gradient."""
        step, phase = self._steps, self.phase
        self._last["bytes"] = self._last["host"] = 0
        params = [p for _, p in self.named]
        self._adopt_phase1_residual()
        mine = [p.grad is not None for p in params]
        flags = torch.tensor([float(b) for b in mine], dtype=torch.float32, device=self.residual.device)
        flat = torch.cat([g.reshape(-1) for g in self.gradients()])
        acc = flat + self.residual
        leader = self.leader_at(step)
        t0 = time.perf_counter()
        train_s = 0.0
        first, absent, flag_bytes = None, None, 0
        if self._flags_first(phase):  # summed before the selections, which then skip what no rank has
            first, flag_bytes = self.wire.allreduce(flags)
            absent = self._absent(agreed(mine, first))
            flags = None  # not sent again with the step's values
        if phase == 2:
            ex = shared_topk(self.wire, acc, self.quotas, leader, flags, absent)
            t1 = time.perf_counter()
            assert ex.batch is not None
            self.ae_losses.append(train_step(self.ae, self.ae_optimizer, ex.batch / rms(ex.batch[leader]),
                                             iters=self.ae_iters))  # type: ignore[attr-defined]
            train_s = time.perf_counter() - t1
        else:
            if not self.frozen:
                self.freeze()
            ex = self._latent_exchange(acc, leader, flags, absent)
            if ex.rel_error is not None:
                self._err = (self._err[0] + ex.rel_error, self._err[1] + 1)
        if flag_bytes:
            ex.sent += flag_bytes
            ex.parts["flags"] = flag_bytes
        present = agreed(mine, first if first is not None else ex.flags)
        self.residual = self._keep_absent(ex.residual, acc, present)
        self._apply(params, ex, present)
        self._count(ex, comm_s=time.perf_counter() - t0 - train_s, compress_s=train_s)
        self.average_plain(list(self.model.buffers()))
        sent = self._last["bytes"]
        self.local_step()
        self._last["bytes"] = sent

    def _adopt_phase1_residual(self) -> None:
        """Move what phase 1's compressor left in the engine's worker
        residuals (keyed by parameter name) into the flat residual, so that
        error feedback releases it in phases 2 and 3 instead of abandoning it.
        Once, at the first compressed step (a no-op afterwards: nothing is left)."""
        assert self.engine is not None
        store = self.engine.feedback.residuals
        offset = 0
        for name, p in self.named:
            held = store.pop(Feedback.of(name), None)
            if held is not None and held.numel() == p.numel():
                self.residual[offset : offset + p.numel()] += held.reshape(-1).to(self.residual.dtype)
            offset += p.numel()

    def _latent_exchange(self, acc: torch.Tensor, leader: int, flags: torch.Tensor | None,
                         absent: torch.Tensor | None) -> Exchanged:
        if self.variant == "ps":  # type: ignore[attr-defined]
            return ps_latent(self.wire, acc, self.quotas, self.k_inn, leader, self.ae, flags, absent)
        return ring_latent(self.wire, acc, self.quotas, leader, self.ae, flags, absent)

    def _flags_first(self, phase: int) -> bool:
        """Whether this step's presence flags are summed before its exchange (an allreduce of their own, the
        same 4P bytes that otherwise ride in it): when a selection spans several parameters (one top-k over
        the whole model, ``per_tensor=false``; ps's innovation top-k), so that DDP's rule holds there too (a
        parameter no rank has takes no slot). Per-tensor quotas need no flags first: a tensor's quota is
        its own."""
        return not self.per_tensor or (phase == 3 and self.variant == "ps" and self.k_inn > 0)  # type: ignore[attr-defined]

    def _absent(self, present: list[bool]) -> torch.Tensor | None:
        """Per flat entry, whether its parameter is one no rank has a gradient for (None: there is none)."""
        if all(present):
            return None
        sizes = [p.numel() for _, p in self.named]
        flags = torch.tensor([not some for some in present], device=self.residual.device)
        return flags.repeat_interleave(torch.tensor(sizes, device=self.residual.device))

    def _keep_absent(self, residual: torch.Tensor, acc: torch.Tensor, present: list[bool]) -> torch.Tensor:
        """DDP's rule for a parameter no rank has a gradient for: nothing of
        it counts as sent, so its residual stays what it was (``acc`` there:
        its gradient is zero on every rank)."""
        offset = 0
        for (_, p), some in zip(self.named, present):
            if not some:
                residual[offset : offset + p.numel()] = acc[offset : offset + p.numel()]
            offset += p.numel()
        return residual

    def _apply(self, params: list[torch.Tensor], ex: Exchanged, present: list[bool]) -> None:
        """The average into ``.grad``; a parameter no rank has a gradient for
        keeps ``.grad`` None (the optimizer skips it, as under DDP)."""
        offset = 0
        for p, some in zip(params, present):
            g = ex.average[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if not some:
                continue
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)

    def _count(self, ex: Exchanged, comm_s: float, compress_s: float) -> None:
        assert self.engine is not None
        self._last["bytes"] += ex.sent
        self.engine.stats_counter.record(sent=ex.sent, dense=0, compress_s=compress_s, comm_s=comm_s,
                                         compressed=len(self.named), plain=0,
                                         tensor_bytes={f"lgc:{k}": v for k, v in ex.parts.items()},
                                         end_of_step=True)
        self._exchanges += 1

    @torch.no_grad()
    def freeze(self) -> None:
        """End of phase 2: rank 0's autoencoder weights on every rank
        (one broadcast, counted as autoencoder traffic); no more training."""
        weights = [p.detach() for p in self.ae.parameters()]
        got, sent = self.wire.broadcast(weights, 0)
        for p, w in zip(weights, got):
            p.copy_(w.view_as(p))
        for p in self.ae.parameters():
            p.requires_grad_(False)
        self.ae.eval()
        self.frozen = True
        self.ae_bytes += sent
        assert self.engine is not None
        self.engine.stats_counter.record(sent=sent, dense=0, compress_s=0.0, comm_s=0.0, compressed=0, plain=0,
                                         tensor_bytes={}, end_of_step=False)
        self._last["bytes"] += sent

    # -------------------------------------------------------------- reporting
    def ae_loss_history(self) -> list[float]:
        """The autoencoder's loss at each phase-2 step (before its update)."""
        return [float(v) for v in self.ae_losses]

    @property
    def stats(self) -> dict[str, Any]:
        """As every algorithm's, plus ``lgc_phase`` (of the next step),
        ``ae_bytes`` (the autoencoder's own traffic, included in
        ``bytes_sent``), ``ae_loss`` (the last phase-2 loss, None before) and
        ``ae_rel_error`` (mean over phase-3 steps of ||decoded - x|| / ||x||
        for this rank's own top-k values; ps: steps where it was the master;
        a diagnostic computed locally, not exchanged)."""
        out = super().stats
        out["lgc_phase"] = self.phase
        out["ae_bytes"] = self.ae_bytes
        out["ae_loss"] = float(self.ae_losses[-1]) if self.ae_losses else None
        out["ae_rel_error"] = float(self._err[0]) / self._err[1] if self._err[1] else None
        return out

    def describe(self) -> dict[str, Any]:
        stats = self.stats
        return {**super().describe(), "k": self.k, "latent": self.ae.latent, "innovation_k": self.k_inn,
                **{key: stats[key] for key in ("ae_bytes", "ae_loss", "ae_rel_error")}}

    # ------------------------------------------------------------------ state
    def extra_state(self) -> dict[str, Any]:
        return {"residual": self.residual.clone(), "ae": {k: v.clone() for k, v in self.ae.state_dict().items()},
                "ae_optimizer": self.ae_optimizer.state_dict(), "frozen": self.frozen, "ae_bytes": self.ae_bytes,
                "ae_losses": torch.stack(self.ae_losses) if self.ae_losses else torch.zeros(0)}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        if "residual" not in state or state["residual"].shape != self.residual.shape:
            raise ValueError("lgc state: residual missing or of another model")
        self.residual = state["residual"].clone().to(self.residual)
        self.ae.load_state_dict(state["ae"])
        self.ae_optimizer.load_state_dict(state["ae_optimizer"])
        self.frozen = bool(state["frozen"])
        for p in self.ae.parameters():  # both ways: a failed load puts back an unfrozen state
            p.requires_grad_(not self.frozen)
        self.ae.train(not self.frozen)
        self.ae_bytes = int(state["ae_bytes"])
        self.ae_losses = list(state["ae_losses"].unbind(0)) if state["ae_losses"].numel() else []
