"""``onebit``: 1-bit SGD with two reconstruction values.

Seide et al. 2014, "1-Bit Stochastic Gradient Descent and its Application to
Data-Parallel Distributed Training of Speech DNNs". Each entry sends one bit,
(x_i >= 0); the decoder puts back the mean of the non-negative entries or
the mean of the negative entries (0 where a group is empty). Biased: the
quantization error goes to the residual (error feedback on by default), as
in the paper.

Each side's mean comes from its own sum (:func:`side_means`), never from
``(sum +- L1) / 2``, which cancels when one side dominates (``[-1e30, 1, 2,
3]`` would decode its positive side to 0); computed in fp32 (fp64 for fp64
inputs) and rescaled where a sum would overflow, so both means are accurate
for every finite input. fp64 inputs send each mean as the upper 32 bits of
its fp64 value rounded to nearest (fp64 range, relative precision 2^-21).

Packet: ``[means (fp32: non-negative mean, negative mean; int32 upper words
for fp64 inputs), bits (uint8)]``, bits packed 8 per byte. Wire size: 8 +
ceil(d/8) bytes.
"""

from __future__ import annotations

import math

import torch

from gradpress.compress.base import Compressor, Context, Packet
from gradpress.compress.bits import pack_bits
from gradpress.compress.numerics import compute_dtype, pack_scale, side_means, unpack_scale
from gradpress.compress.signs import unpack_two


class OneBit(Compressor):
    name = "onebit"
    contractive = True  # the two side means are the least-squares fit of the sign pattern
    summary = "1-bit SGD: sign mask + mean of each side, with error feedback (Seide et al. 2014)"
    uses_context = False  # a pure function of x

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        v = x.reshape(-1).to(compute_dtype(x.dtype))
        mask = v >= 0
        mean_pos, mean_neg = side_means(v, torch.count_nonzero(mask))
        means = pack_scale(torch.stack([mean_pos, mean_neg]), x.dtype)
        return Packet([means, pack_bits(mask, 1)], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        means, data = packet.tensors[0], packet.tensors[1]
        d = math.prod(packet.shape)
        values = unpack_scale(means, packet.dtype).flip(0).to(packet.dtype)  # bit 0 -> negative mean, 1 -> non-negative mean
        return unpack_two(data, d, values).reshape(packet.shape)
