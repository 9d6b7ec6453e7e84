"""``qsgd``: stochastic quantization to s levels per bucket.

Alistarh et al. 2017, "QSGD: Communication-Efficient SGD via Gradient
Quantization and Encoding". The flat tensor is cut into buckets of b entries
(the last one may be shorter; ``bucket=0`` means one bucket for the whole
tensor). Per bucket n = ||v||_2 and, for each entry, with y = s|v_i|/n and
l = floor(y), the level is l + Bernoulli(y - l) (in 0..s); the decoded value
is n * sign(v_i) * level / s. Unbiased, with variance
E||Q(v) - v||^2 <= min(b/s^2, sqrt(b)/s) ||v||^2. The coin flips use
``ctx.private_seed`` (independent per rank, so averaging reduces variance),
counter-based and fused into the quantizing kernel
(:mod:`gradpress.compress.kit.rng`; ``random_stream = "torch"`` reproduces
the hand-written version's draws bit for bit).

Extreme inputs (:mod:`gradpress.compress.numerics`): the norm is computed
without overflow or underflow (rescaled by max|v| where the plain one is not
safe), in fp32 (fp64 for fp64 inputs), and y uses the norm the decoder
receives, so the method stays unbiased for every finite bucket whose norm
the wire can hold: subnormal buckets included (their decoded values are
exact only to the dtype's absolute resolution). fp64 inputs send the norm as
the upper 32 bits of its fp64 value rounded away from zero (fp64 range).
A norm beyond fp32 (fp32/fp16/bf16 inputs), or beyond fp64 (a finite fp64
bucket near its maximum), saturates at the largest value the wire holds and
levels clip at s: finite, biased. Decoded values that the output dtype
cannot hold (fp16 above 65504) saturate at its maximum.

Packet: ``[norms (fp32, or int32 upper words for fp64 inputs; ceil(d/b)),
codes (uint8, bit-packed)]``; each code is
``(level << 1) | sign`` in ceil(log2(s+1)) + 1 bits, packed densely, LSB
first (``kit.pack``: the stream of :func:`gradpress.compress.bits.pack_bits`). Wire size: 4*ceil(d/b) +
ceil(d * bits / 8) bytes. Codes are fixed-width (no Elias coding).

Declared with the authoring kit (:mod:`gradpress.compress.kit`): the norms
are a ``reduce``, the levels one element-wise kernel (scale, draw, floor,
sign), the codes a ``pack``. The frozen hand-written version is
:mod:`gradpress.compress.handwritten.qsgd`.
"""

from __future__ import annotations

import math

import torch

from gradpress.compress import kit
from gradpress.compress.base import Context, Param
from gradpress.compress.numerics import compute_dtype, host_reads, pack_scale, saturate_, unpack_scale
from gradpress.compress.registry import register

__all__ = ["MAX_LEVELS", "QSGD", "compute_dtype"]

MAX_LEVELS = (1 << 23) - 1  # level + sign must fit the 24-bit packer


def _levels(v, a, c=None, *, key, drawn, bits, fuse, s):
    """(level << 1) | sign, level = min(floor(|v| a + U), s) (or |v| / a * c), packed."""
    y = v.abs() * a if c is None else v.abs() / a * c
    level = torch.fmin(torch.floor(y + kit.uniform(y, key, drawn)), torch.tensor(s, dtype=y.dtype, device=y.device))
    return kit.pack_rows(level.to(torch.int32) * 2 + (v < 0).to(torch.int32), bits, fuse)


def _values(c, scale, *, key, drawn, cdt, wide):
    """level * sign * scale; wide codes (> 8 bits) sign in floating point (-0 for a negative zero level)."""
    c = c.to(torch.int32)
    if wide:
        return (c >> 1).to(cdt) * (1 - 2 * (c & 1)).to(cdt) * scale
    return ((c >> 1) * (1 - 2 * (c & 1))).to(cdt) * scale


@register
class QSGD(kit.KitCompressor):
    name = "qsgd"
    PARAMS = (
        Param("levels", int, 16, f"1 <= levels <= {MAX_LEVELS}", lambda v: 1 <= v <= MAX_LEVELS,
              "number of quantization levels s"),
        Param("bucket", int, 512, "bucket >= 0 (0: one bucket for the whole tensor)", lambda v: v >= 0,
              "entries per bucket sharing one norm"),
    )
    FIELDS = (kit.Field("norms", "scale", "chunks"), kit.Field("codes", torch.uint8, "numel", bits="bits"))
    RANDOM = "private"
    unbiased = True
    summary = "QSGD stochastic s-level quantization with per-bucket L2 norms (Alistarh et al. 2017)"

    def variance_factor(self, numel: int) -> float:
        """Alistarh et al. 2017, Lemma 3.1, with the bucket (omega grows with it)."""
        b = min(self.bucket if self.bucket > 0 else numel, max(numel, 1))
        return min(b / self.levels**2, math.sqrt(b) / self.levels)

    @property
    def bits(self) -> int:
        """Bits per entry: ceil(log2(s + 1)) for the level, one for the sign."""
        return int(self.levels).bit_length() + 1

    def chunk_size(self, numel: int) -> int:
        return self.bucket if self.bucket > 0 else max(numel, 1)

    def encode_fields(self, flat: torch.Tensor, dtype: torch.dtype, ctx: Context) -> dict[str, torch.Tensor]:
        b, s = self.chunk_size(flat.numel()), float(self.levels)
        wire = pack_scale(kit.reduce(flat, "norm", b), dtype, away=True, saturate=True)
        n = unpack_scale(wire, dtype)  # the norm the decoder sees (>= the true one unless saturated)
        pos = n > 0  # NaN norms (non-finite buckets) give y = 0 here and decode non-finite
        factor = torch.where(pos, s / n, torch.zeros_like(n))
        if host_reads(n) and bool(torch.isfinite(factor).all()):
            stats = (factor,)
        else:  # s / n overflows for norms below s / max (subnormal buckets): |v| / n first, then times s
            stats = (torch.where(pos, n, torch.ones_like(n)), torch.where(pos, torch.full_like(n, s), torch.zeros_like(n)))
        # on CPU packed after the kernel at every width: fused 2- and 4-bit packs made this kernel 3x slower there
        # (docs/bench.md); elsewhere the fused pack stays (the Triton path tested on an H200; the stream pack is CPU-only)
        codes = kit.elementwise(_levels, flat, b, stats, **self.randomness(flat, ctx), pack=self.bits,
                                fuse_pack=flat.device.type != "cpu", s=s)
        return {"norms": wire, "codes": codes}

    def decode_fields(self, fields: dict[str, torch.Tensor], numel: int, dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        cdt, s = compute_dtype(dtype), float(self.levels)
        n = unpack_scale(fields["norms"], dtype)
        scale = n / s
        # s * (n / s) may round above a norm at the dtype's maximum: step that scale down
        scale = torch.where(torch.isinf(scale * s) & torch.isfinite(n), torch.nextafter(scale, torch.zeros_like(scale)), scale)
        codes = kit.unpack(fields["codes"], self.bits, numel)
        res = kit.elementwise(_values, codes, self.chunk_size(numel), (scale,), cdt=cdt, wide=self.bits > 8,
                              out=out if dtype == cdt else None)
        return res if dtype == cdt else saturate_(res, dtype).to(dtype)
