"""The encoded form of one tensor (:class:`Packet`) and the buffer check of
``Compressor.decode_into``; re-exported by :mod:`gradpress.compress.base`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Packet", "check_decode_out"]


@dataclass
class Packet:
    """Encoded form of one tensor.

    ``tensors`` are the payload, in a fixed order, each 1-D and contiguous;
    they are what goes on the wire. ``shape``/``dtype`` are known to every
    rank and are not sent. ``meta`` holds extra per-call facts that every rank
    can recompute (for example PowerSGD's matrix view) and is never sent.
    """

    tensors: list[torch.Tensor]
    shape: torch.Size
    dtype: torch.dtype
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Exact number of payload bytes on the wire."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def aliases(self, t: torch.Tensor) -> bool:
        """Whether a payload tensor lives in ``t``'s storage (``none``'s
        payload is its input, as is fp16's for an fp16 input and bf16's for
        a bf16 one): writing into ``t`` would change the packet. Storages are
        compared, so two tensors over the same memory through different
        storages (``from_blob``, NumPy) are not caught."""
        ptr = t.untyped_storage().data_ptr()
        return any(p.untyped_storage().data_ptr() == ptr for p in self.tensors)


def check_decode_out(packet: Packet, out: torch.Tensor) -> None:
    """Raise ValueError unless ``out`` can take ``packet``'s decoded tensor:
    contiguous, ``packet.numel`` entries of ``packet.dtype``."""
    if out.numel() != packet.numel or out.dtype != packet.dtype or not out.is_contiguous():
        raise ValueError(f"decode_into: out is {tuple(out.shape)} x {out.dtype}"
                         f"{'' if out.is_contiguous() else ' (not contiguous)'}; allowed: a contiguous tensor of "
                         f"{packet.numel} entries of {packet.dtype} (the packet's)")
