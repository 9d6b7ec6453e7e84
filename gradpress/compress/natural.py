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
point. Coins come from ``ctx.private_seed``, counter-based
(:mod:`gradpress.compress.kit.rng`: 23 random bits per fp32 entry, 52 per
fp64 entry from two counters), fused into the kernel that rounds.

Packet: ``[exponent codes (uint8, d), sign bits (uint8, packed 8 per
byte)]``: 9 bits per entry, d + ceil(d/8) bytes. A second-stage quantizer:
``topk:ratio=0.01>natural`` quantizes the values top-k keeps.

Declared with the authoring kit (:mod:`gradpress.compress.kit`); the frozen
hand-written version is :mod:`gradpress.compress.handwritten.natural`.
"""

from __future__ import annotations

import math
import sys

import torch

from gradpress.compress import kit
from gradpress.compress.base import Context
from gradpress.compress.kit.rng import counter_bits
from gradpress.compress.registry import register

__all__ = ["Natural", "max_exponent_code"]

_BIAS, _BIAS64, _M64 = 127, 1023, 52
_TINY_EXP64 = _BIAS64 - _BIAS + 1  # fp64 biased exponent of 2^-126, the smallest code's power
#: elements per row of the kernel (no per-chunk statistic: rows of a multiple of kit.rng.LANES let a compiled
#: kernel count indices from the key's lane table whatever the length; the short last row counts with an iota)
TILE = 1 << 16


def max_exponent_code(dtype: torch.dtype) -> int:
    """Largest fp32 exponent code whose power of two is finite in ``dtype``."""
    return min(254, _BIAS + math.floor(math.log2(torch.finfo(dtype).max)))


def _round32(x: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None, cap: int) -> torch.Tensor:
    """fp32 bits + U (U < 2^23) carry into the exponent with P = mantissa / 2^23;
    no rounding up at e >= cap. Returns the exponent codes (uint8)."""
    bits = x.view(torch.int32)
    u = kit.random_bits(x, key, drawn, 23)
    u = torch.where((bits & 0x7FFFFFFF) >= (cap << 23), torch.zeros_like(u), u)
    return (((u + bits) >> 23) & 0xFF).to(torch.uint8)


def _round64(x: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None, cap: int) -> torch.Tensor:
    """The same on fp64 bits (code = e64 + carry - 896); below 2^-126 rounded
    between 0 and 2^-126, saturated at the cap, 255 for inf and NaN."""
    bits = x.view(torch.int64)
    mag = bits & 0x7FFFFFFFFFFFFFFF
    if drawn is None:
        # two counters per entry, 2i and 2i + 1 for the entry's index i over the whole tensor (offset included)
        idx = ((torch.arange(x.numel(), device=x.device).view(x.shape) + key[2]) * 2).to(torch.int32)
        u = ((counter_bits(key, idx).to(torch.int64) & 0xFFFFF) << 32) | (counter_bits(key, idx + 1).to(torch.int64) & 0xFFFFFFFF)
    else:
        u = drawn
    code = ((mag + u) >> _M64) - (_TINY_EXP64 - 1)
    tiny = mag < (_TINY_EXP64 << _M64)
    up = u.to(torch.float64) < x.abs() * 2.0 ** (_BIAS - 1 + _M64)
    code = torch.where(tiny, up.to(torch.int64), code)
    code = torch.where(mag >= (_TINY_EXP64 - 1 + cap) << _M64, torch.full_like(code, cap), code)
    code = torch.where(mag >= 0x7FF << _M64, torch.full_like(code, 255), code)
    return code.to(torch.uint8)


def _values(c: torch.Tensor, signs: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None) -> torch.Tensor:
    """fp32 values of a row of exponent codes: ``code << 23``, with sign bit
    j of the row's sign word (int64: 64 entries' bits, little-endian; or one
    byte) in bit 31."""
    lane = torch.arange(c.shape[1], dtype=signs.dtype, device=c.device)
    return ((c.to(torch.int32) << 23) | (((signs >> lane) & 1) << 31).to(torch.int32)).view(torch.float32)


def _sign_words(signs: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(per-row sign words, row width)``: the packed sign bytes as int64
    words of 64 entries each on little-endian machines (zero-padded to whole
    words, copied where the field starts off an 8-byte boundary or is strided), else the
    bytes themselves, rows of 8 (10M entries, one thread: 1.7 against 19 ms)."""
    if sys.byteorder != "little":
        return signs.to(torch.int32), 8
    if signs.numel() % 8 or signs.storage_offset() % 8 or signs.data_ptr() % 8 or not signs.is_contiguous():
        signs = torch.cat([signs, signs.new_zeros(-signs.numel() % 8)])
    return signs.view(torch.int64), 64


@register
class Natural(kit.KitCompressor):
    name = "natural"
    FIELDS = (kit.Field("codes", torch.uint8), kit.Field("signs", torch.uint8, bits=1))
    RANDOM = "private"
    unbiased = True
    summary = "natural compression C_nat: unbiased rounding to powers of two, 9 bits (Horvath et al. 2019)"

    def variance_factor(self, numel: int) -> float:
        return 1.0 / 8.0  # Horvath et al. 2019, Thm. 1

    def torch_draw(self, gen: torch.Generator, flat: torch.Tensor) -> torch.Tensor:
        if flat.dtype == torch.float64:  # the hand-written draws: 52 random bits, 23 bits for fp32
            return torch.empty(flat.shape, dtype=torch.int64, device=flat.device).random_(generator=gen) & ((1 << _M64) - 1)
        return torch.randint(0, 1 << 23, flat.shape, generator=gen, device=flat.device, dtype=torch.int32)

    def encode_fields(self, flat: torch.Tensor, dtype: torch.dtype, ctx: Context) -> dict[str, torch.Tensor]:
        kernel = _round64 if flat.dtype == torch.float64 else _round32
        flat = flat.contiguous()
        out = kit.elementwise(kernel, flat, TILE, (), **self.randomness(flat, ctx),
                              cap=max_exponent_code(dtype))
        return {"codes": out, "signs": kit.pack_signs(flat, "signbit")}  # -0.0 and NaN's sign too

    def decode_fields(self, fields: dict[str, torch.Tensor], numel: int, dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        # rows of 64 entries, each with its word of sign bits: one compiled pass (10M entries, one thread: 1.7 ms into
        # a buffer, against 45 ms for the exponents and a gather of the signs into fresh tensors)
        words, width = _sign_words(fields["signs"])
        into = out if out is not None and dtype == torch.float32 else None
        return kit.elementwise(_values, fields["codes"], width, (words,), out=into).to(dtype)
