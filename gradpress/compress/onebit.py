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

Compiled (:mod:`gradpress.compress.kit.compiler`; fp32, fp16 and bf16
inputs), both side sums and the count come from one fused pass that
accumulates in fp64 (:func:`_side_sums`): no sum of a finite fp32 input can
overflow there, and each mean is its fp64 quotient rounded once to fp32, so
it can differ from eager's fp32 sums in the last bit (the compiled one is
usually the closer to the exact mean; the bits are identical). Eager, the same
accumulation would cost a float64 copy of the tensor, so eager keeps the
fp32 sums, bit-identical to the hand-written version. Compiled, the sign
bits come from a second kernel, one byte per 8 entries as a selection of
the bit weights and a row sum (:func:`gradpress.compress.kit.pack_signs`;
the eager pack covers the last n mod 8 entries): a compiled pack by shifts
and ors of strided columns, or a uint8 mask written beside the sums,
measured 6-10x slower on CPU.

Packet: ``[means (fp32: non-negative mean, negative mean; int32 upper words
for fp64 inputs), bits (uint8)]``, bits packed 8 per byte. Wire size: 8 +
ceil(d/8) bytes.

Declared with the authoring kit (:mod:`gradpress.compress.kit`); the frozen
hand-written version is :mod:`gradpress.compress.handwritten.onebit`.
"""

from __future__ import annotations

import torch

from gradpress.compress import kit
from gradpress.compress.base import Context
from gradpress.compress.numerics import pack_scale, side_means, unpack_scale
from gradpress.compress.registry import register


@kit.compiler.cpu_reduction
def _side_sums(v: torch.Tensor) -> torch.Tensor:
    """[sum of max(v, 0), sum of max(-v, 0), count of v >= 0], float64, in
    one pass when compiled (NaN propagates into both sums, as in eager)."""
    return torch.stack([v.clamp(min=0).sum(dtype=torch.float64), (-v).clamp(min=0).sum(dtype=torch.float64),
                        (v >= 0).sum(dtype=torch.float64)])


@register
class OneBit(kit.KitCompressor):
    name = "onebit"
    FIELDS = (kit.Field("means", "scale", 2), kit.Field("bits", torch.uint8, "numel", bits=1))
    summary = "1-bit SGD: sign mask + mean of each side, with error feedback (Seide et al. 2014)"
    contractive = True  # the two side means are the least-squares fit of the sign pattern

    def encode_fields(self, v: torch.Tensor, dtype: torch.dtype, ctx: Context) -> dict[str, torch.Tensor]:
        n = v.numel()
        if v.dtype != torch.float64 and kit.compiler.will_compile(_side_sums, n, v.device.type):
            sums = kit.compiler.run(_side_sums, n, v)
            counts = torch.stack([sums[2], n - sums[2]]).clamp(min=1)
            means = (torch.stack([sums[0], -sums[1]]) / counts).to(v.dtype)
            bits = kit.pack_signs(v, "nonnegative")
        else:
            mask = v >= 0
            means = torch.stack(side_means(v, torch.count_nonzero(mask)))
            bits = kit.pack(mask, 1)
        return {"means": pack_scale(means, dtype), "bits": bits}

    def decode_fields(self, fields: dict[str, torch.Tensor], numel: int, dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        values = unpack_scale(fields["means"], dtype).flip(0).to(dtype)  # bit 0 -> negative mean, 1 -> non-negative
        data = fields["bits"]
        return kit.unpack_table(kit.byte_table(1, dtype, data.device, values), data, numel, out)
