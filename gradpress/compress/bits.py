"""Bit packing: n-bit unsigned codes (1..24 bits) packed densely, least
significant bit first, ``ceil(n * bits / 8)`` bytes (:func:`pack_bits`,
:func:`unpack_bits`), and 256-entry lookup tables that turn packed bytes back
into values (:func:`byte_table`).

Compressors build their payloads with these (tensors only: this module
knows nothing of the wire or of ``torch.distributed``). Vectorized tensor code, no Python loop over elements.
"""

from __future__ import annotations

import math
import sys

import torch

__all__ = ["pack_bits", "unpack_bits", "byte_table", "packed_nbytes"]


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
    if bits < 8 and sys.byteorder == "little":
        return _pack_narrow(codes, bits, n, nbytes)
    if 8 % bits == 0:
        per_byte = 8 // bits
        padded = torch.zeros(nbytes * per_byte, dtype=torch.uint8, device=codes.device)
        padded[:n] = codes.to(torch.uint8)
        grid = padded.view(nbytes, per_byte)
        out = grid[:, 0].clone()
        for j in range(1, per_byte):  # at most 8 vectorized passes
            out |= grid[:, j] << (j * bits)
        return out
    return _pack_groups(codes, bits, nbytes)


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
        return ((data.unsqueeze(1) >> shifts) & mask).reshape(-1)[:numel]
    if bits < 8 and sys.byteorder == "little":
        return _unpack_narrow(data, bits, numel)
    codes = _unpack_groups(data, bits, numel)
    return codes.to(torch.uint8) if bits <= 8 else codes


def byte_table(bits: int, dtype: torch.dtype, device: torch.device, values: torch.Tensor | None = None) -> torch.Tensor:
    """``(256, 8 // bits)`` table: row ``b`` holds the codes packed in byte
    ``b`` (LSB first), or ``values[code]`` when ``values`` is given. Indexing
    it with the packed bytes unpacks (and maps) every code in one gather."""
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, device=device)
    table = (torch.arange(256, device=device).unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return (values.to(device)[table] if values is not None else table).to(dtype).reshape(256, per)


def unpack_table(table: torch.Tensor, data: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``numel`` values of the codes packed in the bytes ``data``,
    each byte mapped to its row of ``table`` (a ``(256, per)``
    :func:`byte_table`). ``out``: a flat contiguous buffer of ``numel``
    entries of the table's dtype, written in place (``index_select`` with
    int32 indices: the same values, and no int64 index tensor, whose fresh
    pages cost more than the gather at 25M entries)."""
    if out is None:
        return table[data.long()].reshape(-1)[:numel]
    per = table.shape[1]
    if out.dim() != 1 or out.numel() != numel or out.dtype != table.dtype or not out.is_contiguous():
        raise ValueError(f"unpack_table: out is {tuple(out.shape)} x {out.dtype}; allowed: a flat contiguous tensor "
                         f"of {numel} entries of {table.dtype}")
    whole = numel // per
    torch.index_select(table, 0, data[:whole].to(torch.int32), out=out[: whole * per].view(whole, per))
    if whole * per < numel:  # the last byte holds fewer codes
        out[whole * per:] = table[data[whole: whole + 1].long()].reshape(-1)[: numel - whole * per]
    return out


# ----- narrow widths (bits < 8), little-endian -------------------------------------
# Codes are first laid one per byte (uint8), so a group of L = 8 / gcd(bits, 8)
# codes fills one L-byte machine word. Widths 1, 2, 4 gather the L fields of a
# word into its top byte with one multiplication (each product term lands on its
# own bit positions, so no carries mix fields); other widths compact the word
# with log2(L) mask-shift-or steps. Unpacking reverses the steps (1, 2, 4: a
# 256-entry lookup table). Every pass works on n bytes, not n words.

_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_signed64(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _lane_masks(have: int, lane: int, word_bits: int) -> tuple[int, int]:
    """Masks of the low and high ``have``-bit fields in every ``2*lane``-bit
    lane of a ``word_bits``-bit word."""
    lo = sum(((1 << have) - 1) << s for s in range(0, word_bits, 2 * lane))
    return _as_signed64(lo), _as_signed64(lo << have)


def _bytes_padded(codes: torch.Tensor, length: int) -> torch.Tensor:
    """``codes`` as uint8, zero padded to ``length`` (a view when possible)."""
    n = codes.numel()
    if n == length and codes.dtype in (torch.uint8, torch.bool) and codes.is_contiguous():
        return codes.view(torch.uint8)
    buf = torch.empty(length, dtype=torch.uint8, device=codes.device)
    buf[:n] = codes
    buf[n:] = 0
    return buf


def _pack_narrow(codes: torch.Tensor, bits: int, n: int, nbytes: int) -> torch.Tensor:
    per, nb = _group(bits)
    m = -(-n // per)
    w = _bytes_padded(codes, m * per).view(_WORD[per])
    if 8 % bits == 0:  # fields land in the top byte of the product
        mul = _as_signed64(sum(1 << (8 * (per - 1) - (8 - bits) * j) for j in range(per)))
        top = (w * mul).view(torch.uint8).view(m, per)[:, per - 1]
        return top.contiguous()[:nbytes]
    have, lane = bits, 8
    while lane < 8 * per:
        lo, hi = _lane_masks(have, lane, 8 * per)
        w = (w & lo).bitwise_or_((w >> (lane - have)).bitwise_and_(hi))
        have, lane = 2 * have, 2 * lane
    return w.view(torch.uint8).view(m, per)[:, :nb].reshape(-1)[:nbytes]


def _unpack_narrow(data: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    per, nb = _group(bits)
    m = -(-numel // per)
    buf = torch.zeros(m, per, dtype=torch.uint8, device=data.device)
    if data.numel() == m * nb:
        buf[:, :nb] = data.view(m, nb)
    else:  # the last group is short
        tail = torch.zeros(m * nb, dtype=torch.uint8, device=data.device)
        tail[: data.numel()] = data
        buf[:, :nb] = tail.view(m, nb)
    w = buf.view(_WORD[per]).view(-1)
    have, lane = bits * per // 2, 4 * per
    while lane >= 8:
        lo, hi = _lane_masks(have, lane, 8 * per)
        w = (w & lo).bitwise_or_((w & hi) << (lane - have))
        have, lane = have // 2, lane // 2
    return w.view(torch.uint8)[:numel]


# ----- general widths ------------------------------------------------------------
# Codes are handled in groups of L = 8 / gcd(bits, 8) codes, the shortest run
# that ends on a byte boundary (B = bits * L / 8 bytes). When a group fits a
# machine word (L * bits <= 64, little-endian host) it is assembled with L
# shift-or passes over strided columns and its low B bytes are kept; otherwise
# each of the B bytes is built from the (at most 4) codes overlapping it. Both
# give the same LSB-first bit stream as expanding every code into bits, with
# O(L + B) vectorized passes instead of O(bits) passes over a bit matrix.


def byte_columns(grid: torch.Tensor, bits: int, nb: int, unit: int = 8) -> list[torch.Tensor]:
    """The ``nb`` units of ``unit`` bits (bytes; 32: int32 words) of each
    group of ``grid`` (int32 codes, one group per row): unit k is the or of
    the codes overlapping it, shifted into place; higher bits are left for
    the caller to drop (an int32 word drops them as it wraps)."""
    cols = []
    for k in range(nb):
        acc = None
        for j in range(grid.shape[1]):
            start = j * bits
            if start + bits <= unit * k or start >= unit * k + unit:
                continue
            shift = start - unit * k
            term = grid[:, j] << shift if shift >= 0 else grid[:, j] >> -shift
            acc = term if acc is None else acc | term
        cols.append(acc)
    return cols


def code_columns(grid: torch.Tensor, bits: int, per: int) -> list[torch.Tensor]:
    """Inverse of :func:`byte_columns`: the ``per`` codes of each row of
    ``grid`` (int32 bytes, one group per row), each the or of the bytes it
    overlaps; bits above ``bits`` are left for the caller to mask."""
    cols = []
    for j in range(per):
        start = j * bits
        acc = None
        for k in range(start // 8, (start + bits - 1) // 8 + 1):
            shift = 8 * k - start
            term = grid[:, k] << shift if shift >= 0 else grid[:, k] >> -shift
            acc = term if acc is None else acc | term
        cols.append(acc)
    return cols


#: codes per group, L = 8 / gcd(bits, 8), for each width 1..24: a table, so that code compiled by
#: torch.compile can read it (Dynamo breaks the graph at math.gcd, an int-returning builtin; the kit's
#: in-kernel packing once ran as a second, scalar loop because of it)
GROUP = {bits: 8 // math.gcd(bits, 8) for bits in range(1, 25)}
#: codes per group of whole int32 words, 32 / gcd(bits, 32) (the kit's word-wide packs; same reason for a table)
WORD_GROUP = {bits: 32 // math.gcd(bits, 32) for bits in range(1, 25)}


def _group(bits: int) -> tuple[int, int]:
    per = GROUP[bits]
    return per, bits * per // 8


def _word(width: int) -> tuple[torch.dtype, int] | None:
    if sys.byteorder != "little":
        return None
    if width <= 32:
        return torch.int32, 4
    if width <= 64:
        return torch.int64, 8
    return None


def _pack_groups(codes: torch.Tensor, bits: int, nbytes: int) -> torch.Tensor:
    n = codes.numel()
    per, nb = _group(bits)
    m = -(-n // per)
    word = _word(per * bits)
    padded = torch.zeros(m * per, dtype=word[0] if word else torch.int32, device=codes.device)
    padded[:n] = codes
    grid = padded.view(m, per)
    if word is not None:
        acc = grid[:, 0].clone(memory_format=torch.contiguous_format)
        for j in range(1, per):
            acc |= grid[:, j] << (j * bits)
        return acc.view(torch.uint8).view(m, word[1])[:, :nb].reshape(-1)[:nbytes]
    out = torch.empty(m, nb, dtype=torch.uint8, device=codes.device)
    for k, acc in enumerate(byte_columns(grid, bits, nb)):
        out[:, k] = acc  # the uint8 store keeps the low 8 bits
    return out.reshape(-1)[:nbytes]


def _unpack_groups(data: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    per, nb = _group(bits)
    m = -(-numel // per)
    mask = (1 << bits) - 1
    word = _word(per * bits)
    out = torch.empty(m, per, dtype=torch.int32, device=data.device)
    if word is not None:
        flat = torch.zeros(m * nb, dtype=torch.uint8, device=data.device)
        flat[: data.numel()] = data
        buf = torch.zeros(m, word[1], dtype=torch.uint8, device=data.device)
        buf[:, :nb] = flat.view(m, nb)
        w = buf.view(word[0]).view(-1)
        for j in range(per):
            out[:, j] = (w >> (j * bits)) & mask
    else:
        flat = torch.zeros(m * nb, dtype=torch.int32, device=data.device)
        flat[: data.numel()] = data
        for j, acc in enumerate(code_columns(flat.view(m, nb), bits, per)):
            out[:, j] = acc & mask
    return out.reshape(-1)[:numel]
