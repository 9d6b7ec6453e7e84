"""``minmax8``: 8-bit min-max quantization per chunk (as in ByteGrad and
PyTorch's quantization comm hooks).

Per chunk of ``chunk`` consecutive elements: ``lo = min`` and ``hi = max``
(fp32; fp64 for fp64 inputs); with ``step = (hi - lo) / 255`` each element
becomes the uint8 code ``c = round((x - lo) / step)`` and decodes to
``lo + c * step``. With ``stochastic=True`` the rounding is
``floor(v + U)``, U ~ Uniform[0, 1) from ``ctx.private_seed``, so the
quantizer is unbiased (``is_unbiased`` is True and error feedback is off by
default); deterministic rounding is biased (error <= step/2 per element)
and keeps error feedback on. A constant chunk decodes exactly.

Extreme inputs: the arithmetic never leaves the dtype's range. A chunk whose
largest magnitude exceeds half the dtype's maximum (where hi - lo, x - lo or
lo + c * step could overflow) is computed on its halves (exact) and doubled
back, saturating at the maximum; a step below the smallest normal number
(chunks of subnormals) is rounded up onto the subnormal grid, so codes stay
within 0..255 and the error stays <= step/2 there too. Encoder and decoder
derive the step from the transmitted lo and hi with the same function.

Packet: ``[mins (fp32, one per chunk; fp64 for fp64 inputs), maxs (same),
codes (uint8, one per element)]``, fixed size: d + 8*ceil(d/chunk) bytes
(fp64 inputs: d + 16*ceil(d/chunk)).
"""

from __future__ import annotations

import math

import torch

from gradpress.compress.base import Compressor, Context, Packet, Param, generator_for
from gradpress.compress.numerics import chunks, compute_dtype, host_reads

LEVELS = 255


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
        flat = x.reshape(-1).to(compute_dtype(x.dtype))
        gen = generator_for(x.device, ctx.private_seed) if self.stochastic else None
        codes = torch.empty(flat.numel(), dtype=torch.uint8, device=x.device)
        los, his = [flat.new_empty(0)], [flat.new_empty(0)]
        for grid, out in zip(chunks(flat, self.chunk), chunks(codes, self.chunk)):
            lo, hi = torch.aminmax(grid, dim=1)  # one fused pass
            f, lo_f, step = _frame(lo, hi)
            if f is None:  # one fresh buffer, then in place; steps are normal, so 1 / step is finite
                v = torch.sub(grid, lo[:, None]).mul_((1.0 / step)[:, None])
            else:  # halved chunks; subnormal steps (1 / step overflows): divide
                v = torch.mul(grid, f[:, None]).sub_(lo_f[:, None]).div_(step[:, None])
            if gen is not None:
                v.add_(torch.rand(v.shape, generator=gen, device=x.device, dtype=v.dtype)).floor_()
            else:
                v.round_()
            out.copy_(v.clamp_(0, LEVELS))
            los.append(lo)
            his.append(hi)
        return Packet([torch.cat(los), torch.cat(his), codes], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        lo, hi, codes = packet.tensors
        d = math.prod(packet.shape)
        f, lo_f, step = _frame(lo, hi)
        out = codes[:d].to(lo.dtype)
        start = 0
        for grid in chunks(out, self.chunk):  # lo + code * step, in place
            rows = grid.shape[0]
            grid.mul_(step[start : start + rows, None]).add_(lo_f[start : start + rows, None])
            start += rows
        if f is not None:  # halved chunks: double back, saturating
            start = 0
            big = torch.finfo(out.dtype).max
            for grid in chunks(out, self.chunk):
                rows = grid.shape[0]
                grid.div_(f[start : start + rows, None]).clamp_(-big, big)
                start += rows
        return out.to(packet.dtype).reshape(packet.shape)


def _frame(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Per chunk (f, lo * f, step): f = 1/2 where max(|lo|, |hi|) exceeds half
    the dtype's maximum (the chunk is worked on at half scale, exactly),
    else 1 (None: 1 for every chunk, known on the host); step = (hi f - lo f)
    / 255, rounded up onto the subnormal grid where it is subnormal so that
    255 steps cover the span. A constant chunk gets step 1: its codes are 0
    and it decodes to lo exactly."""
    info = torch.finfo(lo.dtype)
    span = hi - lo
    step = span / LEVELS
    if host_reads(lo) and lo.numel():
        # the common case, decided by one host read: no halving, no subnormal step
        ok = (lo.amin() >= -info.max / 2) & (hi.amax() <= info.max / 2) & (step.masked_fill(span == 0, 1.0).amin() >= info.tiny)
        if bool(ok):
            return None, lo, step.masked_fill_(span == 0, 1.0)
    f = torch.where(torch.maximum(lo.abs(), hi.abs()) > info.max / 2, torch.full_like(lo, 0.5), torch.ones_like(lo))
    lo_f, hi_f = lo * f, hi * f
    span = hi_f - lo_f
    step = span / LEVELS
    short = (step < info.tiny) & (step * LEVELS < span)
    step = torch.where(short, torch.nextafter(step, torch.full_like(step, math.inf)), step)
    return f, lo_f, torch.where(span > 0, step, torch.ones_like(step))
