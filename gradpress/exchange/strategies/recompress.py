"""What the re-compressing strategies (ring, ps) share.

* :func:`recompress`: encode a partial sum on its way (a ring hop, a PS
  root) with a residual of its own kept in the engine's feedback store under
  the strategy's namespace, so what the re-compression drops comes back next
  step (HiPress CaSync; Comprex).
* :func:`template`: a packet of the right payload dtypes and (for fixed-size
  compressors) element counts for a tensor of a given shape, made once per
  (compressor spec, shape, dtype, device) by encoding zeros; it tells
  :func:`gradpress.transport.wire.unpack_packets` how to read a buffer from
  another rank. Non-summable compressors must decode without ``packet.meta``
  (the strategies refuse those that need it: see :func:`unsupported_reason`).
* :func:`densified`: the PS root's compressor for sparse methods, at density
  ``ratio * N`` capped at 1 (the sum of N sparse packets has up to N k
  non-zeros; re-sparsifying it to k would drop most of what the workers sent).
"""

from __future__ import annotations

import copy

import torch

from gradpress.compress.base import Compressor, Context, Packet
from gradpress.exchange.feedback import Feedback

__all__ = ["recompress", "template", "densified", "unsupported_reason"]

_PROBE_KEY = "__gradpress_template__"


def recompress(
    compressor: Compressor, x: torch.Tensor, ctx: Context, feedback: Feedback | None, store_key: str
) -> tuple[Packet, torch.Tensor]:
    """``(packet, decoded packet)`` for ``x`` plus the residual kept under
    ``store_key``; the new residual is staged in ``feedback`` (None: no
    residual anywhere, unbiased compressors stay unbiased hop by hop)."""
    if feedback is None:
        pk = compressor.encode(x, ctx)
        return pk, compressor.decode(pk)
    p = feedback.compensate(store_key, x)
    pk = compressor.encode(p, ctx)
    est = compressor.decode(pk)
    feedback.stage(store_key, p - est.to(p.dtype))
    return pk, est


_TEMPLATES: dict[tuple[type, str, tuple[int, ...], torch.dtype, str], Packet] = {}


def template(compressor: Compressor, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Packet:
    """A packet shaped like ``compressor``'s packet for a tensor of ``shape``
    (cached by the compressor's spec, never by object identity)."""
    key = (type(compressor), compressor.spec(), tuple(shape), dtype, str(device))
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


def unsupported_reason(compressor: Compressor, strategy: str) -> str | None:
    """Why a re-compressing strategy cannot carry ``compressor``, or None."""
    if compressor.rounds > 1:
        return f"compressor {compressor.name!r} runs its own multi-round allreduce protocol; use strategy 'allreduce'"
    if compressor.aggregation != "mean":
        return (
            f"compressor {compressor.name!r} aggregates by {compressor.aggregation} vote, which needs every "
            f"rank's packet; strategy {strategy!r} re-compresses partial sums; use 'allgather'"
        )
    if compressor.own_error_memory:
        # DGC, AdaComp: momentum/residue inside the compressor would be applied again to partial sums
        return (
            f"compressor {compressor.spec()!r} keeps its own error memory, which must not be applied again "
            f"to the partial sums strategy {strategy!r} re-compresses; use 'allgather'"
        )
    if not compressor.is_summable and _decode_needs_meta(compressor):
        # a receiver rebuilds packets of partial sums from a template: shared-seed facts
        # (random-k's indices) of the real call would be lost
        return (
            f"compressor {compressor.spec()!r} decodes with facts derived per call (shared-seed indices), "
            f"which strategy {strategy!r} cannot carry for re-compressed partial sums; use 'allgather'"
        )
    return None


def _decode_needs_meta(compressor: Compressor) -> bool:
    """Whether ``compressor``'s packets carry metadata that decode needs."""
    probe = copy.deepcopy(compressor) if compressor.stateful else compressor
    return bool(probe.encode(torch.ones(8), Context(key="__gradpress_meta_probe__")).meta)
