"""The exchanges of Learned Gradient Compression (LGC), phases 2 and 3.

Abrahamyan et al., "Learned Gradient Compression for Distributed Deep
Learning", IEEE TNNLS 2021. Every function takes this rank's accumulated
gradient ``acc`` (the flat gradient of the whole model plus the error
feedback residual) and returns the average every rank applies, this rank's
new residual and the bytes it handed to collectives. The selection is a
top-k per parameter tensor (quotas) or one over the concatenated model, its
indices in the order of the leader's decreasing values (:func:`select`).

* :func:`shared_topk` (phase 2): the leader's top-k indices are broadcast;
  every rank allgathers its values at those indices; the average is their
  mean there. The gathered (N, k) matrix is the autoencoder's training batch:
  every rank holds it, so every rank trains the same autoencoder without
  shipping its weights.
* :func:`ps_latent` (phase 3, parameter server): the master broadcasts its
  indices, the latent of its values and their scale; each rank decodes every
  node's estimate ``s * dec_j(z)`` (identical on all ranks), and allgathers a
  small innovation top-k of what its own estimate misses. Average: mean of
  the decoded estimates plus the innovations' mean.
* :func:`ring_latent` (phase 3, ring allreduce): the leader broadcasts its
  indices and scale; every rank encodes its own values there; the latents are
  summed by allreduce (summable); the mean latent is decoded once.

Invariants: every rank computes the average from the same received bytes
with the same ops, in a fixed rank order, so it is bit-identical on all
ranks; a rank's residual is ``acc`` minus what it contributed (its decoded
estimate and its innovation), so nothing is silently lost. Nothing travels
in a world of one, but the bytes that would are counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradpress.algorithms.lgc_autoencoder import LGCAutoencoder, rms
from gradpress.transport.p2p import global_rank

__all__ = ["Exchanged", "Quotas", "Wire", "select", "total", "shared_topk", "ps_latent", "ring_latent"]


@dataclass
class Exchanged:
    """What one LGC exchange gives this rank."""

    average: torch.Tensor  #: flat averaged gradient (identical on every rank)
    residual: torch.Tensor  #: this rank's new error feedback residual
    sent: int  #: bytes this rank handed to collectives
    parts: dict[str, int]  #: bytes per part of the message (indices, values, latent, innovation)
    batch: torch.Tensor | None = None  #: phase 2: the (N, k) values every rank holds (autoencoder data)
    #: phase 3: ||decoded - x|| / ||x|| for this rank's own values (ps: on the master only), a 0-d tensor
    rel_error: torch.Tensor | None = None
    #: the ``flags`` of every rank summed (float32; None when none were passed)
    flags: torch.Tensor | None = None


def _as_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def _from_bytes(buf: torch.Tensor, like: list[tuple[int, torch.dtype]]) -> list[torch.Tensor]:
    """The tensors packed in ``buf``; a part that does not start at a
    multiple of its element size (float64 values after an odd number of
    int32 indices) is copied out, since a byte view cannot be reinterpreted there."""
    out, offset = [], 0
    for n, dtype in like:
        item = torch.empty((), dtype=dtype).element_size()
        part = buf[offset : offset + n * item]
        out.append((part if part.storage_offset() % item == 0 else part.clone()).view(dtype))
        offset += n * item
    return out


class Wire:
    """Fixed-size broadcast, allgather and allreduce of a few flat tensors
    packed into one byte buffer (one collective each); returns the bytes
    handed over (a broadcast counts its buffer on every rank, as every rank
    hands it to the collective)."""

    def __init__(self, group: dist.ProcessGroup | None, world: int, rank: int) -> None:
        self.group, self.world, self.rank = group, world, rank

    def broadcast(self, tensors: list[torch.Tensor], src: int) -> tuple[list[torch.Tensor], int]:
        """Rank ``src``'s ``tensors``; the others pass tensors of the same
        sizes and dtypes (their contents are ignored)."""
        buf = _as_bytes(tensors)
        if self.world > 1:
            buf = buf.clone()
            dist.broadcast(buf, global_rank(self.group, src), group=self.group)
        return _from_bytes(buf, [(t.numel(), t.dtype) for t in tensors]), buf.numel()

    def allgather(self, tensors: list[torch.Tensor]) -> tuple[list[list[torch.Tensor]], int]:
        """Every rank's ``tensors`` (same sizes on every rank), rank order."""
        buf = _as_bytes(tensors)
        like = [(t.numel(), t.dtype) for t in tensors]
        if self.world == 1:
            return [_from_bytes(buf, like)], buf.numel()
        out = torch.empty(self.world * buf.numel(), dtype=torch.uint8, device=buf.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, buf, group=self.group)
        n = buf.numel()
        return [_from_bytes(out[r * n : (r + 1) * n], like) for r in range(self.world)], n

    def allreduce(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The elementwise sum of every rank's ``t``."""
        out = t.clone()
        if self.world > 1:
            dist.all_reduce(out, group=self.group)
        return out, out.numel() * out.element_size()


#: (offset, numel, kept) per segment of the flat gradient: a top-k quota per parameter tensor
Quotas = list[tuple[int, int, int]]


def total(quotas: Quotas) -> int:
    """k: the number of values the quotas keep."""
    return sum(q for _, _, q in quotas)


def select(acc: torch.Tensor, quotas: Quotas, absent: torch.Tensor | None = None) -> torch.Tensor:
    """The int32 indices of the ``kept`` largest |acc| of each segment,
    ordered by decreasing signed value of ``acc`` there: the autoencoder then
    sees a monotone curve, which a 4:1 convolutional code represents well,
    and the order costs nothing (the indices travel in it). One loop over
    segments (parameter tensors), none over elements. ``absent`` (bool, per
    entry): entries of parameters no rank has a gradient for, which a segment
    that also holds others' entries (one top-k over the whole model) ranks
    below all of those: they take a slot only when nothing else is left."""
    mag = acc.abs()
    idx = torch.cat([torch.topk(_ranked(mag[o : o + n], None if absent is None else absent[o : o + n]), q,
                                sorted=False).indices + o for o, n, q in quotas])
    order = torch.sort(acc[idx], descending=True, stable=True).indices
    return idx[order].to(torch.int32)


def _ranked(mag: torch.Tensor, absent: torch.Tensor | None) -> torch.Tensor:
    """``mag`` with the ``absent`` entries below every other one (-1 < 0 <= |x|), unless all are absent."""
    if absent is None or not bool(absent.any()) or bool(absent.all()):
        return mag
    return mag.masked_fill(absent, -1.0)


def shared_topk(wire: Wire, acc: torch.Tensor, quotas: Quotas, leader: int,
                flags: torch.Tensor | None = None, absent: torch.Tensor | None = None) -> Exchanged:
    """Phase 2: top-k at the leader's indices (``absent``: see :func:`select`), values allgathered (with
    ``flags``, float32, which come back summed over ranks)."""
    k = total(quotas)
    mine = select(acc, quotas, absent) if wire.rank == leader else torch.zeros(k, dtype=torch.int32, device=acc.device)
    (idx,), sent_idx = wire.broadcast([mine], leader)
    idx = idx.long()
    gathered, sent_val = wire.allgather([acc[idx], *([flags] if flags is not None else [])])
    summed = torch.stack([g[1] for g in gathered]).sum(0) if flags is not None else None
    batch = torch.stack([g[0] for g in gathered])
    average = torch.zeros_like(acc)
    average[idx] = batch.sum(0) / wire.world
    residual = acc.clone()
    residual[idx] = 0
    return Exchanged(average, residual, sent_idx + sent_val, {"indices": sent_idx, "values": sent_val}, batch,
                     flags=summed)


@torch.no_grad()
def ps_latent(wire: Wire, acc: torch.Tensor, quotas: Quotas, k_inn: int, master: int,
              ae: LGCAutoencoder, flags: torch.Tensor | None = None,
              absent: torch.Tensor | None = None) -> Exchanged:
    """Phase 3, parameter-server variant (module doc); ``flags`` ride with
    the innovations (an allreduce of their own without innovations);
    ``absent`` entries rank last in the master's selection (:func:`select`)
    and in the innovation top-k, which spans the whole model."""
    latent, k = ae.latent, total(quotas)
    if wire.rank == master:
        idx = select(acc, quotas, absent)
        scale = rms(acc[idx.long()]).reshape(1)
        z = ae.encode((acc[idx.long()] / scale).reshape(1, -1)).reshape(-1)
    else:
        idx = torch.zeros(k, dtype=torch.int32, device=acc.device)
        scale = torch.zeros(1, dtype=torch.float32, device=acc.device)
        z = torch.zeros(latent, dtype=torch.float32, device=acc.device)
    (idx, z, scale), sent_head = wire.broadcast([idx, z, scale], master)
    idx = idx.long()
    decoded = (ae.decode_all(z) * scale).to(acc.dtype)  # (N, k): node j's estimate by decoder j
    missed = acc.clone()
    missed[idx] -= decoded[wire.rank]
    inn_idx = torch.topk(_ranked(missed.abs(), absent), k_inn, sorted=False).indices.sort().values
    extra = [flags] if flags is not None else []
    flags_sum, sent_flags = None, 0
    if k_inn:
        gathered, sent_inn = wire.allgather([inn_idx.to(torch.int32), missed[inn_idx], *extra])
        flags_sum = torch.stack([g[2] for g in gathered]).sum(0) if extra else None
    else:
        gathered, sent_inn = [], 0
        if flags is not None:
            flags_sum, sent_flags = wire.allreduce(flags)
    summed = torch.zeros_like(acc)
    summed[idx] = decoded.sum(0)
    for r_idx, r_val, *_ in gathered:  # fixed rank order: identical sums on every rank
        summed.index_add_(0, r_idx.long(), r_val)
    residual = missed
    residual[inn_idx] = 0
    parts = {"header": sent_head, "innovation": sent_inn, **({"flags": sent_flags} if sent_flags else {})}
    err = None
    if wire.rank == master:
        x = acc[idx]
        err = (decoded[master] - x).norm() / x.norm().clamp_min(torch.finfo(x.dtype).tiny)
    return Exchanged(summed / wire.world, residual, sent_head + sent_inn + sent_flags, parts, rel_error=err,
                     flags=flags_sum)


@torch.no_grad()
def ring_latent(wire: Wire, acc: torch.Tensor, quotas: Quotas, leader: int, ae: LGCAutoencoder,
                flags: torch.Tensor | None = None, absent: torch.Tensor | None = None) -> Exchanged:
    """Phase 3, ring-allreduce variant (module doc); ``flags`` are summed
    in the latents' allreduce; ``absent``: see :func:`select`."""
    k = total(quotas)
    if wire.rank == leader:
        idx = select(acc, quotas, absent)
        scale = rms(acc[idx.long()]).reshape(1)
    else:
        idx = torch.zeros(k, dtype=torch.int32, device=acc.device)
        scale = torch.zeros(1, dtype=torch.float32, device=acc.device)
    (idx, scale), sent_head = wire.broadcast([idx, scale], leader)
    idx = idx.long()
    z = ae.encode((acc[idx] / scale).reshape(1, -1))
    n_z = z.numel()
    summed, sent_z = wire.allreduce(torch.cat([z.reshape(-1), *([flags.float()] if flags is not None else [])]))
    summed, flags_sum = summed[:n_z], (summed[n_z:] if flags is not None else None)
    average = torch.zeros_like(acc)
    average[idx] = (ae.decode(summed.reshape(1, -1) / wire.world, 0).reshape(-1) * scale).to(acc.dtype)
    own = (ae.decode(z, 0).reshape(-1) * scale).to(acc.dtype)
    residual = acc.clone()
    residual[idx] -= own
    x = acc[idx]
    err = (own - x).norm() / x.norm().clamp_min(torch.finfo(x.dtype).tiny)
    return Exchanged(average, residual, sent_head + sent_z, {"header": sent_head, "latent": sent_z}, rel_error=err,
                     flags=flags_sum)
