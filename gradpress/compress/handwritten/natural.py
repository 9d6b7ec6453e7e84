"""``natural``: natural compression C_nat, stochastic rounding to powers of two.

Horvath et al. 2019, "Natural Compression for Distributed Deep Learning".
Each |t| in [a, 2a) with a = 2^floor(log2|t|) becomes 2a with probability
(|t| - a)/a and a otherwise, so E[C(t)] = t (variance factor omega = 1/8).
An exact power of two stays itself and zero stays zero.

The code is an fp32 exponent (8 bits: code c decodes to 2^(c - 127), 0 to
zero, 255 to inf), whatever the input dtype. fp32, fp16 and bf16 inputs are
computed on IEEE-754 fp32 bits (fp16/bf16 convert to fp32 exactly): for a
normal number with biased exponent e and 23-bit mantissa m, P(up) = m /
2^23, so the result has exponent code e + Bernoulli(m / 2^23) and zero
mantissa. A subnormal (e = 0) |t| = m * 2^-149 is rounded unbiasedly
between 0 and 2^-126 with the same rule (P(up) = |t| / 2^-126 = m / 2^23).
fp64 inputs are computed on their own fp64 bits, never converted to fp32:
P(up) is the 52-bit mantissa / 2^52, and every |t| below 2^-126 (fp64
reaches 2^-1074) is rounded between 0 and 2^-126 with P(up) = |t| / 2^-126,
exactly to 2^-52 (an absolute bias below 2^-178 per entry).

Range, the choices where the paper is silent: the code saturates at the
largest power of two the input dtype can hold within the code (fp16: 2^15;
fp32, bf16 and fp64: 2^127), so entries at or above it become that power
(a bias instead of an overflow to inf; for fp64, ``[1e300, -1e50, 3]``
decodes to ``[2^127, -2^127, 2 or 4]``); inf stays inf and NaN becomes inf
(both stay non-finite). Unbiased for every finite |t| below the saturation
point. Coins come from ``ctx.private_seed``.

Packet: ``[exponent codes (uint8, d), sign bits (uint8, packed 8 per
byte)]``: 9 bits per entry, d + ceil(d/8) bytes. A second-stage quantizer:
``topk:ratio=0.01>natural`` quantizes the values top-k keeps.
"""

from __future__ import annotations

import math

import torch

from gradpress.compress.base import Compressor, Context, Packet, generator_for
from gradpress.compress.bits import byte_table, pack_bits
from gradpress.compress.numerics import host_reads

_MANTISSA_BITS = 23
_MANTISSA_MASK = (1 << _MANTISSA_BITS) - 1
_BIAS = 127


def max_exponent_code(dtype: torch.dtype) -> int:
    """Largest fp32 exponent code whose power of two is finite in ``dtype``."""
    return min(254, _BIAS + math.floor(math.log2(torch.finfo(dtype).max)))


def natural_round(x32: torch.Tensor, generator: torch.Generator, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exponent codes (uint8) and sign mask (bool) of C_nat(x32), x32 flat fp32."""
    bits = x32.view(torch.int32)
    # e*2^23 + m + U, U uniform on 0..2^23-1, carries into the exponent with
    # probability m / 2^23: ((bits + U) >> 23) mod 256 = e + Bernoulli(m / 2^23)
    # (the sign bit only adds a multiple of 256). No rounding up at e >= cap.
    u = torch.randint(0, 1 << _MANTISSA_BITS, x32.shape, generator=generator, device=x32.device, dtype=torch.int32)
    if _may_reach(x32, cap):
        u.masked_fill_((bits & 0x7FFFFFFF) >= (cap << _MANTISSA_BITS), 0)
    codes = u.add_(bits).bitwise_right_shift_(_MANTISSA_BITS).to(torch.uint8)
    return codes, bits < 0


_MANTISSA64 = 52
_BIAS64 = 1023
_TINY_EXP64 = _BIAS64 - _BIAS + 1  # fp64 biased exponent of 2^-126, the smallest code's power


def natural_round64(x64: torch.Tensor, generator: torch.Generator, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exponent codes (uint8, fp32 meaning) and sign mask of C_nat(x64), x64
    flat fp64, computed on the fp64 bits (no conversion to fp32).

    With |t| = e * 2^52 + m in bits and U uniform on 0..2^52-1,
    (|t|bits + U) >> 52 = e + Bernoulli(m / 2^52): the fp32 code is that
    minus 896. The rare ranges (below 2^-126, at or above the cap,
    non-finite) are fixed up only where present (CPU: one host read)."""
    bits = x64.view(torch.int64)
    mag = bits & 0x7FFFFFFFFFFFFFFF
    u = torch.empty_like(bits).random_(generator=generator).bitwise_and_((1 << _MANTISSA64) - 1)
    code = torch.add(mag, u).bitwise_right_shift_(_MANTISSA64).sub_(_TINY_EXP64 - 1)
    low_limit, high_limit = _TINY_EXP64 << _MANTISSA64, (_TINY_EXP64 - 1 + cap) << _MANTISSA64
    if host_reads(x64) and x64.numel():
        lo, hi = torch.aminmax(mag)
        zeros = bool(lo == 0)
        if zeros:  # zeros are common (ReLU): the smallest nonzero magnitude decides
            lo = mag.masked_fill(mag == 0, high_limit).amin()
        if bool((lo >= low_limit) & (hi < high_limit)):
            if zeros:
                code.clamp_(min=0)  # a zero's code is 0 - 896 + 0
            return code.to(torch.uint8), bits < 0
    # |t| < 2^-126: code 1 (2^-126) with P = |t| / 2^-126 = (|t| 2^178) / 2^52, else 0
    tiny = mag < low_limit
    up = u.to(torch.float64) < x64.abs().mul_(2.0 ** (_BIAS - 1 + _MANTISSA64))
    code.masked_fill_(tiny, 0).add_(up.logical_and_(tiny))
    code.masked_fill_(mag >= high_limit, cap)  # saturate at 2^(cap - 127)
    code.masked_fill_(mag >= 0x7FF << _MANTISSA64, 255)  # inf and NaN
    return code.to(torch.uint8), bits < 0


def _may_reach(x32: torch.Tensor, cap: int) -> bool:
    """False when no |x| reaches 2^(cap - 127) and all are finite (then the
    cap cannot bind). On CPU one fused min/max read decides it; on other
    devices the masking always runs (cheaper than a host sync)."""
    if x32.device.type != "cpu" or x32.numel() == 0:
        return x32.numel() > 0
    lo, hi = torch.aminmax(x32)
    limit = 2.0 ** (cap - _BIAS)
    return not bool((lo > -limit) & (hi < limit))  # NaN compares False


def natural_decode(codes: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """fp32 values +-2^(code - 127) (code 0: zero, 255: inf)."""
    bits = codes.to(torch.int32).bitwise_left_shift_(_MANTISSA_BITS)
    return bits.bitwise_or_(negative.to(torch.int32).bitwise_left_shift_(31)).view(torch.float32)


class Natural(Compressor):
    name = "natural"
    unbiased = True
    summary = "natural compression C_nat: unbiased rounding to powers of two, 9 bits (Horvath et al. 2019)"

    def variance_factor(self, numel: int) -> float:
        return 1.0 / 8.0  # Horvath et al. 2019, Thm. 1

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        gen = generator_for(x.device, ctx.private_seed)
        if x.dtype == torch.float64:
            codes, negative = natural_round64(x.reshape(-1).contiguous(), gen, max_exponent_code(x.dtype))
            return Packet([codes, pack_bits(negative, 1)], x.shape, x.dtype)
        x32 = x.reshape(-1).to(torch.float32).contiguous()
        codes, negative = natural_round(x32, gen, max_exponent_code(x.dtype))
        return Packet([codes, pack_bits(negative, 1)], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        codes, signs = packet.tensors[0], packet.tensors[1]
        d = math.prod(packet.shape)
        sign_bits = byte_table(1, torch.int32, signs.device, torch.tensor([0, -(1 << 31)], dtype=torch.int32))
        bits = codes.to(torch.int32).bitwise_left_shift_(_MANTISSA_BITS)
        bits.bitwise_or_(sign_bits[signs.long()].reshape(-1)[:d])
        return bits.view(torch.float32).to(packet.dtype).reshape(packet.shape)
