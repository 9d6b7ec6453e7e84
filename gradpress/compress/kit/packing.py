"""Traceable bit packing: unsigned integer codes of any width 1..24 bits,
densely packed least significant bit first into ``ceil(n * bits / 8)``
bytes: the same bit stream as :func:`gradpress.compress.bits.pack_bits`
(tested bit for bit), written only with shape-generic tensor ops (a pad, a
2-D view, shifts and ors over the codes of a group) so that
``torch.compile`` can trace it: inside the kernel that produces the codes
(:func:`pack_groups`, through ``kit.pack_rows``) or as a pass of its own
over whole int32 words (:func:`pack_words`, :func:`unpack_words`, run by
:mod:`gradpress.compress.kit.streams`, which is what ``kit.pack`` and
``kit.unpack`` call).

A group of L = 8 / gcd(bits, 8) codes fills B = bits * L / 8 whole bytes;
byte k of a group is the or of the (at most 4) codes that overlap it, each
shifted into place. Invariant: ``unpack(pack(c, b), b, n) == c`` for codes
below 2^b; padding bits are zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gradpress.compress.bits import GROUP, WORD_GROUP, byte_columns, code_columns

__all__ = ["pack", "pack_groups", "pack_words", "unpack", "unpack_words", "packed_nbytes", "GROUP", "WORD_GROUP",
           "group", "word_group"]


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits occupy."""
    return (numel * bits + 7) // 8


def _codes_per_group(bits: int, table: dict[int, int], unit: int) -> tuple[int, int]:
    """``(codes, units)`` of a group that fills whole ``unit``-bit units, from
    ``table``; ValueError outside 1..24 (traceable by Dynamo: a table lookup,
    not math.gcd)."""
    if not isinstance(bits, int) or not 1 <= bits <= 24:
        raise ValueError(f"kit.pack/unpack: bits got {bits!r}; allowed: an int in 1..24")
    per = table[bits]
    return per, bits * per // unit


def group(bits: int) -> tuple[int, int]:
    """``(L, B)``: codes per group and bytes per group for ``bits``-bit
    codes (:data:`gradpress.compress.bits.GROUP`)."""
    return _codes_per_group(bits, GROUP, 8)


def word_group(bits: int) -> tuple[int, int]:
    """``(C, W)``: codes per group and int32 words per group when whole words
    are filled, C = 32 / gcd(bits, 32) (:data:`gradpress.compress.bits.WORD_GROUP`)."""
    return _codes_per_group(bits, WORD_GROUP, 32)


def pack_words(grid: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed bytes of ``(m, C)`` codes, C from :func:`word_group`: each
    group's W int32 words (word k the or of the codes overlapping it, shifted
    into place; bits past 32 wrap away), their bytes as uint8 in memory
    order. That is the LSB-first stream of :func:`pack` on a little-endian
    host only (the caller checks), for codes below ``2**bits`` (a larger or
    negative code spills into its neighbours). The words come out as whole
    int32 stores and the codes are read once: compiled, 4.7-8.4x faster
    than the eager pack for 3, 5, 6 and 7 bits (docs/bench.md)."""
    _, words = word_group(bits)
    cols = byte_columns(grid.to(torch.int32), bits, words, unit=32)
    return torch.stack(cols, dim=1).view(torch.uint8).reshape(-1)


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_words`: ``(m, W)`` int32 words (the packed
    bytes viewed as int32 on a little-endian host) to ``m * C`` codes, uint8
    for bits <= 8, int32 wider. Right shifts of int32 are arithmetic, so
    every piece of a code is masked to its own bits before the or."""
    per, _ = word_group(bits)
    cols = []
    for j in range(per):
        start = j * bits
        k, off = start // 32, start % 32  # not divmod: Dynamo cannot trace it
        low = min(bits, 32 - off)
        code = (words[:, k] >> off) & ((1 << low) - 1)
        if low < bits:  # the code continues in the next word
            code = code | ((words[:, k + 1] & ((1 << (bits - low)) - 1)) << low)
        cols.append(code)
    out = torch.stack(cols, dim=1).reshape(-1)
    return out.to(torch.uint8) if bits <= 8 else out


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 bit stream of the flat unsigned ``codes`` (each < 2**bits)."""
    per, nb = group(bits)
    codes = codes.reshape(-1)
    n = codes.numel()
    if bits == 8:
        return codes.to(torch.uint8)
    m = -(-n // per)
    wide = torch.int32 if bits > 8 else torch.uint8
    grid = F.pad(codes.to(wide), (0, m * per - n)).view(m, per)
    return pack_groups(grid, bits)[: packed_nbytes(n, bits)]


def pack_groups(grid: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed bytes of ``(m, L)`` codes, L = 8 / gcd(bits, 8) codes per
    group (whole groups: no padding, so a compiled kernel has no masked
    load); flat uint8, ``m * bits * L / 8`` bytes."""
    per, nb = group(bits)
    if bits == 8:
        return grid.reshape(-1).to(torch.uint8)
    if nb == 1:  # 1, 2, 4 bits: every code of the group lands in one byte (int32 shifts vectorize)
        grid = grid.to(torch.int32)
        acc = grid[:, 0]
        for j in range(1, per):
            acc = acc | (grid[:, j] << (j * bits))
        return acc.to(torch.uint8)
    cols = [acc & 0xFF for acc in byte_columns(grid.to(torch.int32), bits, nb)]
    return torch.stack(cols, dim=1).to(torch.uint8).reshape(-1)


def unpack(data: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``numel`` codes, uint8 for bits <= 8, int32
    for wider codes. ValueError when ``data`` has the wrong byte count."""
    per, nb = group(bits)
    data = data.reshape(-1)
    if data.numel() != packed_nbytes(numel, bits):
        raise ValueError(f"kit.unpack: packed buffer has {data.numel()} bytes; expected "
                         f"{packed_nbytes(numel, bits)} for {numel} codes of {bits} bits")
    if bits == 8:
        return data.clone()
    m = -(-numel // per)
    mask = (1 << bits) - 1
    if nb == 1:
        grid = data.view(m, 1)
        shifts = torch.arange(0, 8, bits, device=data.device, dtype=torch.uint8)
        return ((grid >> shifts) & mask).reshape(-1)[:numel]
    grid = F.pad(data.to(torch.int32), (0, m * nb - data.numel())).view(m, nb)
    cols = [acc & mask for acc in code_columns(grid, bits, per)]
    out = torch.stack(cols, dim=1).reshape(-1)[:numel]
    return out.to(torch.uint8) if bits <= 8 else out
