"""``signum``: the sign of a local momentum buffer, majority vote.

Bernstein et al. 2018, "signSGD: Compressed Optimisation for Non-Convex
Problems" (Signum). Per tensor key, m <- beta * m + (1 - beta) * g (m starts
at zero; beta = ``momentum``), then the sign of m is sent as in ``signsgd``
(1 bit, sign(0) = +1) and aggregated by majority vote. Error feedback is off
by default. A non-finite gradient leaves the momentum buffer unchanged (it is
still sent, as +1/-1 bits, like ``signsgd`` would send it).

State: one buffer per ``ctx.key`` (fp32, fp64 for fp64 inputs), in
``state_dict()["momentum"]``. The same key with a different number of entries
raises ``ValueError``. Packet and wire size as ``signsgd``: ceil(d/8) bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gradpress.compress.base import Compressor, Context, Packet, Param, tensor_bytes
from gradpress.compress.numerics import compute_dtype
from gradpress.compress.registry import register
from gradpress.compress.signs import decode_signs, pack_signs


@register
class Signum(Compressor):
    name = "signum"
    PARAMS = (Param("momentum", float, 0.9, "0 <= momentum < 1", lambda v: 0 <= v < 1, "momentum coefficient beta"),)
    stateful = True
    state_dict_copies = True  # state_dict clones the momentum
    element_state = ("momentum",)
    aggregation = "majority"
    scale_degree = 0  # +-1 whatever the scale of x (the momentum itself is in x's units: gradient_state)
    summary = "Signum: sign of local momentum, 1 bit, majority vote (Bernstein et al. 2018)"

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.buffers: dict[str, torch.Tensor] = {}

    @property
    def default_error_feedback(self) -> bool:
        return False

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        g = x.reshape(-1).to(compute_dtype(x.dtype))
        old = self.buffers.get(ctx.key)
        if old is None:
            old = torch.zeros_like(g)
        elif old.numel() != g.numel():
            raise ValueError(
                f"compressor 'signum': key {ctx.key!r} has a momentum buffer of {old.numel()} entries "
                f"but got a tensor of {g.numel()}; give each tensor its own ctx.key"
            )
        old = old.to(device=g.device, dtype=g.dtype)
        if bool(torch.isfinite(g).all()):  # update the buffer in place (no new full-size tensors)
            new = old.mul_(self.momentum).add_(g, alpha=1.0 - self.momentum)
            self.buffers[ctx.key] = new
        else:  # keep the buffer, send the sign of the (non-finite) update
            new = old * self.momentum + g * (1.0 - self.momentum)
            self.buffers[ctx.key] = old
        return Packet([pack_signs(new)], x.shape, x.dtype)

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """ceil(d/8), computed without touching the momentum buffers."""
        return (numel + 7) // 8

    def decode(self, packet: Packet) -> torch.Tensor:
        return decode_signs(packet)

    def decode_into(self, packet: Packet, out: torch.Tensor) -> torch.Tensor:
        return decode_signs(packet, out)

    def gradient_state(self) -> list[torch.Tensor]:
        return list(self.buffers.values())

    def state_nbytes(self) -> int:
        return tensor_bytes(self.buffers)

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": {k: v.clone() for k, v in self.buffers.items()}}

    def live_state(self) -> dict[str, Any]:
        return {"momentum": dict(self.buffers)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        extra = sorted(set(state) - {"momentum"})
        if extra:
            raise ValueError(f"compressor 'signum': unknown state entries {extra}; allowed: momentum")
        self.buffers = {k: v.clone() for k, v in state.get("momentum", {}).items()}
