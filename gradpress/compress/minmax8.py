"""``minmax8``: 8-bit min-max quantization per chunk (as in ByteGrad and
PyTorch's quantization comm hooks).

Per chunk of ``chunk`` consecutive elements: ``lo = min`` and ``hi = max``
(fp32; fp64 for fp64 inputs); with ``step = (hi - lo) / 255`` each element
becomes the uint8 code ``c = round((x - lo) / step)`` and decodes to
``lo + c * step``. With ``stochastic=True`` the rounding is
``floor(v + U)``, U ~ Uniform[0, 1) from ``ctx.private_seed`` (counter-based,
fused into the quantizing kernel: :mod:`gradpress.compress.kit.rng`), so the
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

Declared with the authoring kit (:mod:`gradpress.compress.kit`); the frozen
hand-written version is :mod:`gradpress.compress.handwritten.minmax8`.
"""

from __future__ import annotations

import math

import torch

from gradpress.compress import kit
from gradpress.compress.base import Context, Param
from gradpress.compress.numerics import host_reads
from gradpress.compress.registry import register

LEVELS = 255


def _codes(v, lo, step, f=None, *, key, drawn, stochastic):
    """round((v - lo) / step) (or floor(... + U)) in 0..255; halved chunks: (v f - lo f) / step."""
    y = (v - lo) * (1.0 / step) if f is None else (v * f - lo * f) / step
    y = torch.floor(y + kit.uniform(y, key, drawn)) if stochastic else torch.round(y)
    return y.clamp(0, LEVELS).to(torch.uint8)


def _values(c, lo_f, step, f=None, *, key, drawn, big):
    """lo + code * step; halved chunks doubled back, saturating."""
    out = c.to(step.dtype) * step + lo_f
    return out if f is None else (out / f).clamp(-big, big)


@register
class MinMax8(kit.KitCompressor):
    name = "minmax8"
    PARAMS = (
        Param("chunk", int, 1024, "chunk >= 1", lambda v: v >= 1, "elements per (min, max) pair"),
        Param("stochastic", bool, False, "true or false", None, "unbiased stochastic rounding"),
    )
    FIELDS = (kit.Field("mins", "compute", "chunks"), kit.Field("maxs", "compute", "chunks"), kit.Field("codes", torch.uint8))
    RANDOM = "private"
    summary = "8-bit per-chunk min-max quantization (ByteGrad / torch quantization hooks)"

    @property
    def is_unbiased(self) -> bool:
        return bool(self.stochastic)

    def chunk_size(self, numel: int) -> int:
        return self.chunk

    def encode_fields(self, flat: torch.Tensor, dtype: torch.dtype, ctx: Context) -> dict[str, torch.Tensor]:
        lo, hi = kit.reduce(flat, "minmax", self.chunk)
        f, lo_f, step = _frame(lo, hi)
        stats = (lo, step) if f is None else (lo, step, f)
        rnd = self.randomness(flat, ctx) if self.stochastic else {}
        codes = kit.elementwise(_codes, flat, self.chunk, stats, **rnd, stochastic=bool(self.stochastic))
        return {"mins": lo, "maxs": hi, "codes": codes}

    def decode_fields(self, fields: dict[str, torch.Tensor], numel: int, dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        f, lo_f, step = _frame(fields["mins"], fields["maxs"])
        stats = (lo_f, step) if f is None else (lo_f, step, f)
        big = torch.finfo(step.dtype).max
        into = out if out is not None and out.dtype == step.dtype else None
        return kit.elementwise(_values, fields["codes"], self.chunk, stats, big=big, out=into).to(dtype)


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
