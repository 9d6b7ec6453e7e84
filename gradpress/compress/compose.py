"""Composition ``first>second``: the second (a stateless, fixed-size
quantizer) compresses the floating values the first one keeps.

Used for top-k followed by an unbiased quantizer (Beznosikov et al., "On
Biased Compression for Distributed Learning", 2020): ``topk:ratio=0.01>natural``.

Invariant: the first stage's packet starts with its values
(``values_index == 0``) and the first stage can tell how many values a packet
holds from its other payload tensors, shape and metadata
(``values_count``: by default one index per value); the second stage's
payload replaces ``values``. Metadata (never sent) is carried through.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from gradpress.compress.base import Compressor, Context, Packet


class Composed(Compressor):
    name = "compose"

    def __init__(self, first: Compressor, second: Compressor) -> None:
        if isinstance(first, Composed):
            raise ValueError(
                f"compressor spec {first.spec() + '>' + second.spec()!r} has more than two stages; "
                "allowed: 'sparsifier>quantizer' (e.g. topk:ratio=0.01>natural)"
            )
        if first.values_index != 0:
            raise ValueError(
                f"compressor {first.name!r} keeps no separate values that a second stage could "
                "quantize; the first stage of 'a>b' must be a sparsifier (topk, randomk, threshold, ...)"
            )
        if second.stateful or second.variable_size or second.identity or second.values_index is not None:
            raise ValueError(
                f"compressor {second.name!r} cannot be a second stage: it must be a stateless, "
                "fixed-size quantizer (natural, qsgd, fp16, terngrad, ...)"
            )
        super().__init__()
        self.first = first
        self.second = second
        probe = second.encode(torch.ones(4), Context(key="__probe__"))
        self._second_tensors = len(probe.tensors)

    @property
    def is_unbiased(self) -> bool:
        return self.first.is_unbiased and self.second.is_unbiased

    @property
    def is_summable(self) -> bool:
        return False

    @property
    def default_error_feedback(self) -> bool:
        return self.first.default_error_feedback or self.second.default_error_feedback

    @property
    def own_error_memory(self) -> bool:  # type: ignore[override]
        return self.first.own_error_memory

    @property
    def variable_size(self) -> bool:  # type: ignore[override]
        return self.first.variable_size

    @property
    def stateful(self) -> bool:  # type: ignore[override]
        return self.first.stateful

    @property
    def state_dict_copies(self) -> bool:  # type: ignore[override]
        return self.first.state_dict_copies

    @property
    def scale_degree(self) -> int | None:  # type: ignore[override]
        """The second stage quantizes the first's values: degrees multiply (a scale-free selection of values
        hands the second stage the same values whatever the scale); None when either stage has none."""
        first, second = self.first.scale_degree, self.second.scale_degree
        return None if first is None or second is None else first * second

    @property
    def element_state(self) -> tuple[str, ...]:  # type: ignore[override]
        return self.first.element_state  # its state_dict is the first stage's

    @property
    def matrix_state(self) -> tuple[str, ...]:  # type: ignore[override]
        return self.first.matrix_state

    def config(self) -> dict[str, Any]:
        return {"first": self.first.spec(), "second": self.second.spec()}

    def spec(self) -> str:
        return f"{self.first.spec()}>{self.second.spec()}"

    def _check_input(self, x: torch.Tensor) -> None:
        self.first._check_input(x)  # errors name the stage that takes x

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        outer = self.first.encode(x, ctx)
        values, rest = outer.tensors[0], outer.tensors[1:]
        inner_ctx = dataclasses.replace(ctx, key=ctx.key + "/values")
        inner = self.second.encode(values, inner_ctx)
        return Packet(inner.tensors + rest, outer.shape, outer.dtype, dict(outer.meta))

    def decode(self, packet: Packet) -> torch.Tensor:
        inner_tensors = packet.tensors[: self._second_tensors]
        rest = packet.tensors[self._second_tensors :]
        count = self.first.values_count(rest, packet.shape, packet.meta)
        values = self.second.decode(Packet(inner_tensors, torch.Size([count]), self.first.values_dtype(packet.dtype)))
        return self.first.decode(Packet([values] + rest, packet.shape, packet.dtype, dict(packet.meta)))

    def gradient_state(self) -> list[torch.Tensor]:
        return self.first.gradient_state()  # the second stage keeps no state (checked at construction)

    def state_nbytes(self) -> int:
        return self.first.state_nbytes()

    def state_dict(self) -> dict[str, Any]:
        return self.first.state_dict()

    def state_shape(self, entry: str, shape: torch.Size) -> tuple[int, ...] | None:
        return self.first.state_shape(entry, shape)

    def live_state(self) -> dict[str, Any] | None:
        return self.first.live_state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.first.load_state_dict(state)
