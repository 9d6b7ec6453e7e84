"""The compressor authoring kit (the CompLL half of HiPress: Bai et al.,
SOSP 2021, "Gradient Compression Supercharged High-Performance Data
Parallel DNN Training").

A method author declares a compressor as a :class:`KitCompressor` subclass:
typed ``PARAMS``, the packet's ``FIELDS``, whether it draws random numbers,
and an ``encode_fields``/``decode_fields`` pair written with the primitives
below. The kit derives the wire layout and exact byte count, the random
stream, and a fused implementation of the element-wise kernels through
``torch.compile`` (eager fallback; ``GRADPRESS_COMPILE``), see
docs/authoring.md.

This package is a library of the ``compress`` layer, like ``bits.py`` or
``sparse.py``: compressor files import it, it imports no compressor.
"""

from __future__ import annotations

import torch

from gradpress.compress.bits import byte_table
from gradpress.compress.kit import compiler, streams
from gradpress.compress.kit.declare import KitCompressor
from gradpress.compress.kit.layout import Field, FieldSize
from gradpress.compress.kit.packing import packed_nbytes
from gradpress.compress.kit.primitives import (
    chunks,
    elementwise,
    extremes,
    gather,
    pack_rows,
    pack_signs,
    random_bits,
    reduce,
    scatter,
    select_mask,
    select_topk,
    std,
    uniform,
    unpack_table,
)
from gradpress.compress.kit.rng import counter_bits, counter_uniform, seed_words
from gradpress.compress.numerics import pack_scale, unpack_scale

__all__ = [
    "Field", "FieldSize", "KitCompressor", "byte_table", "chunks", "compiler", "counter_bits", "counter_uniform",
    "elementwise", "extremes", "gather", "pack", "pack_rows", "pack_scale", "pack_signs", "packed_nbytes", "random_bits", "reduce",
    "scatter", "seed_words", "select_mask", "select_topk", "std", "uniform", "unpack", "unpack_scale", "unpack_table",
]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``codes`` of ``bits`` bits (1..24) LSB-first into uint8,
    ``ceil(n * bits / 8)`` bytes: word-wide and compiled where the policy
    compiles, else the eager kernels of :mod:`gradpress.compress.bits`
    (:mod:`gradpress.compress.kit.streams`); inside a kernel,
    :func:`pack_rows` fuses packing into the kernel instead."""
    return streams.pack(codes, bits)


def unpack(data: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack` (uint8 codes for bits <= 8, int32 wider)."""
    return streams.unpack(data, bits, numel)
