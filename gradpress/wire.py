"""Bit packing and one flat byte buffer per exchange.

* :func:`pack_bits` / :func:`unpack_bits`: n-bit unsigned codes (1..24 bits)
  packed densely, least significant bit first; ``ceil(n * bits / 8)`` bytes.
  Widths that divide 8 (1, 2, 4, 8) take a shift-and-or fast path.
* :func:`pack_packets` / :func:`unpack_packets`: the payload tensors of many
  packets laid into one ``uint8`` buffer, grouped by element size (8-, 4-, 2-,
  then 1-byte) so every slice is naturally aligned with no padding. Variable
  size packets append a header of int32 element counts (one per payload
  tensor) at the end; its bytes are counted like any other.

All of it is vectorized tensor code: no Python loop over elements.
"""

from __future__ import annotations

import torch

from gradpress.compress.base import Packet

__all__ = ["pack_bits", "unpack_bits", "packed_nbytes", "pack_packets", "unpack_packets", "buffer_layout"]


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits occupy."""
    return (numel * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 24:
        raise ValueError(f"bits must be in 1..24, got {bits}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned integer ``codes`` (each < 2**bits) into a uint8 tensor."""
    _check_bits(bits)
    codes = codes.reshape(-1)
    n = codes.numel()
    nbytes = packed_nbytes(n, bits)
    if bits == 8:
        return codes.to(torch.uint8)
    if 8 % bits == 0:
        per_byte = 8 // bits
        padded = torch.zeros(nbytes * per_byte, dtype=torch.uint8, device=codes.device)
        padded[:n] = codes.to(torch.uint8)
        grid = padded.view(nbytes, per_byte)
        out = grid[:, 0].clone()
        for j in range(1, per_byte):  # at most 8 vectorized passes
            out |= grid[:, j] << (j * bits)
        return out
    # general width: expand to a bit matrix, then fold 8 bits per byte
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    bitmat = ((codes.to(torch.int32).unsqueeze(1) >> shifts) & 1).to(torch.uint8).reshape(-1)
    padded = torch.zeros(nbytes * 8, dtype=torch.uint8, device=codes.device)
    padded[: bitmat.numel()] = bitmat
    grid = padded.view(nbytes, 8)
    out = grid[:, 0].clone()
    for j in range(1, 8):
        out |= grid[:, j] << j
    return out


def unpack_bits(data: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``numel`` codes as uint8 (bits <= 8) or
    int32 (wider)."""
    _check_bits(bits)
    data = data.reshape(-1)
    if data.numel() != packed_nbytes(numel, bits):
        raise ValueError(f"packed buffer has {data.numel()} bytes, expected {packed_nbytes(numel, bits)} for {numel} codes of {bits} bits")
    if bits == 8:
        return data[:numel].clone()
    if 8 % bits == 0:
        mask = (1 << bits) - 1
        shifts = torch.arange(0, 8, bits, device=data.device, dtype=torch.uint8)
        codes = (data.unsqueeze(1) >> shifts) & mask
        return codes.reshape(-1)[:numel]
    shifts8 = torch.arange(8, device=data.device, dtype=torch.uint8)
    bitmat = ((data.unsqueeze(1) >> shifts8) & 1).reshape(-1)[: numel * bits].view(numel, bits)
    weights = (1 << torch.arange(bits, device=data.device, dtype=torch.int32))
    codes = (bitmat.to(torch.int32) * weights).sum(dim=1, dtype=torch.int32)
    return codes.to(torch.uint8) if bits <= 8 else codes


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1)
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8)


_SIZES = (8, 4, 2, 1)


def buffer_layout(packets: list[Packet]) -> list[tuple[int, int]]:
    """(packet index, tensor index) pairs in the order they sit in the buffer."""
    order = []
    for size in _SIZES:
        for pi, pk in enumerate(packets):
            for ti, t in enumerate(pk.tensors):
                if t.element_size() == size:
                    order.append((pi, ti))
    return order


def pack_packets(packets: list[Packet], variable: bool, device: torch.device | None = None) -> torch.Tensor:
    """One flat uint8 buffer holding every payload tensor of ``packets``.

    With ``variable`` the int32 element counts of every tensor (in packet,
    tensor order) are appended, so a receiver can parse a packet whose sizes
    differ from its own.
    """
    parts = [_as_bytes(packets[pi].tensors[ti]) for pi, ti in buffer_layout(packets)]
    if variable:
        counts = torch.tensor(
            [t.numel() for pk in packets for t in pk.tensors], dtype=torch.int32,
            device=parts[0].device if parts else device,
        )
        parts.append(counts.view(torch.uint8))
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat(parts)


def unpack_packets(buffer: torch.Tensor, templates: list[Packet], variable: bool) -> list[Packet]:
    """Parse a buffer made by :func:`pack_packets` on another rank.

    ``templates`` are this rank's packets for the same tensors: they give
    dtypes, shapes and (for fixed-size packets) element counts.
    """
    n_tensors = sum(len(p.tensors) for p in templates)
    if variable:
        header_bytes = 4 * n_tensors
        counts_list = buffer[buffer.numel() - header_bytes :].clone().view(torch.int32).tolist()
        it = iter(counts_list)
        counts = [[next(it) for _ in p.tensors] for p in templates]
    else:
        counts = [[t.numel() for t in p.tensors] for p in templates]
    out: list[list[torch.Tensor | None]] = [[None] * len(p.tensors) for p in templates]
    offset = 0
    for pi, ti in buffer_layout(templates):
        tmpl = templates[pi].tensors[ti]
        size = tmpl.element_size()
        nbytes = counts[pi][ti] * size
        chunk = buffer[offset : offset + nbytes]
        dtype = torch.uint8 if tmpl.dtype == torch.bool else tmpl.dtype
        tensor = chunk.view(dtype)
        if tmpl.dtype == torch.bool:
            tensor = tensor.bool()
        out[pi][ti] = tensor
        offset += nbytes
    # metadata is never sent: every rank derives it the same way (shape, shared seeds)
    return [Packet(list(ts), p.shape, p.dtype, dict(p.meta)) for ts, p in zip(out, templates)]  # type: ignore[arg-type]
