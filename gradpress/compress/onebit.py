"""``onebit``: 1-bit SGD with two reconstruction values.

Seide et al. 2014, "1-Bit Stochastic Gradient Descent and its Application to
Data-Parallel Distributed Training of Speech DNNs". Each entry sends one bit,
(x_i >= 0); the decoder puts back the mean of the non-negative entries or
the mean of the negative entries (0 where a group is empty). Biased: the
quantization error goes to the residual (error feedback on by default), as
in the paper.

Packet: ``[means (fp32: non-negative mean, negative mean), bits (uint8)]``,
bits packed 8 per byte. Wire size: 8 + ceil(d/8) bytes.
"""

from __future__ import annotations

import math

import torch

from gradpress.compress.base import Compressor, Context, Packet
from gradpress.compress.bits import pack_bits
from gradpress.compress.qsgd import compute_dtype
from gradpress.compress.registry import register
from gradpress.compress.signsgd import unpack_two


@register
class OneBit(Compressor):
    name = "onebit"
    summary = "1-bit SGD: sign mask + mean of each side, with error feedback (Seide et al. 2014)"
    uses_context = False  # a pure function of x

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        v = x.reshape(-1).to(compute_dtype(x.dtype))
        mask = v >= 0
        # sum(v >= 0 part) = (sum v + sum |v|) / 2, the negative part (sum v - sum |v|) / 2:
        # two fused reductions, no float temporaries
        total, l1 = v.sum(), torch.linalg.vector_norm(v, ord=1)
        n_pos = torch.count_nonzero(mask).to(v.dtype)
        n_neg = v.numel() - n_pos
        mean_pos = (total + l1) / 2 / n_pos.clamp(min=1)
        mean_neg = (total - l1) / 2 / n_neg.clamp(min=1)
        means = torch.stack([mean_pos, mean_neg]).float()
        return Packet([means, pack_bits(mask, 1)], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        means, data = packet.tensors[0], packet.tensors[1]
        d = math.prod(packet.shape)
        cdt = compute_dtype(packet.dtype)
        values = means.to(cdt).flip(0).to(packet.dtype)  # bit 0 -> negative mean, 1 -> non-negative mean
        return unpack_two(data, d, values).reshape(packet.shape)
