"""``none``: the identity. Summable and unbiased; the baseline every method is
compared with. Packet: the tensor itself, flattened."""

from __future__ import annotations

import torch

from gradpress.compress.base import Compressor, Context, Packet
from gradpress.compress.registry import register


@register
class NoCompression(Compressor):
    name = "none"
    summable = True
    unbiased = True
    identity = True
    uses_context = False  # a pure function of x
    summary = "no compression (dense baseline)"

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        # reshape(-1) of a strided 1-D view is still strided: payloads must be contiguous
        return Packet([x.reshape(-1).contiguous()], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        return packet.tensors[0].reshape(packet.shape).to(packet.dtype)
