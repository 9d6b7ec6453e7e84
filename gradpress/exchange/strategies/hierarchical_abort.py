"""A failed leader's abort marker for :mod:`~gradpress.exchange.strategies.hierarchical`.

When a leader's part of a call raises (its compressor's encode, the
leaders' exchange, a decode), its host's workers are already waiting in
the host broadcast. The leader still broadcasts, with every buffer it had
not broadcast yet filled with a *signaling NaN* of a fixed payload, then
re-raises its own error; each worker reads one entry of the last buffer and
raises an error naming its leader. No collective is added to a healthy
call: the marker travels in place of the data.

No average can be the marker: averages come out of arithmetic (division,
decoding, summation), and IEEE 754 arithmetic never returns a signaling
NaN (it quiets one it is given), while a broadcast copies bits unchanged.
Floating dtypes only (the only ones compressed); another dtype falls back
to its all-ones bit pattern.
"""

from __future__ import annotations

import torch

__all__ = ["mark_failed", "is_marked", "leader_failed"]

#: per dtype: (integer view, bit pattern of a signaling NaN: exponent all ones, quiet bit clear, payload 0x5A..)
_MARKS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float16: (torch.int16, 0x7D5A),
    torch.bfloat16: (torch.int16, 0x7F9A),
    torch.float32: (torch.int32, 0x7FA5A5A5),
    torch.float64: (torch.int64, 0x7FF5A5A5A5A5A5A5),
}
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(buffer: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``buffer`` viewed as integers (flat), and the marker's value there."""
    flat = buffer.reshape(-1)
    if buffer.dtype in _MARKS:
        view, pattern = _MARKS[buffer.dtype]
        return flat.view(view), pattern
    return flat.view(_INTS[buffer.element_size()]), (0xFF if buffer.element_size() == 1 else -1)


def mark_failed(buffer: torch.Tensor) -> None:
    """Fill ``buffer`` (contiguous) with the marker, in place."""
    if buffer.numel():
        ints, pattern = _bits(buffer)
        ints.fill_(pattern)


def is_marked(buffer: torch.Tensor) -> bool:
    """Whether ``buffer`` (contiguous) came from a leader that failed: its
    first entry is the marker (one read; a host sync on an accelerator)."""
    if not buffer.numel():
        return False
    ints, pattern = _bits(buffer)
    return int(ints[0]) == pattern


def leader_failed(leader: int, host: int, key: str, step: int, count: int) -> RuntimeError:
    """The error a worker raises when its leader's broadcast is the marker."""
    others = f" and {count - 1} other tensor(s) of this call" if count > 1 else ""
    return RuntimeError(
        f"strategy 'hierarchical': the leader of host {host}, rank {leader}, failed in the exchange between hosts "
        f"of {key!r}{others} at step {step} and broadcast an abort marker instead of the average; its own error "
        "(raised on that rank) says why")
