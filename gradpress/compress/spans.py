"""Working through a large tensor span by span, so that temporaries stay a
small multiple of one span instead of the whole tensor (used by dithering,
rangefloat, adacomp, redsync)."""

from __future__ import annotations

import torch

__all__ = ["chunk_spans", "span_length"]


def span_length(device: torch.device) -> int:
    """Entries per span of :func:`chunk_spans` (a multiple of 8)."""
    return (1 << 16) if device.type == "cpu" else (1 << 24)


def chunk_spans(d: int, device: torch.device) -> list[tuple[int, int]]:
    """``[start, stop)`` spans covering ``range(d)``; every span but the last
    holds a multiple of 8 entries, so packed codes of any width start on a
    byte. Working span by span bounds the temporaries of a pass to one span
    (CPU: 2^16 entries, cache sized; accelerators: 2^24)."""
    step = span_length(device)
    return [(a, min(a + step, d)) for a in range(0, d, step)]
