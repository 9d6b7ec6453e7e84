"""``minmax8``: 8-bit min-max quantization per chunk (as in ByteGrad and
PyTorch's quantization comm hooks).

Per chunk of ``chunk`` consecutive elements: fp32 ``lo = min`` and
``hi = max``; each element becomes the uint8 code
``c = round((x - lo) / (hi - lo) * 255)`` and decodes to
``lo + c * (hi - lo) / 255``. With ``stochastic=True`` the rounding is
``floor(v + U)``, U ~ Uniform[0, 1) from ``ctx.private_seed``, so the
quantizer is unbiased (``is_unbiased`` is True and error feedback is off by
default); deterministic rounding is biased (error <= (hi - lo)/510 per
element) and keeps error feedback on. A constant chunk decodes exactly.

Packet: ``[mins (fp32, one per chunk), maxs (fp32, one per chunk), codes
(uint8, one per element)]``, fixed size: d + 8*ceil(d/chunk) bytes.
"""

from __future__ import annotations

import math

import torch

from gradpress.compress.base import Compressor, Context, Packet, Param, generator_for
from gradpress.compress.registry import register

LEVELS = 255


@register
class MinMax8(Compressor):
    name = "minmax8"
    PARAMS = (
        Param("chunk", int, 1024, "chunk >= 1", lambda v: v >= 1, "elements per (min, max) pair"),
        Param("stochastic", bool, False, "true or false", None, "unbiased stochastic rounding"),
    )
    summary = "8-bit per-chunk min-max quantization (ByteGrad / torch quantization hooks)"

    @property
    def is_unbiased(self) -> bool:
        return bool(self.stochastic)

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        flat = x.reshape(-1).to(torch.float32)
        gen = generator_for(x.device, ctx.private_seed) if self.stochastic else None
        codes = torch.empty(flat.numel(), dtype=torch.uint8, device=x.device)
        los, his = [torch.empty(0, device=x.device)], [torch.empty(0, device=x.device)]
        for grid, out in zip(_chunked(flat, self.chunk), _chunked(codes, self.chunk)):
            lo, hi = torch.aminmax(grid, dim=1)  # one fused pass
            span = hi - lo
            scale = LEVELS / torch.where(span > 0, span, torch.ones_like(span))
            v = torch.sub(grid, lo[:, None]).mul_(scale[:, None])  # one fresh buffer, then in place
            if gen is not None:
                v.add_(torch.rand(v.shape, generator=gen, device=x.device)).floor_()
            else:
                v.round_()
            out.copy_(v.clamp_(0, LEVELS))
            los.append(lo)
            his.append(hi)
        return Packet([torch.cat(los), torch.cat(his), codes], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        lo, hi, codes = packet.tensors
        d = math.prod(packet.shape)
        step = (hi - lo) / LEVELS
        out = codes[:d].to(torch.float32)
        start = 0
        for grid in _chunked(out, self.chunk):  # lo + code * step, in place
            rows = grid.shape[0]
            grid.mul_(step[start : start + rows, None]).add_(lo[start : start + rows, None])
            start += rows
        return out.to(packet.dtype).reshape(packet.shape)


def _chunked(flat: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """Views of ``flat`` as ``(d // chunk, chunk)`` whole chunks and a
    ``(1, d % chunk)`` short last chunk (each only when non-empty)."""
    d = flat.numel()
    full = d // chunk * chunk
    parts = [flat[:full].view(-1, chunk)] if full else []
    if full < d:
        parts.append(flat[full:].view(1, -1))
    return parts
