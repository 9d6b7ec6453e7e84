"""``qsgd``: stochastic quantization to s levels per bucket.

Alistarh et al. 2017, "QSGD: Communication-Efficient SGD via Gradient
Quantization and Encoding". The flat tensor is cut into buckets of b entries
(the last one may be shorter; ``bucket=0`` means one bucket for the whole
tensor). Per bucket n = ||v||_2 and, for each entry, with y = s|v_i|/n and
l = floor(y), the level is l + Bernoulli(y - l) (in 0..s); the decoded value
is n * sign(v_i) * level / s. Unbiased, with variance
E||Q(v) - v||^2 <= min(b/s^2, sqrt(b)/s) ||v||^2. The coin flips use
``ctx.private_seed`` (independent per rank, so averaging reduces variance).

Extreme inputs (:mod:`gradpress.compress.numerics`): the norm is computed
without overflow or underflow (rescaled by max|v| where the plain one is not
safe), in fp32 (fp64 for fp64 inputs), and y uses the norm the decoder
receives, so the method stays unbiased for every finite bucket whose norm
the wire can hold: subnormal buckets included (their decoded values are
exact only to the dtype's absolute resolution). fp64 inputs send the norm as
the upper 32 bits of its fp64 value rounded away from zero (fp64 range).
A norm beyond fp32 (fp32/fp16/bf16 inputs) saturates at fp32's maximum and
levels clip at s: finite, biased. Decoded values that the output dtype
cannot hold (fp16 above 65504) saturate at its maximum.

Packet: ``[norms (fp32, or int32 upper words for fp64 inputs; ceil(d/b)),
codes (uint8, bit-packed)]``; each code is
``(level << 1) | sign`` in ceil(log2(s+1)) + 1 bits, packed densely with
:func:`gradpress.compress.bits.pack_bits`. Wire size: 4*ceil(d/b) +
ceil(d * bits / 8) bytes. Codes are fixed-width (no Elias coding).
"""

from __future__ import annotations

import math

import torch

from gradpress.compress.base import Compressor, Context, Packet, Param, generator_for
from gradpress.compress.bits import pack_bits, unpack_bits
from gradpress.compress.numerics import (
    chunks,
    compute_dtype,
    host_reads,
    pack_scale,
    row_norms,
    saturate_,
    unpack_scale,
)

__all__ = ["MAX_LEVELS", "QSGD", "compute_dtype"]

MAX_LEVELS = (1 << 23) - 1  # level + sign must fit the 24-bit packer


class QSGD(Compressor):
    name = "qsgd"
    PARAMS = (
        Param("levels", int, 16, f"1 <= levels <= {MAX_LEVELS}", lambda v: 1 <= v <= MAX_LEVELS,
              "number of quantization levels s"),
        Param("bucket", int, 512, "bucket >= 0 (0: one bucket for the whole tensor)", lambda v: v >= 0,
              "entries per bucket sharing one norm"),
    )
    unbiased = True
    summary = "QSGD stochastic s-level quantization with per-bucket L2 norms (Alistarh et al. 2017)"

    @property
    def bits(self) -> int:
        """Bits per entry: ceil(log2(s + 1)) for the level, one for the sign."""
        return int(self.levels).bit_length() + 1

    def variance_factor(self, numel: int) -> float:
        """Alistarh et al. 2017, Lemma 3.1, with the bucket (omega grows with it)."""
        b = min(self._bucket(numel), max(numel, 1))
        return min(b / self.levels**2, math.sqrt(b) / self.levels)

    def _bucket(self, numel: int) -> int:
        return self.bucket if self.bucket > 0 else max(numel, 1)

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        flat = x.reshape(-1).to(compute_dtype(x.dtype))
        d = flat.numel()
        b = self._bucket(d)
        s = float(self.levels)
        rows = chunks(flat, b)
        norms = torch.cat([row_norms(r) for r in rows]) if rows else flat.new_zeros(0)
        wire = pack_scale(norms, x.dtype, away=True, saturate=True)
        n = unpack_scale(wire, x.dtype)  # the norm the decoder sees (>= the true one unless saturated)
        # y = s |v| / n per bucket, in one fresh buffer updated in place; s / n overflows only
        # for norms below s / max (subnormal buckets): there |v| / n first, then times s
        y = flat.abs()
        pos = n > 0  # NaN norms (non-finite buckets) give y = 0 here and decode non-finite
        factor = torch.where(pos, s / n, torch.zeros_like(n))
        if host_reads(n) and bool(torch.isfinite(factor).all()):
            for r, f in zip(chunks(y, b), factor.split([r.shape[0] for r in rows])):
                r.mul_(f[:, None])
        else:
            div = torch.where(pos, n, torch.ones_like(n))
            keep = torch.where(pos, torch.full_like(n, s), torch.zeros_like(n))
            for r, q, k in zip(chunks(y, b), div.split([r.shape[0] for r in rows]), keep.split([r.shape[0] for r in rows])):
                r.div_(q[:, None]).mul_(k[:, None])
        # floor(y + U) is floor(y) + Bernoulli(y - floor(y)): one draw, one pass
        u = torch.rand(d, generator=generator_for(flat.device, ctx.private_seed), device=flat.device, dtype=flat.dtype)
        level = y.add_(u).floor_()
        del u
        # a non-finite bucket decodes non-finite whatever its codes; fmin maps NaN to s, keeping codes in range
        torch.fmin(level, torch.tensor(s, dtype=level.dtype, device=level.device), out=level)
        neg = flat < 0
        if self.bits <= 8:
            codes = level.to(torch.uint8)
            del level
            codes.mul_(2).add_(neg.view(torch.uint8))
        else:
            codes = level.to(torch.int32).mul_(2).add_(neg)
        return Packet([wire, pack_bits(codes, self.bits)], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        norms, data = packet.tensors[0], packet.tensors[1]
        d = math.prod(packet.shape)
        b = self._bucket(d)
        cdt = compute_dtype(packet.dtype)
        codes = unpack_bits(data, self.bits, d)
        if self.bits <= 8:  # signed level in int8 (|level| <= 127), one byte per entry
            signed = (codes >> 1).view(torch.int8)
            signed.mul_((codes & 1).view(torch.int8).mul_(-2).add_(1))
            out = signed.to(cdt)
        else:
            codes = codes.to(torch.int32)
            out = (codes >> 1).to(cdt).mul_(1 - 2 * (codes & 1).to(cdt))
        del codes
        s = float(self.levels)
        n = unpack_scale(norms, packet.dtype)
        scale = n / s
        # s * (n / s) may round above a norm at the dtype's maximum: step that scale down
        scale = torch.where(torch.isinf(scale * s) & torch.isfinite(n), torch.nextafter(scale, torch.zeros_like(scale)), scale)
        full = d // b * b
        out[:full].view(-1, b).mul_(scale[: d // b, None])
        out[full:].mul_(scale[d // b :])
        if packet.dtype != cdt:
            out = saturate_(out, packet.dtype).to(packet.dtype)
        return out.reshape(packet.shape)
