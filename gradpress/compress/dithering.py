"""``dithering``: random dithering, standard or natural (Horvath et al. 2019,
"Natural Compression for Distributed Deep Learning", section 4).

y_i = |x_i| / ||x||_p is rounded at random to one of the two adjacent levels
so that E[level] = y_i (probability of the upper level (y - lo)/(hi - lo)),
using ``ctx.private_seed`` (independent per rank). Levels (s = ``levels``):

* standard (``natural=False``): {0, 1/s, 2/s, ..., 1} (with p = 2 this is
  QSGD; with p = inf and s = 1, TernGrad);
* natural (``natural=True``): {0, 2^(1-s), 2^(2-s), ..., 1/2, 1}; an exact
  power of two stays itself.

Unbiased: E[decode(encode(x))] = x. Variance (Horvath et al., Thm. for
D_nat^{p,s}): E||C(x) - x||^2 <= omega ||x||^2 with
omega = 1/8 + d^(1/r) 2^(1-s) min(1, d^(1/r) 2^(1-s)), r = min(p, 2); for
p = 2: omega = 1/8 + min(sqrt(d)/2^(s-1), d/2^(2(s-1))). Standard dithering
(p = 2): omega = min(d/s^2, sqrt(d)/s) (Alistarh et al. 2017).

Packet: ``[norm (fp32, 1), sign bits (uint8, packed 1 bit each), level
indices (uint8, packed ceil(log2(s+1)) bits each)]``, fixed size: 4 +
ceil(d/8) + ceil(d*b/8) bytes. No separate values (``values_index=None``):
it is a second-stage quantizer (``topk:ratio=0.01>dithering``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gradpress.compress.base import Compressor, Context, Packet, Param, generator_for
from gradpress.compress.registry import register
from gradpress.wire import pack_bits, unpack_bits


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
    )
    unbiased = True
    summary = "random dithering, standard or natural levels (Horvath et al. 2019), norm + sign + level bits"

    def _validate(self) -> None:
        if self.natural and self.levels > 120:
            raise ValueError(
                f"compressor 'dithering': parameter 'levels' got {self.levels!r}; allowed: 1 <= levels <= 120 when natural=true"
            )

    def _levels_of(self, code: torch.Tensor) -> torch.Tensor:
        c = code.to(torch.float32)
        if self.natural:
            return torch.where(code == 0, torch.zeros_like(c), torch.exp2(c - self.levels))
        return c / self.levels

    def encode(self, x: torch.Tensor, ctx: Context | None = None) -> Packet:
        self._check_input(x)
        ctx = self._context(ctx)
        flat = x.reshape(-1).to(torch.float32)
        d = flat.numel()
        s = self.levels
        bits = code_bits(s)
        norm = torch.linalg.vector_norm(flat, ord=float(self.p)) if d else torch.zeros((), device=x.device)
        safe = torch.where(norm > 0, norm, torch.ones_like(norm))
        y = (flat.abs() / safe).clamp(max=1.0)
        if self.natural:
            _, exp = torch.frexp(y)
            lo_idx = torch.where(y >= 2.0 ** (1 - s), (exp - 1 + s).to(torch.int64), torch.zeros_like(exp, dtype=torch.int64))
            lo_idx = lo_idx.clamp(0, s)
            lo = self._levels_of(lo_idx)
            hi = torch.exp2((lo_idx + 1 - s).to(torch.float32))
        else:
            t = y * s
            lo_idx = torch.floor(t).to(torch.int64).clamp(0, s)
            lo = lo_idx.to(torch.float32) / s
            hi = (lo_idx + 1).to(torch.float32) / s
        prob = ((y - lo) / (hi - lo)).clamp(0.0, 1.0)
        gen = generator_for(x.device, ctx.private_seed)
        up = torch.rand(d, generator=gen, device=x.device) < prob
        code = (lo_idx + up.to(torch.int64)).clamp(max=s)
        signs = pack_bits((flat < 0).to(torch.uint8), 1)
        return Packet([norm.reshape(1).to(torch.float32), signs, pack_bits(code, bits)], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        norm, signs, codes = packet.tensors
        d = math.prod(packet.shape)
        neg = unpack_bits(signs, 1, d).to(torch.bool)
        code = unpack_bits(codes, code_bits(self.levels), d).to(torch.int64)
        mag = self._levels_of(code) * norm.reshape(()).to(torch.float32)
        return torch.where(neg, -mag, mag).to(packet.dtype).reshape(packet.shape)
