"""``randomk``: keep k = ceil(ratio * d) entries chosen at random, the same
entries on every rank.

Stich et al. 2018 ("Sparsified SGD with memory"); Wangni et al. 2018. The
indices are drawn from ``ctx.shared_seed`` (run seed, step, tensor key), which
every rank derives identically, so only the values travel and packets are
summable: the elementwise sum of several ranks' value payloads decodes to the
sum of their decodings. With ``scale=True`` the kept values are multiplied by
d/k, which makes the compressor unbiased (E[decode(encode(x))] = x);
otherwise it is biased (contractive) and error feedback is on by default.
The scaling is computed in fp32 (fp64 for fp64 inputs) and saturates at the
input dtype's maximum (fp16: kept values above 65504 * k/d lose their
unbiasedness instead of becoming inf).

Packet: ``[values (input dtype, k entries)]``; ``meta["seed"]`` holds the
index seed, which is *not* sent: every rank can recompute it from the same
(seed, step, key). ``decode`` regenerates the indices from ``meta["seed"]``,
so a packet rebuilt from the wire must carry the local packet's ``meta``
(the strategies copy it from this rank's own packet for the same tensor);
without it ``decode`` raises ``ValueError``. Wire size: k * element size.

As the first stage of a composition (``randomk:ratio=0.01>natural``) the
value count k follows from the shape and ratio (``values_count``).
"""

from __future__ import annotations

import math

import torch

from gradpress.compress.base import Compressor, Context, Packet, Param, generator_for
from gradpress.compress.numerics import compute_dtype
from gradpress.compress.params import ratio_param
from gradpress.compress.registry import register
from gradpress.compress.sparse import kept_count, scatter_sparse


def random_indices(numel: int, k: int, seed: int, device: torch.device) -> torch.Tensor:
    """k distinct flat indices in ``range(numel)``, uniformly random among all
    k-subsets, a pure function of (numel, k, seed, device type).

    For k well below numel: draw k + k/8 + 64 indices with replacement, keep
    the distinct ones (a uniformly random subset of its size, by symmetry)
    and take a uniformly random k of them: O(k log k) instead of a full
    ``randperm(numel)``. Falls back to ``randperm`` when too few are distinct
    or k is a large fraction of numel.
    """
    gen = generator_for(device, seed)
    if 0 < 4 * k <= numel:
        draws = torch.randint(0, numel, (k + k // 8 + 64,), generator=gen, device=device)
        distinct = torch.unique(draws)
        if distinct.numel() >= k:
            return distinct[torch.randperm(distinct.numel(), generator=gen, device=device)[:k]]
    return torch.randperm(numel, generator=gen, device=device)[:k]


@register
class RandomK(Compressor):
    name = "randomk"
    PARAMS = (
        ratio_param(0.01),
        Param("scale", bool, False, "true or false", None, "multiply kept values by d/k (unbiased)"),
    )
    summable = True
    values_index = 0
    summary = "random-k sparsification with shared-seed indices (Stich et al. 2018); values only, summable"

    @property
    def is_unbiased(self) -> bool:
        return bool(self.scale)

    @property
    def is_contractive(self) -> bool:
        """Unscaled: delta = k/d in expectation (Stich et al. 2018)."""
        return not self.scale

    def variance_factor(self, numel: int) -> float | None:
        k = kept_count(numel, self.ratio)
        return numel / k - 1.0 if self.scale and k else None

    def values_count(self, rest: list[torch.Tensor], shape: torch.Size, meta: dict) -> int:
        return kept_count(math.prod(shape), self.ratio)

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        flat = x.reshape(-1)
        d = flat.numel()
        k = kept_count(d, self.ratio)
        seed = ctx.shared_seed
        idx = random_indices(d, k, seed, flat.device)
        values = flat[idx]
        if self.scale and k:  # in fp32 (fp64), saturating at the dtype's maximum instead of overflowing
            big = torch.finfo(x.dtype).max
            values = (values.to(compute_dtype(x.dtype)) * (d / k)).clamp_(-big, big).to(x.dtype)
        return Packet([values.contiguous()], x.shape, x.dtype, meta={"seed": seed})

    def decode(self, packet: Packet) -> torch.Tensor:
        seed = packet.meta.get("seed")
        if seed is None:
            raise ValueError(
                "randomk: packet.meta has no 'seed'; a packet rebuilt from the wire must carry the "
                "meta of this rank's own packet for the same tensor (same step and key)"
            )
        values = packet.tensors[0]
        d = math.prod(packet.shape)
        idx = random_indices(d, values.numel(), seed, values.device)
        return scatter_sparse(values, idx, packet.shape, packet.dtype)
