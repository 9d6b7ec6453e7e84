"""``fp16`` and ``bf16``: cast to 16 bits, exchange, cast back.

Summable (the half-precision payloads add elementwise). The strategies scale
summable packets by 1/N before encoding, which keeps the fp16 sum from
overflowing (as PyTorch's ``fp16_compress_hook`` does). The cast saturates at
the target's largest finite value instead of overflowing to inf. Deterministic
round-to-nearest, so not exactly unbiased; error feedback is off by default
because the error is at the rounding level.
"""

from __future__ import annotations

import torch

from gradpress.compress.base import Compressor, Context, Packet
from gradpress.compress.registry import register


class _Cast(Compressor):
    summable = True
    unbiased = False
    target: torch.dtype = torch.float16

    @property
    def default_error_feedback(self) -> bool:
        return False

    def encode(self, x: torch.Tensor, ctx: Context | None = None) -> Packet:
        self._check_input(x)
        flat = x.reshape(-1)
        limit = torch.finfo(self.target).max
        if x.dtype != self.target and torch.finfo(x.dtype).max > limit:
            flat = flat.float().clamp(-limit, limit)  # saturate instead of overflowing to inf
        return Packet([flat.to(self.target).contiguous()], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        return packet.tensors[0].to(packet.dtype).reshape(packet.shape)


@register
class Float16(_Cast):
    name = "fp16"
    target = torch.float16
    summary = "IEEE half precision cast (2 bytes/element), summable"


@register
class BFloat16(_Cast):
    name = "bf16"
    target = torch.bfloat16
    summary = "bfloat16 cast (2 bytes/element), summable, fp32 range"
