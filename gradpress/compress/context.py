"""The call context a compressor's ``encode`` receives (:class:`Context`) and
the seeds derived from it (:func:`derive_seed`).

Invariant: every rank derives the same ``shared_seed`` for the same (run
seed, step, key), whatever the loss scale, which enters no seed.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from typing import Any

__all__ = ["Context", "derive_seed"]


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from ``parts`` (run seed, step, tensor key, ...).

    Uses BLAKE2b over a canonical text form, never Python's ``hash()`` (which
    is salted per process), so every rank derives the same value.
    """
    text = "\x1f".join(str(p) for p in parts).encode()
    digest = hashlib.blake2b(text, digest_size=8).digest()
    return struct.unpack("<Q", digest)[0] & ((1 << 63) - 1)


@dataclass(frozen=True)
class Context:
    """What a compressor may know about the call besides the tensor.

    ``key`` names the tensor (stable across steps: parameter name), ``step``
    is the synchronous step all ranks agree on (the exchange engine's: the
    caller's step less the steps it dropped, ``nonfinite='skip'`` or an
    overflow under a loss scaler, which do not count), ``rank``/``world_size`` the
    caller's place among the compressing units whose packets are aggregated
    (every worker of a flat strategy; under ``hierarchical`` the H host
    leaders, ``rank`` the host's index). ``unit_workers`` is how many
    workers' gradients the encoded tensor is the mean of: L (the workers per
    host) at a hierarchical leader, which encodes its host's mean, 1
    elsewhere; ``world_size * unit_workers`` is the number of workers. A
    constant defined per worker's gradient (DGC's local clip) takes both.
    ``shared_seed`` is equal on every rank (shared randomness:
    random-k indices, PowerSGD init); ``private_seed`` differs per rank
    (independent stochastic rounding, so averaging reduces variance).
    ``loss_scale`` is the scale the tensor carries: the DDP hook following a
    loss scaler (``register(..., scaler=)``) sets the step's scale, 1
    otherwise; a constant in gradient units (``threshold``'s ``tau``, DGC's
    ``clip``) is multiplied by it, so that it applies to the unscaled
    gradient. It enters no seed: the random stream is the same whatever the
    scale. ``loss_scaler`` is True while such a hook follows a loss scaler
    (whatever the scale, 1 included): an overflow must then surface as Inf,
    so that the scaler skips the step and lowers the scale, as in plain fp16
    AMP; a codec that otherwise saturates at its wire format's maximum
    (``fp16``, ``bf16``: the cast and the bounded summands of a 16-bit sum)
    lets it overflow instead.
    """

    key: str = ""
    step: int = 0
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    loss_scale: float = 1.0
    loss_scaler: bool = False
    unit_workers: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.loss_scale, bool) or not isinstance(self.loss_scale, (int, float)) \
                or not math.isfinite(self.loss_scale) or self.loss_scale <= 0:
            raise ValueError(f"Context: loss_scale must be a finite number > 0, got {self.loss_scale!r}")
        if not isinstance(self.loss_scaler, bool):
            raise ValueError(f"Context: loss_scaler must be a bool (True: a loss scaler is attached, overflows "
                             f"surface as Inf), got {self.loss_scaler!r}")
        if isinstance(self.unit_workers, bool) or not isinstance(self.unit_workers, int) or self.unit_workers < 1:
            raise ValueError(f"Context: unit_workers must be an integer >= 1 (the workers whose mean the tensor "
                             f"is: L at a hierarchical leader, else 1), got {self.unit_workers!r}")

    @property
    def shared_seed(self) -> int:
        return derive_seed("shared", self.seed, self.step, self.key)

    @property
    def private_seed(self) -> int:
        return derive_seed("private", self.seed, self.step, self.key, self.rank)
