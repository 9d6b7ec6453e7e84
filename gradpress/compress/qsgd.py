"""``qsgd``: stochastic quantization to s levels per bucket.

Alistarh et al. 2017, "QSGD: Communication-Efficient SGD via Gradient
Quantization and Encoding". The flat tensor is cut into buckets of b entries
(the last one may be shorter; ``bucket=0`` means one bucket for the whole
tensor). Per bucket n = ||v||_2 and, for each entry, with y = s|v_i|/n and
l = floor(y), the level is l + Bernoulli(y - l) (in 0..s); the decoded value
is n * sign(v_i) * level / s. Unbiased, with variance
E||Q(v) - v||^2 <= min(b/s^2, sqrt(b)/s) ||v||^2. The coin flips use
``ctx.private_seed`` (independent per rank, so averaging reduces variance).

Packet: ``[norms (fp32, ceil(d/b)), codes (uint8, bit-packed)]``; each code is
``(level << 1) | sign`` in ceil(log2(s+1)) + 1 bits, packed densely with
:func:`gradpress.wire.pack_bits`. Wire size: 4*ceil(d/b) +
ceil(d * bits / 8) bytes. Codes are fixed-width (no Elias coding).
"""

from __future__ import annotations

import math

import torch

from gradpress.compress.base import Compressor, Context, Packet, Param, generator_for
from gradpress.compress.registry import register
from gradpress.wire import pack_bits, unpack_bits

MAX_LEVELS = (1 << 23) - 1  # level + sign must fit the 24-bit packer


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; everything narrower is computed in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@register
class QSGD(Compressor):
    name = "qsgd"
    PARAMS = (
        Param("levels", int, 16, f"1 <= levels <= {MAX_LEVELS}", lambda v: 1 <= v <= MAX_LEVELS,
              "number of quantization levels s"),
        Param("bucket", int, 512, "bucket >= 0 (0: one bucket for the whole tensor)", lambda v: v >= 0,
              "entries per bucket sharing one norm"),
    )
    unbiased = True
    summary = "QSGD stochastic s-level quantization with per-bucket L2 norms (Alistarh et al. 2017)"

    @property
    def bits(self) -> int:
        """Bits per entry: ceil(log2(s + 1)) for the level, one for the sign."""
        return int(self.levels).bit_length() + 1

    def _bucket(self, numel: int) -> int:
        return self.bucket if self.bucket > 0 else max(numel, 1)

    def encode(self, x: torch.Tensor, ctx: Context | None = None) -> Packet:
        self._check_input(x)
        ctx = self._context(ctx)
        flat = x.reshape(-1).to(compute_dtype(x.dtype))
        d = flat.numel()
        b = self._bucket(d)
        nb = math.ceil(d / b)
        padded = torch.zeros(nb * b, dtype=flat.dtype, device=flat.device)
        padded[:d] = flat
        grid = padded.view(nb, b)
        norms = torch.linalg.vector_norm(grid, dim=1, keepdim=True)
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        s = float(self.levels)
        y = (grid.abs() / safe * s).reshape(-1)[:d]
        # a non-finite bucket has a non-finite norm and decodes non-finite; keep its codes in range
        y = torch.nan_to_num(y, nan=0.0, posinf=s, neginf=0.0)
        low = torch.floor(y)
        u = torch.rand(d, generator=generator_for(flat.device, ctx.private_seed), device=flat.device, dtype=flat.dtype)
        level = (low + (u < (y - low)).to(y.dtype)).clamp_(0, s).to(torch.int32)
        codes = (level << 1) | (flat < 0).to(torch.int32)
        return Packet([norms.reshape(-1).float(), pack_bits(codes, self.bits)], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        norms, data = packet.tensors[0], packet.tensors[1]
        d = math.prod(packet.shape)
        b = self._bucket(d)
        cdt = compute_dtype(packet.dtype)
        codes = unpack_bits(data, self.bits, d).to(torch.int32)
        level = (codes >> 1).to(cdt)
        sign = 1 - 2 * (codes & 1).to(cdt)
        scale = norms.to(cdt).repeat_interleave(b)[:d] / float(self.levels)
        return (scale * level * sign).to(packet.dtype).reshape(packet.shape)
