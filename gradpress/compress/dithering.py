"""``dithering``: random dithering, standard or natural (Horvath et al. 2019,
"Natural Compression for Distributed Deep Learning", section 4).

The flat tensor is cut into buckets of b = ``bucket`` entries (the last may
be shorter; ``bucket=0``, the default, is one bucket for the whole tensor,
the method as published). Per bucket, y_i = |x_i| / ||x_bucket||_p is
rounded at random to one of the two adjacent levels so that E[level] = y_i (probability of the upper level (y - lo)/(hi - lo)),
using ``ctx.private_seed`` (independent per rank). Levels (s = ``levels``):

* standard (``natural=False``): {0, 1/s, 2/s, ..., 1} (with p = 2 this is
  QSGD; with p = inf and s = 1, TernGrad);
* natural (``natural=True``): {0, 2^(1-s), 2^(2-s), ..., 1/2, 1}; an exact
  power of two stays itself.

Unbiased: E[decode(encode(x))] = x. Variance (Horvath et al., Thm. for
D_nat^{p,s}): E||C(x) - x||^2 <= omega ||x||^2 with
omega = 1/8 + d^(1/r) 2^(1-s) min(1, d^(1/r) 2^(1-s)), r = min(p, 2); for
p = 2: omega = 1/8 + min(sqrt(d)/2^(s-1), d/2^(2(s-1))). Standard dithering
(p = 2): omega = min(d/s^2, sqrt(d)/s) (Alistarh et al. 2017). With buckets
the bound holds per bucket with d = b, so summed over buckets
E||C(x) - x||^2 <= omega(b) ||x||^2 whatever the tensor's size (QSGD's
bucketing, Alistarh et al. 2017, section 3.1): the relative error no longer
grows with d.

Extreme inputs: the norm is computed without overflow or underflow
(:func:`gradpress.compress.numerics.flat_norm`), in fp32, or fp64 for fp64
inputs (which also send it in fp64), so every finite input whose norm fits
the norm's dtype is quantized unbiasedly, subnormals included (decoded
values there are exact only to the dtype's absolute resolution). A norm
beyond fp32 (fp32/fp16/bf16 inputs) saturates at fp32's maximum: finite,
biased. Decoded values an fp16/bf16 output cannot hold saturate at its
maximum (the magnitudes table is clamped).

Packet: ``[norms (fp32, one per bucket; fp64 for fp64 inputs), sign bits
(uint8, packed 1 bit each), level indices (uint8, packed ceil(log2(s+1)) bits
each)]``, fixed size: 4 (fp64: 8) * ceil(d/b) + ceil(d/8) + ceil(d*bits/8)
bytes. No separate values (``values_index=None``):
it is a second-stage quantizer (``topk:ratio=0.01>dithering``).

Memory: after the norms (one reduction) the input is encoded span by span
(:func:`chunk_spans`), each span's random draws, level indices (int32) and
packed bits written straight into the packet, so temporaries stay at one
span's size; a span is divided by its buckets' norms through a 2-D view of
its whole buckets (plus at most a head and a tail piece of one bucket each:
buckets need not divide the span). Decode gathers from a (s + 1)-entry table
of levels and multiplies by the buckets' norms the same way. With one norm
for the whole tensor (``bucket=0``) the error grows like sqrt(d)/s on huge
tensors (22x the norm of x at d = 25M, s = 8); ``bucket=512`` keeps it at
omega(512) whatever d (tests/test_dithering_bucket.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from gradpress.compress.base import Compressor, Context, Packet, Param, generator_for
from gradpress.compress.bits import pack_bits, packed_nbytes, unpack_bits
from gradpress.compress.numerics import compute_dtype, flat_norm, row_norms, saturate_
from gradpress.compress.registry import register
from gradpress.compress.spans import chunk_spans


class NormOrder(float):
    """A norm order p >= 1: a number or ``inf`` (spec ``p=inf``)."""

    def __new__(cls, value: Any) -> NormOrder:
        if isinstance(value, str) and value.strip().lower() in ("inf", "infinity", "max"):
            value = math.inf
        return super().__new__(cls, float(value))

    def __str__(self) -> str:
        return "inf" if math.isinf(self) else repr(float(self))


def code_bits(levels: int) -> int:
    """Bits per level index: ceil(log2(s + 1))."""
    return max(1, math.ceil(math.log2(levels + 1)))


def variance_bound(d: int, levels: int, p: float = 2.0, natural: bool = True) -> float:
    """omega with E||C(x)-x||^2 <= omega ||x||^2 (Horvath et al. 2019 for
    natural dithering; Alistarh et al. 2017 for standard dithering, p = 2)."""
    if natural:
        r = min(p, 2.0)
        t = d ** (1.0 / r) * 2.0 ** (1 - levels)
        return 1.0 / 8.0 + t * min(1.0, t)
    if p != 2.0:
        raise ValueError("the standard-dithering bound is stated for p = 2 only")
    return min(d / levels**2, math.sqrt(d) / levels)


@register
class Dithering(Compressor):
    name = "dithering"
    PARAMS = (
        Param("levels", int, 8, "1 <= levels <= 120 (natural) or 65535 (standard)", lambda v: 1 <= v <= 65535, "number of nonzero levels s"),
        Param("p", NormOrder, NormOrder(2.0), "a number >= 1 or inf", lambda v: v >= 1, "norm order used to scale x"),
        Param("natural", bool, False, "true or false", None, "power-of-two levels (natural dithering)"),
        Param("bucket", int, 0, "bucket >= 0 (0: one norm for the whole tensor)", lambda v: v >= 0,
              "entries per bucket sharing one norm (as qsgd's)"),
    )
    unbiased = True
    summary = "random dithering, standard or natural levels (Horvath et al. 2019), norm + sign + level bits"

    def _validate(self) -> None:
        if self.natural and self.levels > 120:
            raise ValueError(
                f"compressor 'dithering': parameter 'levels' got {self.levels!r}; allowed: 1 <= levels <= 120 when natural=true"
            )

    def _bucket(self, numel: int) -> int:
        """Entries per bucket for a tensor of ``numel`` entries (>= 1)."""
        return self.bucket if 0 < self.bucket < numel else max(numel, 1)

    def variance_factor(self, numel: int) -> float | None:
        try:
            return variance_bound(self._bucket(numel), self.levels, float(self.p), self.natural)
        except ValueError:  # no bound stated for standard dithering with p != 2
            return None

    def _levels_of(self, code: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        c = code.to(dtype)
        if self.natural:
            return torch.where(code == 0, torch.zeros_like(c), torch.exp2(c - self.levels))
        return c / self.levels

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        flat = x.reshape(-1)
        d = flat.numel()
        s = self.levels
        bits = code_bits(s)
        dev = x.device
        cdt = compute_dtype(x.dtype)
        nb = self._bucket(d)
        norm = _bucket_norms(flat, nb, float(self.p), cdt)
        big = torch.finfo(cdt).max
        norm = norm.clamp(max=big)  # a norm beyond the dtype saturates (NaN stays NaN)
        safe = torch.where(norm > 0, norm, torch.ones_like(norm))
        gen = generator_for(dev, ctx.private_seed)
        signs = torch.empty(packed_nbytes(d, 1), dtype=torch.uint8, device=dev)
        codes = torch.empty(packed_nbytes(d, bits), dtype=torch.uint8, device=dev)
        for a, b in chunk_spans(d, dev):
            v = flat[a:b].to(cdt)
            y = _per_bucket(torch.abs(v), safe, a, nb, torch.Tensor.div_).clamp_(max=1.0)
            if self.natural:
                _, exp = torch.frexp(y)
                lo_idx = exp.add_(s - 1).masked_fill_(y.ge(2.0 ** (1 - s)).logical_not_(), 0).clamp_(0, s)
                lo = self._levels_of(lo_idx, cdt)
                hi = torch.exp2((lo_idx + (1 - s)).to(cdt))
            else:
                t = y * s
                lo_idx = torch.floor(t).to(torch.int32).clamp_(0, s)
                lo = lo_idx.to(cdt).div_(s)
                hi = (lo_idx + 1).to(cdt).div_(s)
            prob = y.sub_(lo).div_(hi.sub_(lo)).clamp_(0.0, 1.0)
            up = torch.rand(b - a, generator=gen, device=dev, dtype=cdt) < prob
            code = lo_idx.add_(up).clamp_(max=s)
            signs[a // 8 : a // 8 + packed_nbytes(b - a, 1)] = pack_bits((v < 0).view(torch.uint8), 1)
            codes[a * bits // 8 : a * bits // 8 + packed_nbytes(b - a, bits)] = pack_bits(code.to(torch.uint8) if bits <= 8 else code, bits)
        return Packet([norm.reshape(-1), signs, codes], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        norm, signs, codes = packet.tensors
        d = math.prod(packet.shape)
        s = self.levels
        bits = code_bits(s)
        dev = codes.device
        # the level of every index, one gather per span, times its bucket's norm (saturated
        # where the output dtype ends): level * norm, the same product for one bucket or many
        cdt = compute_dtype(packet.dtype)
        nb = self._bucket(d)
        norms = norm.reshape(-1).to(cdt)
        table = self._levels_of(torch.arange(s + 1, device=dev), cdt)
        out = torch.empty(d, dtype=packet.dtype, device=dev)
        for a, b in chunk_spans(d, dev):
            neg = unpack_bits(signs[a // 8 : a // 8 + packed_nbytes(b - a, 1)], 1, b - a).to(torch.bool)
            code = unpack_bits(codes[a * bits // 8 : a * bits // 8 + packed_nbytes(b - a, bits)], bits, b - a)
            mag = saturate_(_per_bucket(table.index_select(0, code.to(torch.int32)), norms, a, nb, torch.Tensor.mul_), packet.dtype)
            out[a:b] = torch.where(neg, -mag, mag)
        return out.reshape(packet.shape)



def _bucket_norms(flat: torch.Tensor, b: int, p: float, dtype: torch.dtype) -> torch.Tensor:
    """||bucket||_p of every bucket of ``b`` entries of ``flat`` (the last may
    be shorter), computed in ``dtype`` without overflow or underflow; one
    bucket: :func:`flat_norm` (span-bounded temporaries)."""
    d = flat.numel()
    if b >= d:
        return flat_norm(flat, p, dtype).reshape(1)
    v = flat.to(dtype)
    full = d // b * b
    parts = [row_norms(v[:full].view(-1, b), p)]
    if full < d:
        parts.append(row_norms(v[full:].view(1, -1), p))
    return torch.cat(parts)


def _per_bucket(v: torch.Tensor, scales: torch.Tensor, a: int, b: int, op: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Apply ``op(piece, scale)`` in place to the span ``v`` = entries
    ``[a, a + len(v))`` of the flat tensor, each entry with its bucket's
    scale (buckets of ``b`` entries): a head piece of one bucket, the whole
    buckets as one 2-D view, a tail piece of one bucket. Returns ``v``."""
    end = a + v.numel()
    head = min(-(-a // b) * b, end)
    if head > a:
        op(v[: head - a], scales[a // b])
    full = end // b * b
    if full > head:
        op(v[head - a : full - a].view(-1, b), scales[head // b : full // b, None])
    if end > max(full, head):
        op(v[max(full, head) - a :], scales[full // b])
    return v
