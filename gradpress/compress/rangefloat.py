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
Non-finite entries encode as zero.

Packet: ``[header (int32, 3: E_max, e, Z), codes (uint8, packed bits each)]``,
fixed size 12 + ceil(d*bits/8) bytes. A second-stage quantizer
(``values_index=None``): ``fft:theta=0.9>rangefloat``.
"""

from __future__ import annotations

import math

import torch

from gradpress.compress.base import Compressor, Context, Packet, Param
from gradpress.compress.registry import register
from gradpress.wire import pack_bits, unpack_bits


def relative_error_bound(bits: int, e: int) -> float:
    """2^-(m+1) with m = bits - 1 - e mantissa bits."""
    return 2.0 ** -(bits - e)


@register
class RangeFloat(Compressor):
    name = "rangefloat"
    PARAMS = (Param("bits", int, 8, "2 <= bits <= 24", lambda v: 2 <= v <= 24, "bits per value (sign + exponent + mantissa)"),)
    summary = "range-based float: exponent bits sized to the payload's range, shared bias (FFT sparsification paper)"

    def encode(self, x: torch.Tensor, ctx: Context | None = None) -> Packet:
        self._check_input(x)
        flat = x.reshape(-1).to(torch.float32)
        dev = x.device
        bits = self.bits
        mag = flat.abs()
        nz = (mag > 0) & torch.isfinite(mag)
        mant, ex = torch.frexp(torch.where(nz, mag, torch.ones_like(mag)))
        exp = (ex - 1).to(torch.int64)  # floor(log2 |v|)
        sig = mant * 2.0  # in [1, 2)
        big = torch.tensor(1 << 20, dtype=torch.int64, device=dev)
        any_nz = nz.any()
        e_max = torch.where(any_nz, torch.where(nz, exp, -big).max() if flat.numel() else -big, torch.zeros((), dtype=torch.int64, device=dev))
        e_min = torch.where(any_nz, torch.where(nz, exp, big).min() if flat.numel() else big, torch.zeros((), dtype=torch.int64, device=dev))
        span = torch.where(any_nz, e_max - e_min + 1, torch.zeros_like(e_max))
        has_zero = (~nz).any().to(torch.int64) if flat.numel() else torch.zeros((), dtype=torch.int64, device=dev)
        needed = (span + has_zero).clamp(min=1)
        e = torch.ceil(torch.log2(needed.to(torch.float64)) - 1e-12).to(torch.int64).clamp(min=0)
        capped = e > bits - 1
        e = torch.where(capped, torch.full_like(e, bits - 1), e)
        z = torch.where(capped, torch.ones_like(has_zero), has_zero)
        m = bits - 1 - e
        one_m = torch.ones((), dtype=torch.int64, device=dev) << m
        q = torch.round(torch.ldexp(sig, m.to(torch.float32))).to(torch.int64)  # in [2^m, 2^(m+1)]
        carry = q >= (one_m << 1)
        q = torch.where(carry, one_m, q)
        exp = exp + carry.to(torch.int64)
        f = e_max - exp
        top = f < 0  # carried past E_max: clamp to the largest code
        q = torch.where(top, (one_m << 1) - 1, q)
        f = f.clamp(min=0)
        zero_field = (torch.ones((), dtype=torch.int64, device=dev) << e) - 1
        f_max = zero_field - z
        is_zero = ~nz | (f > f_max)
        f = torch.where(is_zero, zero_field, f)
        frac = torch.where(is_zero, torch.zeros_like(q), q - one_m)
        sign = ((flat < 0) & ~is_zero).to(torch.int64)
        code = (sign << (bits - 1)) | (f << m) | frac
        header = torch.stack([e_max, e, z]).to(torch.int32)
        return Packet([header, pack_bits(code, bits)], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        header, packed = packet.tensors
        d = math.prod(packet.shape)
        bits = self.bits
        h = header.to(torch.int64)
        e_max, e, z = h[0], h[1], h[2]
        m = bits - 1 - e
        code = unpack_bits(packed, bits, d).to(torch.int64)
        one = torch.ones((), dtype=torch.int64, device=code.device)
        frac = code & ((one << m) - 1)
        f = (code >> m) & ((one << e) - 1)
        sign = (code >> (bits - 1)) & 1
        zero_field = (one << e) - 1
        is_zero = (z > 0) & (f == zero_field)
        sig = 1.0 + torch.ldexp(frac.to(torch.float32), (-m).to(torch.float32))
        mag = torch.ldexp(sig, (e_max - f).to(torch.float32))
        val = torch.where(sign > 0, -mag, mag)
        val = torch.where(is_zero, torch.zeros_like(val), val)
        return val.to(packet.dtype).reshape(packet.shape)
