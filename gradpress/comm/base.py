"""The strategy contract, the registry, and the shared aggregation rule."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from gradpress.compress.base import Compressor, Packet

__all__ = ["Strategy", "ExchangeResult", "register_strategy", "get_strategy", "available", "aggregate"]


class ExchangeResult:
    """Averaged tensors (in input order) and the bytes this rank handed to
    collectives for them."""

    def __init__(self, tensors: list[torch.Tensor], bytes_sent: int) -> None:
        self.tensors = tensors
        self.bytes_sent = bytes_sent


class Strategy:
    """Moves the packets of one bucket between ranks.

    ``exchange`` is called with this rank's packets (already encoded; for
    ``prescaled`` strategies from ``x / world_size``) and returns the average
    over ranks, decoded, identical on every rank.
    """

    name: str = ""
    #: encode x / world_size instead of x (summable allreduce of sums)
    prescaled: bool = False

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0

    def supports(self, compressor: Compressor) -> str | None:
        """None if usable with ``compressor``, else the reason it is not."""
        return None

    def exchange(self, compressor: Compressor, packets: list[Packet]) -> ExchangeResult:
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
    _load()
    return sorted(["auto", *_STRATEGIES])


def get_strategy(name: str, group: dist.ProcessGroup | None) -> Strategy:
    _load()
    if name not in _STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; allowed: {', '.join(available())}")
    return _STRATEGIES[name](group)
