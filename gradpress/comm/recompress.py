"""What the re-compressing strategies (ring, ps) share.

* :class:`Recompressor`: encode a sum on its way (a PS root) with a residual
  of its own, keyed by the tensor's key, so what the re-compression drops
  comes back next step (HiPress CaSync). The ring keeps per-position
  residuals itself (see :mod:`gradpress.comm.ring`).
  The residual lives in a :class:`~gradpress.feedback.ResidualMemory`, so a
  non-finite sum never poisons it.
* :func:`template`: a packet of the right payload dtypes and (for fixed-size
  compressors) element counts for a tensor of a given shape, made once per
  (compressor, shape, dtype) by encoding zeros; it tells
  :func:`gradpress.wire.unpack_packets` how to read a buffer from another
  rank. Non-summable compressors must decode without ``packet.meta`` (true of
  every compressor that keeps meta today: only random-k, which is summable,
  and summable packets are read with this rank's own packet as template).
* :func:`densified`: the PS root's compressor for sparse methods, at density
  ``ratio * N`` capped at 1 (the sum of N sparse packets has up to N k
  non-zeros; re-sparsifying it to k would drop most of what the workers sent).
"""

from __future__ import annotations

import copy

import torch

from gradpress.compress.base import Compressor, Context, Packet
from gradpress.feedback import ResidualMemory

__all__ = ["Recompressor", "template", "densified"]

_PROBE_KEY = "__gradpress_template__"


class Recompressor:
    """Encode partial sums with a residual per key (when ``feedback``)."""

    def __init__(self) -> None:
        self.memory = ResidualMemory()

    def encode(self, compressor: Compressor, x: torch.Tensor, ctx: Context, feedback: bool) -> tuple[Packet, torch.Tensor]:
        """``(packet, decoded packet)`` for ``x`` (+ the residual of ``ctx.key``)."""
        if not feedback:
            pk = compressor.encode(x, ctx)
            return pk, compressor.decode(pk)
        p = self.memory.compensate(ctx.key, x)
        pk = compressor.encode(p, ctx)
        est = compressor.decode(pk)
        self.memory.update(ctx.key, p, est)
        return pk, est

    def state_dict(self) -> dict:
        return self.memory.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.memory.load_state_dict(state)


_TEMPLATES: dict[tuple[int, str, tuple[int, ...], torch.dtype, str], Packet] = {}


def template(compressor: Compressor, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Packet:
    """A packet shaped like ``compressor``'s packet for a tensor of ``shape``."""
    key = (id(compressor), compressor.spec(), tuple(shape), dtype, str(device))
    pk = _TEMPLATES.get(key)
    if pk is None:
        x = torch.zeros(tuple(shape), dtype=dtype, device=device)
        # a stateful compressor is probed on a copy: its state stays as it was
        probe = copy.deepcopy(compressor) if compressor.stateful else compressor
        pk = probe.encode(x, Context(key=f"{_PROBE_KEY}{tuple(shape)}"))
        if len(_TEMPLATES) > 4096:
            _TEMPLATES.clear()
        _TEMPLATES[key] = pk
    return pk


def densified(compressor: Compressor, factor: int) -> Compressor:
    """``compressor`` with its density (``ratio``) multiplied by ``factor``
    and capped at 1; compositions densify their first stage; compressors
    without a ``ratio`` are returned unchanged."""
    first = getattr(compressor, "first", None)
    if isinstance(first, Compressor):
        out = copy.copy(compressor)
        out.first = densified(first, factor)  # type: ignore[attr-defined]
        return out
    ratio = getattr(compressor, "ratio", None)
    if isinstance(ratio, float) and factor > 1:
        out = copy.copy(compressor)
        out.ratio = min(1.0, ratio * factor)  # type: ignore[attr-defined]
        return out
    return compressor
