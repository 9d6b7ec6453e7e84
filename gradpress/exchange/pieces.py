"""Cutting a call's tensors into pieces, for exchanges pipelined piece by piece.

A slow link is idle while a rank encodes, decodes or moves data over a fast
one, and the CPU is idle while the slow link carries bytes. Cutting the
call into pieces and exchanging each on its own lane (a thread with its own
process group, :class:`~gradpress.exchange.background.Background`) lets piece
``i`` travel while piece ``i + 1`` is encoded and piece ``i - 1`` decoded,
as pipelined collectives do (Horovod's tensor fusion cycles, BytePS's
partitioning of large tensors: Jiang et al., OSDI 2020, section 5).

A piece is a block of whole rows of one tensor (the tensor seen as
``(shape[0], -1)``; a 1-D tensor's rows are its elements), so a compressor
still sees a matrix of the tensor's row length: per-piece statistics
(QSGD's bucket norms stay the same when a row is a multiple of the bucket,
top-k keeps ``ratio`` of each piece). A tensor no larger than the piece size
is one piece and keeps its own context (its encoding is unchanged);
otherwise piece ``j`` has the context key ``"<key>#<j>"``, the same on every
rank, so shared randomness stays shared.

Invariant: the pieces of a tensor are contiguous, disjoint and cover it in
order; their flat offsets index the call's concatenation of its tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from gradpress.compress.base import Context
from gradpress.exchange.keys import part_key

__all__ = ["Piece", "cut", "piece_context"]


@dataclass(frozen=True)
class Piece:
    """Rows ``[row0, row1)`` of tensor ``tensor`` (``parts`` pieces in all for
    that tensor, this one number ``part``), at ``offset`` in the call's flat
    concatenation, ``numel`` entries."""

    tensor: int
    part: int
    parts: int
    row0: int
    row1: int
    offset: int
    numel: int

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This piece of ``t`` (a view, shaped ``(rows, row length)``, or ``t``
        itself when the tensor is one piece)."""
        if self.parts == 1:
            return t
        return t.reshape(t.shape[0], -1)[self.row0 : self.row1] if t.dim() > 1 else t[self.row0 : self.row1]


def cut(tensors: list[torch.Tensor], chunk: int) -> list[Piece]:
    """The pieces of ``tensors`` (in order) of at most ``chunk`` entries each,
    or a whole row where one row is larger; ``chunk <= 0``: one piece per
    tensor."""
    pieces: list[Piece] = []
    offset = 0
    for i, t in enumerate(tensors):
        n = t.numel()
        rows = t.shape[0] if t.dim() > 0 else 1
        row_len = n // rows if rows else 0
        if chunk <= 0 or n <= chunk or rows <= 1 or row_len == 0:
            pieces.append(Piece(i, 0, 1, 0, rows, offset, n))
        else:
            per = max(1, chunk // row_len)
            starts = list(range(0, rows, per))
            for j, r0 in enumerate(starts):
                r1 = min(rows, r0 + per)
                pieces.append(Piece(i, j, len(starts), r0, r1, offset + r0 * row_len, (r1 - r0) * row_len))
        offset += n
    return pieces


def piece_context(ctx: Context, piece: Piece) -> Context:
    """``ctx`` for a tensor that is one piece; else ``ctx`` keyed ``"<key>#<part>"``."""
    return ctx if piece.parts == 1 else dataclasses.replace(ctx, key=part_key(ctx.key, piece.part))
