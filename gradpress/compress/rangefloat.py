"""``rangefloat``: range-based floating point (the quantizer of the FFT
sparsification paper, "FFT-based Gradient Sparsification for the Distributed
Training of Deep Neural Networks", HPDC 2020).

A ``bits``-wide float whose exponent field is only as wide as the payload's
exponent range needs. With E(v) = floor(log2 |v|) over the finite nonzero
entries, E_max = max E, E_min = min E:

    e = ceil(log2(E_max - E_min + 1 + Z)),   m = bits - 1 - e

where Z = 1 when the payload holds zeros (one exponent code is spent on
zero) and 0 otherwise, so without zeros this is the paper's
e = ceil(log2(floor(log2 max) - floor(log2 min) + 1)). The bias is shared:
E_max. Layout of one code (least significant bit first, as ``pack_bits``
packs it):

    [ mantissa: m bits | exponent field f = E_max - E: e bits | sign: 1 bit ]

decoding to (-1)^sign (1 + mantissa / 2^m) 2^(E_max - f); with Z = 1 the
field value 2^e - 1 means zero. Mantissas are rounded to nearest (a carry
moves to the next exponent; at E_max the value is clamped to the largest
code). When the range does not fit (e > bits - 1), e = bits - 1, m = 0 and
magnitudes below 2^(E_max - 2^e + 2) flush to zero.

Relative error bound: every finite nonzero v inside the representable range
(always, unless the range did not fit) decodes with
|dec(v) - v| <= 2^-(m+1) |v|, m = bits - 1 - e; zeros are exact. Example:
bits = 8, exponents spanning 4 octaves, no zeros: e = 2, m = 5, error
<= 1/64. Deterministic rounding, so biased (error feedback on by default).
Non-finite entries encode as zero. Computed in fp32, or fp64 for fp64
inputs (never converted to fp32), so the bound holds over the whole range
of the input dtype, subnormals included (decoded there to the dtype's
absolute resolution).

Packet: ``[header (int32, 3: E_max, e, Z), codes (uint8, packed bits each)]``,
fixed size 12 + ceil(d*bits/8) bytes.

Memory: two passes over spans of the input (``dithering.chunk_spans``; the
range statistics, then the codes, in 32-bit (64-bit for fp64 inputs), packed span by span into the
output buffer), so temporaries stay at one span's size; decode (bits <= 16)
gathers from a table of every code's value, span by span. A second-stage quantizer
(``values_index=None``): ``fft:theta=0.9>rangefloat``.
"""

from __future__ import annotations

import math

import torch

from gradpress.compress.base import Compressor, Context, Packet, Param
from gradpress.compress.bits import pack_bits, packed_nbytes, unpack_bits
from gradpress.compress.numerics import compute_dtype
from gradpress.compress.registry import register
from gradpress.compress.spans import chunk_spans

#: widest code decoded through a table of every code's value
TABLE_BITS = 16


def relative_error_bound(bits: int, e: int) -> float:
    """2^-(m+1) with m = bits - 1 - e mantissa bits."""
    return 2.0 ** -(bits - e)


@register
class RangeFloat(Compressor):
    name = "rangefloat"
    contractive = True  # relative rounding error below 1
    PARAMS = (Param("bits", int, 8, "2 <= bits <= 24", lambda v: 2 <= v <= 24, "bits per value (sign + exponent + mantissa)"),)
    summary = "range-based float: exponent bits sized to the payload's range, shared bias (FFT sparsification paper)"
    uses_context = False  # a pure function of x

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        flat = x.reshape(-1)
        d = flat.numel()
        dev = x.device
        bits = self.bits
        spans = chunk_spans(d, dev)
        cdt = compute_dtype(x.dtype)
        # pass 1: max and min nonzero finite magnitude, any zero (non-finite counts as zero)
        mx = torch.zeros((), dtype=cdt, device=dev)
        mn = torch.full((), math.inf, dtype=cdt, device=dev)
        zeros = torch.zeros((), dtype=torch.bool, device=dev)
        for a, b in spans:
            mag = _finite_abs(flat[a:b], cdt)
            mx = torch.maximum(mx, mag.max())
            is0 = mag == 0
            zeros = zeros | is0.any()
            mn = torch.minimum(mn, mag.masked_fill_(is0, math.inf).min())
        any_nz = mx > 0
        i32 = torch.int32
        e_max = torch.where(any_nz, torch.frexp(mx)[1] - 1, torch.zeros((), dtype=i32, device=dev))
        e_min = torch.where(any_nz, torch.frexp(torch.where(any_nz, mn, torch.ones_like(mn)))[1] - 1, e_max)
        span = torch.where(any_nz, e_max - e_min + 1, torch.zeros_like(e_max))
        has_zero = zeros.to(i32)
        needed = (span + has_zero).clamp(min=1)
        e = torch.ceil(torch.log2(needed.to(torch.float64)) - 1e-12).to(i32).clamp(min=0)
        capped = e > bits - 1
        e = torch.where(capped, torch.full_like(e, bits - 1), e)
        z = torch.where(capped, torch.ones_like(has_zero), has_zero)
        m = bits - 1 - e
        one = torch.ones((), dtype=i32, device=dev)
        one_m = (one << m).to(cdt)  # 2^m
        scale = one_m * 2.0  # mantissa in [0.5, 1) -> [2^m, 2^(m+1)]
        zero_field = (one << e) - 1
        f_max = zero_field - z
        e_top = e_max + 1
        top_frac = one_m - 1.0
        # pass 2: codes, packed chunk by chunk (chunks hold a multiple of 8 codes)
        out = torch.empty(packed_nbytes(d, bits), dtype=torch.uint8, device=dev)
        for a, b in spans:
            v = flat[a:b]
            mant = _finite_abs(v, cdt)
            is_zero = mant == 0
            ex = torch.empty(mant.shape, dtype=i32, device=dev)
            torch.frexp(mant, out=(mant, ex))  # |v| = mant * 2^ex, floor(log2 |v|) = ex - 1
            q = mant.mul_(scale).round_().sub_(one_m)  # fraction in [0, 2^m]
            carry = q >= one_m  # rounded up to the next octave
            q.masked_fill_(carry, 0.0)
            f = torch.sub(e_top, ex, out=ex).sub_(carry.to(i32))  # E_max - E, E after the carry
            top = f < 0  # carried past E_max: the largest code
            q.masked_fill_(top, top_frac)
            f.clamp_(min=0)
            is_zero |= f > f_max
            f.masked_fill_(is_zero, zero_field)
            q.masked_fill_(is_zero, 0.0)
            code = f.bitwise_left_shift_(m).bitwise_or_(q.to(i32))
            sign = (v < 0) & ~is_zero
            code.bitwise_or_(sign.to(i32) << (bits - 1))
            out[a * bits // 8 : a * bits // 8 + packed_nbytes(b - a, bits)] = pack_bits(code, bits)
        header = torch.stack([e_max, e, z]).to(torch.int32)
        return Packet([header, out], x.shape, x.dtype)

    def _table(self, e_max: torch.Tensor, e: torch.Tensor, z: torch.Tensor, code: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decoded values of ``code`` (int32) in ``dtype`` (fp32 or fp64)."""
        bits = self.bits
        m = bits - 1 - e
        one = torch.ones((), dtype=torch.int32, device=code.device)
        frac = code & ((one << m) - 1)
        f = (code >> m) & ((one << e) - 1)
        sign = (code >> (bits - 1)) & 1
        zero_field = (one << e) - 1
        is_zero = (z > 0) & (f == zero_field)
        sig = 1.0 + torch.ldexp(frac.to(dtype), (-m).to(dtype))
        # 2^k for k down to the subnormal end: two normal factors (2^k alone would flush to 0)
        k = (e_max - f).to(dtype)
        half = torch.floor(k / 2)
        mag = torch.ldexp(torch.ldexp(sig, half), k - half)
        val = torch.where(sign > 0, -mag, mag)
        return val.masked_fill_(is_zero, 0.0)

    def decode(self, packet: Packet) -> torch.Tensor:
        header, packed = packet.tensors
        d = math.prod(packet.shape)
        bits = self.bits
        h = header.to(torch.int32)
        e_max, e, z = h[0], h[1], h[2]
        dev = packed.device
        cdt = compute_dtype(packet.dtype)
        out = torch.empty(d, dtype=packet.dtype, device=dev)
        table = None
        if bits <= TABLE_BITS:  # every code's value, then one gather per chunk
            table = self._table(e_max, e, z, torch.arange(1 << bits, dtype=torch.int32, device=dev), cdt).to(packet.dtype)
        for a, b in chunk_spans(d, dev):
            code = unpack_bits(packed[a * bits // 8 : a * bits // 8 + packed_nbytes(b - a, bits)], bits, b - a)
            code = code.to(torch.int32)
            if table is not None:
                torch.index_select(table, 0, code, out=out[a:b])
            else:
                out[a:b] = self._table(e_max, e, z, code, cdt)
        return out.reshape(packet.shape)


def _finite_abs(v: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """|v| in ``dtype`` (a fresh buffer), non-finite entries as 0."""
    return v.to(dtype).abs().nan_to_num_(0.0, 0.0, 0.0)
