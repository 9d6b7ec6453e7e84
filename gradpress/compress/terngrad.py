"""``terngrad``: ternary stochastic quantization to {-s, 0, +s}.

Wen et al. 2017, "TernGrad: Ternary Gradients to Reduce Communication in
Distributed Deep Learning". With clipping (``clip = c > 0``) the tensor is
first clipped to [-c*sigma, c*sigma] where sigma is its population standard
deviation *centered on its mean*, sqrt(mean((g - mean g)^2)), as the paper
words it; then s = max|g| and q_i = s * sign(g_i) * Bernoulli(|g_i| / s),
with coins from ``ctx.private_seed``
(counter-based, fused into the kernel that compares:
:mod:`gradpress.compress.kit.rng`; the 2-bit codes are packed by the same
kernel on accelerators, after it on CPU).

The centered deviation, not the root mean square, is the documented choice:
for a tensor with a large mean and a small spread (g = 1 + 1e-4 N(0, 1))
the bound is 2.5e-4 and every entry is clipped to it, thousands of times
smaller than g (the rest goes to the residual: error feedback is on by
default with clipping). sigma is computed in two passes (:func:`gradpress.compress.kit.std`, the
corrected two-pass algorithm, compiled the first pass is the one that finds min and max,
:func:`gradpress.compress.kit.extremes`; eager on the tensor scaled by a power of
two, compiled accumulating in fp64: the exact sigma rounded once, where
eager's fp32 accumulation drifts with the size, 3.6e-5 relative at 2M
entries): no cancellation (a one-pass E[g^2] - E[g]^2
turns the example's variance into 0 and silently disables clipping), no
overflow, no underflow; exactly 0 for a constant tensor.

Unbiased with respect to the *clipped* tensor, so ``is_unbiased`` is True
only for ``clip=0`` (no clipping); with clipping error feedback is on by
default. Choice where the paper is silent: when c*sigma is 0 (a constant or
one-element tensor) no clipping is applied, otherwise everything would be
sent as zero. Shared-max (summable) TernGrad is not implemented here.

The scale travels so that the decoded +-s is exactly what the output dtype
holds and never below the s the coins used: fp32 for fp32 inputs, rounded
up onto the fp16/bf16 grid for those inputs, and for fp64 inputs the upper
32 bits of the fp64 value rounded away from zero (fp64 range); the coins
use that transmitted s, so ``clip=0`` is unbiased for every finite input.

Packet: ``[scale (fp32, 1 entry; int32 upper word for fp64 inputs), codes
(uint8)]`` with 2-bit codes (0: zero, 1: +s, 2: -s) packed 4 per byte. Wire
size: 4 + ceil(d/4) bytes.

Declared with the authoring kit (:mod:`gradpress.compress.kit`); the frozen
hand-written version is :mod:`gradpress.compress.handwritten.terngrad`.
"""

from __future__ import annotations

import torch

from gradpress.compress import kit
from gradpress.compress.base import Context, Param
from gradpress.compress.numerics import compute_dtype, pack_scale, round_up_to, unpack_scale
from gradpress.compress.registry import register

TILE = 4096  # elements per row of the kernel (the scale is one scalar)


def _ternary(g: torch.Tensor, s: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None,
             bits: int, fuse: bool) -> torch.Tensor:
    """2-bit codes 0 (zero), 1 (+s), 2 (-s): keep_i = U_i s < |g_i|, packed."""
    keep = kit.uniform(g, key, drawn) * s < g.abs()
    return kit.pack_rows(keep.to(torch.int32) * (1 + (g < 0).to(torch.int32)), bits, fuse)


@register
class TernGrad(kit.KitCompressor):
    name = "terngrad"
    PARAMS = (
        Param("clip", float, 2.5, "clip >= 0 (0 disables clipping)", lambda v: v >= 0,
              "clip to clip * std before quantizing"),
    )
    FIELDS = (kit.Field("scale", "scale", 1), kit.Field("codes", torch.uint8, "numel", bits=2))
    RANDOM = "private"
    summary = "TernGrad ternary {-s,0,s} stochastic quantization, 2 bits/element (Wen et al. 2017)"

    @property
    def is_unbiased(self) -> bool:
        return self.clip == 0

    def encode_fields(self, g: torch.Tensor, dtype: torch.dtype, ctx: Context) -> dict[str, torch.Tensor]:
        if g.numel() == 0:
            return {"scale": pack_scale(g.new_zeros(1), dtype), "codes": kit.pack(g.new_zeros(0, dtype=torch.uint8), 2)}
        lo, hi, mean = kit.extremes(g)  # compiled: the mean from the same pass
        s = torch.maximum(-lo, hi)  # max |g| (NaN propagates)
        if self.clip > 0:
            bound = self.clip * kit.std(g, lo, hi, mean)
            s = torch.where(bound > 0, torch.minimum(s, bound), s)  # max |clip(g)| = min(max |g|, bound)
        wire = pack_scale(round_up_to(s, dtype), dtype, away=True)
        s = unpack_scale(wire, dtype).reshape(())  # the scale the decoder sees, >= the one computed
        # s: one scalar. On CPU the codes are packed after the kernel, whose random index then comes from the
        # key's lane table (22-23 ms against 26 fused at 25M entries, one thread; 14 against 12.5-14 on two);
        # CUDA keeps the fused pack it was measured with
        codes = kit.elementwise(_ternary, g, TILE, (s,), **self.randomness(g, ctx), pack=2,
                                fuse_pack=g.device.type != "cpu")
        return {"scale": wire, "codes": codes}

    def decode_fields(self, fields: dict[str, torch.Tensor], numel: int, dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        data = fields["codes"]
        table = torch.tensor([0.0, 1.0, -1.0, 0.0], dtype=compute_dtype(dtype), device=data.device)
        values = (table * unpack_scale(fields["scale"], dtype)).to(dtype)
        return kit.unpack_table(kit.byte_table(2, dtype, data.device, values), data, numel, out)
