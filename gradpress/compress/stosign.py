"""``stosign``: the unbiased stochastic sign, one bit per entry and one scale per chunk.

The flat tensor is cut into chunks of c entries (the last one may be
shorter). Per chunk m = max|x|; each entry is sent as one bit, +m with
probability (1 + x/m) / 2 and -m otherwise, so E[Q(x)] = x: unbiased, with
per-entry variance m^2 - x^2 (a chunk's E||Q - x||^2 <= (c - 1) ||x||^2,
since m^2 <= ||x||^2). The stochastic sign of Jin et al. 2020
("Stochastic-Sign SGD for Federated Learning with Theoretical Guarantees",
sto-sign with B = max|x|), scaled by its bound so that the average of the
ranks' decodes is unbiased (Safaryan and Richtarik, ICML 2021, "Stochastic
Sign Descent Methods", the 1-bit unbiased sign). Unlike ``signsgd`` or
``efsignsgd`` an entry's sign may flip; error feedback is off by default.

The coins come from ``ctx.private_seed`` (counter-based, fused into the
kernel): the uniform's grid (2^-24 for fp32/fp16/bf16 inputs, 2^-32 for
fp64) biases P(+) by less than one grid step, |E[Q(x)] - x| < 2 m 2^-24.
m is exact for fp32/fp16/bf16 inputs (the maximum of their values) and, for
fp64 inputs, sent as the upper 32 bits of its fp64 value rounded away from
zero (so |x| / m <= 1, relative precision 2^-20). Two fp64 ends the upper
word cannot hold (measured): within 2^-20 of fp64's maximum m is capped
below max|x| (a finite scale never rounds to inf), so those entries decode
to +-m with a bias below 2^-20 |x|; below 2^-1022 the word holds fewer
bits, and under 2^-1042 (about 2.1e-314) m rounds up to that, still
unbiased but with a variance far above the (c - 1) ||x||^2 bound. A zero
chunk decodes to zeros; a chunk with inf or NaN decodes non-finite.

Packet: ``[scales (fp32, or int32 upper words for fp64 inputs; ceil(d/c)),
signs (uint8, 1 bit per entry, LSB first)]``. Wire size: 4 ceil(d/c) +
ceil(d/8) bytes.

Declared with the authoring kit (docs/authoring.md): the scales are a
``reduce`` (absmax), the bits one element-wise kernel (draw, compare) and a
``pack``; the decode one element-wise kernel over the unpacked bits.
"""

from __future__ import annotations

import torch

from gradpress.compress import kit
from gradpress.compress.base import Context, Param
from gradpress.compress.numerics import compute_dtype
from gradpress.compress.registry import register

__all__ = ["StoSign"]


def _coins(v, m, *, key, drawn, bits, fuse):
    """1 (+m) with probability (1 + v/m) / 2, else 0 (-m), packed."""
    return kit.pack_rows((kit.uniform(v, key, drawn) < 0.5 + 0.5 * (v / m)).to(torch.int32), bits, fuse)


def _values(c, m, *, key, drawn):
    """+-m: (2 c - 1) m."""
    return (2 * c.to(m.dtype) - 1) * m


@register
class StoSign(kit.KitCompressor):
    name = "stosign"
    PARAMS = (Param("chunk", int, 512, "chunk >= 1", lambda v: v >= 1, "entries per chunk sharing one scale max|x|"),)
    FIELDS = (kit.Field("scales", "scale", "chunks"), kit.Field("signs", torch.uint8, "numel", bits=1))
    RANDOM = "private"
    unbiased = True
    summary = "unbiased stochastic sign: +-max|x| per chunk, P(+) = (1 + x/max)/2, 1 bit (Jin et al. 2020)"

    def chunk_size(self, numel: int) -> int:
        return int(self.chunk)  # type: ignore[attr-defined]

    def variance_factor(self, numel: int) -> float:
        """Per chunk E||Q(v) - v||^2 = c m^2 - ||v||^2 <= (c - 1) ||v||^2."""
        return float(min(int(self.chunk), max(numel, 1)) - 1)  # type: ignore[attr-defined]

    def encode_fields(self, flat: torch.Tensor, dtype: torch.dtype, ctx: Context) -> dict[str, torch.Tensor]:
        c = self.chunk_size(flat.numel())
        wire = kit.pack_scale(kit.reduce(flat, "absmax", c), dtype, away=True)
        m = kit.unpack_scale(wire, dtype)  # the scale the decoder sees, >= max|x| (fp64: rounded away)
        safe = torch.where(m > 0, m, torch.ones_like(m))  # a zero chunk: fair coins, decoded as +-0
        return {"scales": wire, "signs": kit.elementwise(_coins, flat, c, (safe,), **self.randomness(flat, ctx), pack=1)}

    def decode_fields(self, fields: dict[str, torch.Tensor], numel: int, dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        cdt = compute_dtype(dtype)
        m = kit.unpack_scale(fields["scales"], dtype)
        codes = kit.unpack(fields["signs"], 1, numel)
        res = kit.elementwise(_values, codes, self.chunk_size(numel), (m,), out=out if dtype == cdt else None)
        return res.to(dtype)  # fp16/bf16: m is one of their values, exact
