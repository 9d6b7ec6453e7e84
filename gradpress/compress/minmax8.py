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

    def encode(self, x: torch.Tensor, ctx: Context | None = None) -> Packet:
        self._check_input(x)
        ctx = self._context(ctx)
        flat = x.reshape(-1).to(torch.float32)
        d = flat.numel()
        nchunks = -(-d // self.chunk)
        padded = torch.empty(nchunks * self.chunk, dtype=torch.float32, device=x.device)
        padded[:d] = flat
        if d:
            padded[d:] = flat[-1]  # padding never widens the last chunk's range
        grid = padded.view(nchunks, self.chunk)
        lo = grid.amin(dim=1) if d else torch.empty(0, device=x.device)
        hi = grid.amax(dim=1) if d else torch.empty(0, device=x.device)
        span = hi - lo
        safe = torch.where(span > 0, span, torch.ones_like(span))
        v = ((grid - lo[:, None]) / safe[:, None] * LEVELS).reshape(-1)[:d]
        if self.stochastic:
            gen = generator_for(x.device, ctx.private_seed)
            v = torch.floor(v + torch.rand(d, generator=gen, device=x.device))
        else:
            v = torch.round(v)
        codes = v.clamp(0, LEVELS).to(torch.uint8)
        return Packet([lo, hi, codes], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        lo, hi, codes = packet.tensors
        d = math.prod(packet.shape)
        nchunks = lo.numel()
        step = ((hi - lo) / LEVELS).repeat_interleave(self.chunk)[:d] if nchunks else lo
        base = lo.repeat_interleave(self.chunk)[:d] if nchunks else lo
        out = base + codes.to(torch.float32) * step
        return out.to(packet.dtype).reshape(packet.shape)
