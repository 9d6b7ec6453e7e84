"""``signsgd``: send the sign of each entry, 1 bit; aggregate by majority vote.

Bernstein et al. 2018, "signSGD: Compressed Optimisation for Non-Convex
Problems" (and "signSGD with Majority Vote is Communication Efficient and
Fault Tolerant", 2019). ``aggregation = "majority"``: the strategy returns
sign(sum of the ranks' decoded signs) instead of their mean.

Decode gives +1 or -1 (in the input dtype); sign(0) is taken as +1 (a zero
has no sign bit to send; NaN decodes as -1). Biased, but error feedback is off
by default: majority vote is the method as published (use ``efsignsgd`` for
the error-compensated, scaled variant).

Packet: ``[bits (uint8)]``, bit i = (x_i >= 0), packed 8 per byte
(:func:`gradpress.compress.bits.pack_bits`). Wire size: ceil(d/8) bytes.
"""

from __future__ import annotations

import math

import torch

from gradpress.compress.base import Compressor, Context, Packet
from gradpress.compress.bits import byte_table, pack_bits
from gradpress.compress.registry import register


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """1 bit per entry of flat ``x``: 1 where x >= 0, packed 8 per byte."""
    return pack_bits(x.reshape(-1) >= 0, 1)


def unpack_signs(data: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Flat +1/-1 tensor of ``dtype`` from :func:`pack_signs` output."""
    return unpack_two(data, numel, torch.tensor([-1.0, 1.0], dtype=dtype, device=data.device))


def unpack_two(data: torch.Tensor, numel: int, values: torch.Tensor) -> torch.Tensor:
    """Flat tensor of ``values[bit]`` (``values`` = [value of 0, value of 1])
    from 1-bit packed ``data``: one gather through a 256-entry table."""
    table = byte_table(1, values.dtype, data.device, values)
    return table[data.long()].reshape(-1)[:numel]


@register
class SignSGD(Compressor):
    name = "signsgd"
    aggregation = "majority"
    summary = "signSGD: 1-bit signs with majority-vote aggregation (Bernstein et al. 2018)"
    uses_context = False  # a pure function of x

    @property
    def default_error_feedback(self) -> bool:
        return False

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        return Packet([pack_signs(x)], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        d = math.prod(packet.shape)
        return unpack_signs(packet.tensors[0], d, packet.dtype).reshape(packet.shape)
