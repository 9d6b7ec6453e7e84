"""``qsgd``: stochastic quantization to s levels per bucket.

Alistarh et al. 2017, "QSGD: Communication-Efficient SGD via Gradient
Quantization and Encoding". The flat tensor is cut into buckets of b entries
(the last one may be shorter; ``bucket=0`` means one bucket for the whole
tensor). Per bucket n = ||v||_2 and, for each entry, with y = s|v_i|/n and
l = floor(y), the level is l + Bernoulli(y - l) (in 0..s); the decoded value
is n * sign(v_i) * level / s. Unbiased, with variance
E||Q(v) - v||^2 <= min(b/s^2, sqrt(b)/s) ||v||^2. The coin flips use
``ctx.private_seed`` (independent per rank, so averaging reduces variance).

Packet: ``[norms (fp32, ceil(d/b)), codes (uint8, bit-packed)]``; each code is
``(level << 1) | sign`` in ceil(log2(s+1)) + 1 bits, packed densely with
:func:`gradpress.compress.bits.pack_bits`. Wire size: 4*ceil(d/b) +
ceil(d * bits / 8) bytes. Codes are fixed-width (no Elias coding).
"""

from __future__ import annotations

import math

import torch

from gradpress.compress.base import Compressor, Context, Packet, Param, generator_for
from gradpress.compress.bits import pack_bits, unpack_bits
from gradpress.compress.registry import register

MAX_LEVELS = (1 << 23) - 1  # level + sign must fit the 24-bit packer


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; everything narrower is computed in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@register
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

    def _bucket(self, numel: int) -> int:
        return self.bucket if self.bucket > 0 else max(numel, 1)

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        flat = x.reshape(-1).to(compute_dtype(x.dtype))
        d = flat.numel()
        b = self._bucket(d)
        full = d // b * b  # whole buckets are a (d // b, b) view; a short last one is handled apart
        s = float(self.levels)
        norms = torch.cat([torch.linalg.vector_norm(flat[:full].view(-1, b), dim=1),
                           torch.linalg.vector_norm(flat[full:]).reshape(-1)[: int(full < d)]])
        factor = torch.where(norms > 0, s / norms, torch.zeros_like(norms))  # y = s |v| / n
        # one fresh buffer, updated in place: y, then y + u, then floor(y + u), the level
        # (floor(y + U) is floor(y) + Bernoulli(y - floor(y)): one draw, one pass)
        y = flat.abs()
        y[:full].view(-1, b).mul_(factor[: d // b, None])
        y[full:].mul_(factor[d // b :])
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
        return Packet([norms.float(), pack_bits(codes, self.bits)], x.shape, x.dtype)

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
        scale = norms.to(cdt) / float(self.levels)
        full = d // b * b
        out[:full].view(-1, b).mul_(scale[: d // b, None])
        out[full:].mul_(scale[d // b :])
        return out.to(packet.dtype).reshape(packet.shape)
