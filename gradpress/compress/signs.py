"""Sign kernels shared by the sign methods (signSGD, Signum, EF-signSGD,
1-bit SGD): one bit per entry, packed 8 per byte, and the gather that turns
the bits back into one of two values. Vectorized; no Python loop over
elements."""

from __future__ import annotations

import torch

from gradpress.compress.base import Packet, check_decode_out
from gradpress.compress.bits import byte_table, pack_bits, unpack_table

__all__ = ["pack_signs", "unpack_signs", "unpack_two"]


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """1 bit per entry of flat ``x``: 1 where x >= 0, packed 8 per byte."""
    return pack_bits(x.reshape(-1) >= 0, 1)


def unpack_signs(data: torch.Tensor, numel: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Flat +1/-1 tensor of ``dtype`` from :func:`pack_signs` output (into ``out``, flat, where given)."""
    return unpack_two(data, numel, torch.tensor([-1.0, 1.0], dtype=dtype, device=data.device), out)


def unpack_two(data: torch.Tensor, numel: int, values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Flat tensor of ``values[bit]`` (``values`` = [value of 0, value of 1])
    from 1-bit packed ``data``: one gather through a 256-entry table (into
    ``out``, flat, where given: :func:`gradpress.compress.bits.unpack_table`)."""
    return unpack_table(byte_table(1, values.dtype, data.device, values), data, numel, out)


def decode_signs(packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
    """+1/-1 from the packet's 1-bit payload (its first tensor), shaped like
    the packet, or written into ``out`` (``Compressor.decode_into``)."""
    if out is None:
        return unpack_signs(packet.tensors[0], packet.numel, packet.dtype).reshape(packet.shape)
    check_decode_out(packet, out)
    unpack_signs(packet.tensors[0], packet.numel, packet.dtype, out.view(-1))
    return out
