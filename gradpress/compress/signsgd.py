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

import torch

from gradpress.compress.base import Compressor, Context, Packet
from gradpress.compress.registry import register
from gradpress.compress.signs import decode_signs, pack_signs


@register
class SignSGD(Compressor):
    name = "signsgd"
    aggregation = "majority"
    scale_degree = 0  # +-1 whatever the scale of x
    summary = "signSGD: 1-bit signs with majority-vote aggregation (Bernstein et al. 2018)"
    uses_context = False  # a pure function of x

    @property
    def default_error_feedback(self) -> bool:
        return False

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        return Packet([pack_signs(x)], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        return decode_signs(packet)

    def decode_into(self, packet: Packet, out: torch.Tensor) -> torch.Tensor:
        return decode_signs(packet, out)
