"""``efsignsgd``: scaled sign, (||p||_1 / d) * sign(p), with error feedback.

Karimireddy et al. 2019, "Error Feedback Fixes SignSGD and other Gradient
Compression Schemes". The compressor is the scaled sign of one whole tensor;
the residual e <- p - delta is kept by the generic residual memory
(``gradpress.exchange.feedback``), on by default since the compressor is biased.
sign(0) is taken as +1 (one bit per entry has no zero).

The scale is computed in fp32 (fp64 for fp64 inputs) and, where the |p| sum
overflows, as max|p| * mean(|p| / max|p|), so it is finite and accurate for
every finite input; fp64 inputs send it as the upper 32 bits of its fp64
value (fp64 range, relative precision 2^-21).

Packet: ``[scale (fp32, 1 entry; int32 upper word for fp64 inputs), bits
(uint8)]``, bit i = (p_i >= 0) packed 8 per byte. Wire size: 4 + ceil(d/8)
bytes.
"""

from __future__ import annotations

import math

import torch

from gradpress.compress.base import Compressor, Context, Packet
from gradpress.compress.numerics import compute_dtype, mean_abs, pack_scale, unpack_scale
from gradpress.compress.registry import register
from gradpress.compress.signs import pack_signs, unpack_two


@register
class EFSignSGD(Compressor):
    name = "efsignsgd"
    contractive = True  # delta = ||v||_1^2 / (d ||v||^2) (Karimireddy et al. 2019, Lemma 8)
    summary = "scaled sign (||p||_1/d) sign(p) with error feedback (Karimireddy et al. 2019)"
    uses_context = False  # a pure function of x

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        p = x.reshape(-1).to(compute_dtype(x.dtype))
        return Packet([pack_scale(mean_abs(p), x.dtype), pack_signs(p)], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        scale, data = packet.tensors[0], packet.tensors[1]
        d = math.prod(packet.shape)
        s = unpack_scale(scale, packet.dtype).reshape(())
        values = torch.stack([-s, s]).to(packet.dtype)
        return unpack_two(data, d, values).reshape(packet.shape)
