"""``natural``: natural compression C_nat, stochastic rounding to powers of two.

Horvath et al. 2019, "Natural Compression for Distributed Deep Learning".
Each |t| in [a, 2a) with a = 2^floor(log2|t|) becomes 2a with probability
(|t| - a)/a and a otherwise, so E[C(t)] = t (variance factor omega = 1/8).
An exact power of two stays itself and zero stays zero.

Computed on IEEE-754 fp32 bits (inputs of any supported dtype are converted
to fp32): for a normal number with biased exponent e and 23-bit mantissa m,
P(up) = m / 2^23, so the result has exponent code e + Bernoulli(m / 2^23)
and zero mantissa. A subnormal (e = 0) |t| = m * 2^-149 is rounded
unbiasedly between 0 and 2^-126 with the same rule (P(up) = |t| / 2^-126 =
m / 2^23). Choices where the paper is silent: the code saturates at the
largest power of two the input dtype can hold (fp16: 2^15, fp32/bf16:
2^127; fp64 inputs are handled in fp32), so entries above it are rounded
down (a tiny bias instead of an overflow to inf); inf stays inf and NaN
becomes inf (both stay non-finite). Coins come from ``ctx.private_seed``.

Packet: ``[exponent codes (uint8, d), sign bits (uint8, packed 8 per
byte)]``: 9 bits per entry, d + ceil(d/8) bytes. A second-stage quantizer:
``topk:ratio=0.01>natural`` quantizes the values top-k keeps.
"""

from __future__ import annotations

import math

import torch

from gradpress.compress.base import Compressor, Context, Packet, generator_for
from gradpress.compress.bits import byte_table, pack_bits
from gradpress.compress.registry import register

_MANTISSA_BITS = 23
_MANTISSA_MASK = (1 << _MANTISSA_BITS) - 1
_BIAS = 127


def max_exponent_code(dtype: torch.dtype) -> int:
    """Largest fp32 exponent code whose power of two is finite in ``dtype``."""
    if dtype == torch.float64:
        dtype = torch.float32
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


@register
class Natural(Compressor):
    name = "natural"
    unbiased = True
    summary = "natural compression C_nat: unbiased rounding to powers of two, 9 bits (Horvath et al. 2019)"

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        x32 = x.reshape(-1).to(torch.float32).contiguous()
        gen = generator_for(x32.device, ctx.private_seed)
        codes, negative = natural_round(x32, gen, max_exponent_code(x.dtype))
        return Packet([codes, pack_bits(negative, 1)], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        codes, signs = packet.tensors[0], packet.tensors[1]
        d = math.prod(packet.shape)
        sign_bits = byte_table(1, torch.int32, signs.device, torch.tensor([0, -(1 << 31)], dtype=torch.int32))
        bits = codes.to(torch.int32).bitwise_left_shift_(_MANTISSA_BITS)
        bits.bitwise_or_(sign_bits[signs.long()].reshape(-1)[:d])
        return bits.view(torch.float32).to(packet.dtype).reshape(packet.shape)
