"""One flat byte buffer per exchange (bit packing itself lives in
:mod:`gradpress.compress.bits`, where the codecs use it).

* :func:`pack_packets` / :func:`unpack_packets`: the payload tensors of many
  packets laid into one ``uint8`` buffer, grouped by element size, largest
  first (16-byte complex128, then 8-, 4-, 2-, 1-byte), so every slice is
  naturally aligned with no padding: each group's bytes are a multiple of
  every smaller power of two. Variable
  size packets append a header of int32 element counts (one per payload
  tensor) at the end; its bytes are counted like any other.

All of it is vectorized tensor code: no Python loop over elements.
"""

from __future__ import annotations

import torch

from gradpress.compress.base import Packet

__all__ = ["pack_packets", "unpack_packets", "buffer_layout"]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1)
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8)


def buffer_layout(packets: list[Packet]) -> list[tuple[int, int]]:
    """(packet index, tensor index) pairs in the order they sit in the
    buffer: by element size, largest first, then packet by packet. Every
    element size of the packets' tensors is laid out (a fixed list of sizes
    once left complex128's 16 bytes out: packed into nothing); one that is
    not a power of two could not stay aligned and is refused."""
    sizes = sorted({t.element_size() for pk in packets for t in pk.tensors}, reverse=True)
    for size in sizes:
        if size & (size - 1):
            dtype = next(t.dtype for pk in packets for t in pk.tensors if t.element_size() == size)
            raise ValueError(f"wire: a packet tensor of dtype {dtype} has {size}-byte elements; allowed: element "
                             "sizes that are powers of two (1, 2, 4, 8, 16 bytes), which keep every slice aligned")
    order = []
    for size in sizes:
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
