"""``terngrad``: ternary stochastic quantization to {-s, 0, +s}.

Wen et al. 2017, "TernGrad: Ternary Gradients to Reduce Communication in
Distributed Deep Learning". With clipping (``clip = c > 0``) the tensor is
first clipped to [-c*sigma, c*sigma] where sigma is its (population)
standard deviation; then s = max|g| and q_i = s * sign(g_i) *
Bernoulli(|g_i| / s), with coins from ``ctx.private_seed``.

Unbiased with respect to the *clipped* tensor, so ``is_unbiased`` is True
only for ``clip=0`` (no clipping); with clipping error feedback is on by
default. Choice where the paper is silent: when c*sigma is 0 (a constant or
one-element tensor) no clipping is applied, otherwise everything would be
sent as zero. Shared-max (summable) TernGrad is not implemented here.

Packet: ``[scale (fp32, 1 entry), codes (uint8)]`` with 2-bit codes
(0: zero, 1: +s, 2: -s) packed 4 per byte. Wire size: 4 + ceil(d/4) bytes.
"""

from __future__ import annotations

import math

import torch

from gradpress.compress.base import Compressor, Context, Packet, Param, generator_for
from gradpress.compress.qsgd import compute_dtype
from gradpress.compress.registry import register
from gradpress.wire import pack_bits, unpack_bits


@register
class TernGrad(Compressor):
    name = "terngrad"
    PARAMS = (
        Param("clip", float, 2.5, "clip >= 0 (0 disables clipping)", lambda v: v >= 0,
              "clip to clip * std before quantizing"),
    )
    summary = "TernGrad ternary {-s,0,s} stochastic quantization, 2 bits/element (Wen et al. 2017)"

    @property
    def is_unbiased(self) -> bool:
        return self.clip == 0

    def encode(self, x: torch.Tensor, ctx: Context | None = None) -> Packet:
        self._check_input(x)
        ctx = self._context(ctx)
        g = x.reshape(-1).to(compute_dtype(x.dtype))
        d = g.numel()
        if d == 0:
            return Packet([torch.zeros(1, device=g.device), pack_bits(torch.zeros(0, dtype=torch.uint8, device=g.device), 2)],
                          x.shape, x.dtype)
        if self.clip > 0:
            bound = self.clip * g.std(correction=0)
            bound = torch.where(bound > 0, bound, torch.full_like(bound, math.inf))
            g = torch.maximum(torch.minimum(g, bound), -bound)
        s = g.abs().max()
        prob = g.abs() / torch.where(s > 0, s, torch.ones_like(s))
        u = torch.rand(d, generator=generator_for(g.device, ctx.private_seed), device=g.device, dtype=g.dtype)
        keep = u < prob
        codes = keep.to(torch.uint8) * torch.where(g < 0, 2, 1).to(torch.uint8)
        return Packet([s.reshape(1).float(), pack_bits(codes, 2)], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        scale, data = packet.tensors[0], packet.tensors[1]
        d = math.prod(packet.shape)
        cdt = compute_dtype(packet.dtype)
        codes = unpack_bits(data, 2, d)
        ternary = (codes == 1).to(cdt) - (codes == 2).to(cdt)
        return (ternary * scale.to(cdt)).to(packet.dtype).reshape(packet.shape)
