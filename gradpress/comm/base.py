"""The strategy contract, the registry, and the shared aggregation rule."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from gradpress.compress.base import Compressor, Context, Packet

__all__ = ["Strategy", "ExchangeResult", "encode_local", "register_strategy", "get_strategy", "available", "aggregate"]


class ExchangeResult:
    """What one exchange produced.

    ``tensors``: the average over ranks, in input order, bit-identical on
    every rank. ``bytes_sent``: bytes this rank handed to collectives.
    ``estimates``: per input, what this rank's contribution was taken to be
    (``decode(encode(p))``), from which error feedback keeps ``p - estimate``;
    None when not asked for. ``tensor_bytes``: payload bytes per input.
    ``compress_s``: seconds the strategy spent encoding and decoding.
    ``residuals``: per input, ``p - estimate`` directly (cheaper than
    ``estimates`` for sparsifiers); a strategy returns one or the other.
    """

    def __init__(
        self,
        tensors: list[torch.Tensor],
        bytes_sent: int,
        estimates: list[torch.Tensor] | None = None,
        tensor_bytes: list[int] | None = None,
        compress_s: float = 0.0,
        residuals: list[torch.Tensor] | None = None,
    ) -> None:
        self.residuals = residuals
        self.compress_s = compress_s
        self.tensors = tensors
        self.bytes_sent = bytes_sent
        self.estimates = estimates
        self.tensor_bytes = tensor_bytes or [0] * len(tensors)


def encode_local(
    compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context], scale: float, want_residuals: bool
) -> tuple[list[Packet], list[torch.Tensor] | None]:
    """Encode ``scale * t`` for each tensor; with ``want_residuals`` also
    return ``t - decode(packet) / scale`` (what error feedback keeps),
    computed by ``Compressor.residual`` (which may reuse ``t``'s storage:
    the tensors must be the caller's own, not gradient views)."""
    packets = []
    residuals: list[torch.Tensor] | None = [] if want_residuals else None
    for t, c in zip(tensors, ctxs):
        x = t * scale if scale != 1.0 else t
        packet = compressor.encode(x, c)
        packets.append(packet)
        if residuals is not None:
            r = compressor.residual(x, packet)
            residuals.append(r.div_(scale) if scale != 1.0 else r)
    return packets, residuals


class Strategy:
    """Moves one bucket's tensors between ranks, compressed.

    ``exchange`` receives this rank's error-compensated tensors and their
    contexts, encodes them (a strategy may re-compress on the way: ring, ps),
    and returns the decoded average, identical on every rank.
    """

    name: str = ""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0

    def supports(self, compressor: Compressor) -> str | None:
        """None if usable with ``compressor``, else the reason it is not."""
        return None

    def exchange(
        self, compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context], want_feedback: bool
    ) -> ExchangeResult:
        """``want_feedback``: error feedback is on, so return ``residuals`` (or
        ``estimates``) for the hook; the tensors are then the hook's own and
        may be reused in place."""
        raise NotImplementedError


def aggregate(compressor: Compressor, decoded_by_rank: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """Fold the ranks' decoded tensors in rank order (fixed order: every rank
    computes bit-identical results). ``mean`` averages, ``majority`` takes the
    sign of the sum (signSGD's majority vote)."""
    total = decoded_by_rank[0].clone()
    for t in decoded_by_rank[1:]:
        total += t
    if compressor.aggregation == "majority":
        return torch.sign(total)
    return total.div_(world_size)


_STRATEGIES: dict[str, Callable[[dist.ProcessGroup | None], Strategy]] = {}


def register_strategy(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    def deco(cls: type[Strategy]) -> type[Strategy]:
        cls.name = name
        _STRATEGIES[name] = cls
        return cls

    return deco


def _load() -> None:
    import importlib
    import pkgutil

    import gradpress.comm as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name != "base":
            importlib.import_module(f"gradpress.comm.{mod.name}")


def available() -> list[str]:
    """Every strategy name ``register`` accepts: the transports plus ``auto``
    (the planner) and ``collective`` (allreduce if summable, else allgather)."""
    _load()
    return sorted({"auto", "collective", *_STRATEGIES})


def get_strategy(name: str, group: dist.ProcessGroup | None) -> Strategy:
    _load()
    if name not in _STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; allowed: {', '.join(sorted(_STRATEGIES))}")
    return _STRATEGIES[name](group)
