"""``adacomp``: Adaptive Residual Gradient Compression (Chen et al., AAAI
2018, "AdaComp: Adaptive Residual Gradient Compression for Data-Parallel
Distributed Training").

Per tensor (residue ``G`` keyed by ``ctx.key``), with ``dW`` the new gradient:

1. ``G <- G + dW`` (residue accumulation), ``H = G + dW`` (the latest
   gradient counts twice in the selection test: "self-adjusting").
2. The flattened tensor is cut into bins of ``L_T`` consecutive elements;
   per bin ``gmax = max |G|``.
3. Element k is sent iff ``|H_k| >= gmax`` of its bin (and ``G_k != 0``).
4. Sent values are quantized to ``sign(G_k) * scale`` with one scale per
   tensor (layer); ``G_k <- G_k - Q(G_k)`` for the sent ones.

Choices (ALGORITHMS.md marks the bin sizes unverified; the paper reports
L_T = 50 for convolutional and 500 for fully connected / LSTM layers):
``bin_size=0`` picks 50 for conv-shaped (4-D) tensors and 500 otherwise.
The per-layer scale is the mean of |G_k| over the sent elements (the
least-squares scale for fixed signs). A non-finite gradient leaves ``G``
unchanged and makes the scale NaN (the caller sees it).

Because the residue lives inside the compressor, ``default_error_feedback``
is False. The residue is updated in place (a fresh buffer only on a
tensor's first call or a non-finite gradient) and the selection runs on spans
of whole bins, so no full-size temporary besides the residue.

Extreme inputs: the scale is a mean of magnitudes computed without overflow
(:func:`gradpress.compress.numerics.mean_abs`) in the residue's dtype (fp32;
fp64 for fp64 inputs); fp64 inputs send it as the upper 32 bits of its fp64
value (fp64 range), and the residue keeps exactly what the decoder did not
get (it subtracts the transmitted scale). Decoded values beyond an fp16
output saturate at 65504 (the rest stays in the residue).

Packet: ``[scale (fp32, 1; int32 upper word for fp64 inputs), sign bits
(uint8, packed), indices (int32)]``, variable size: 4 + ceil(n/8) + 4n
bytes for n sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gradpress.compress._threshold_select import work_dtype
from gradpress.compress.base import Compressor, Context, Packet, Param, tensor_bytes
from gradpress.compress.bits import pack_bits, unpack_bits
from gradpress.compress.numerics import mean_abs, pack_scale, saturate_, unpack_scale
from gradpress.compress.registry import register
from gradpress.compress.spans import span_length
from gradpress.compress.sparse import scatter_sparse

CONV_BIN = 50
DEFAULT_BIN = 500


def auto_bin_size(shape: torch.Size) -> int:
    """L_T by layer kind: 50 for conv-shaped (4-D) tensors, 500 otherwise."""
    return CONV_BIN if len(shape) == 4 else DEFAULT_BIN


def _select(g: torch.Tensor, dw: torch.Tensor, size: int) -> torch.Tensor:
    """int64 flat indices k (increasing) with ``|g_k + dw_k| >= max |g|`` over
    k's bin and ``g_k != 0``. Spans of whole bins are processed one at a
    time, so no temporary is larger than one span."""
    d = g.numel()
    full = d // size * size
    step = max(1, span_length(g.device) // size) * size
    spans = [(a, min(a + step, full)) for a in range(0, full, step)]
    if full < d:
        spans.append((full, d))  # the short last bin
    parts = []
    for a, b in spans:
        gc = g[a:b]
        nb = -(-(b - a) // size)
        gmax = gc.abs().view(nb, -1).amax(dim=1, keepdim=True)
        hit = (gc + dw[a:b]).abs_().view(nb, -1) >= gmax
        hit.logical_and_((gc != 0).view(nb, -1))
        parts.append(torch.nonzero(hit.view(-1)).reshape(-1).add_(a))
    return torch.cat(parts)


@register
class AdaComp(Compressor):
    name = "adacomp"
    PARAMS = (
        Param("bin_size", int, 0, "0 (auto: 50 for 4-D conv tensors, 500 otherwise) or >= 1", lambda v: v >= 0, "bin length L_T"),
    )
    variable_size = True
    stateful = True
    state_dict_copies = True  # state_dict clones the residues
    element_state = ("residues",)
    summary = "AdaComp: residue accumulation, per-bin max selection, sign x per-layer scale (Chen et al. 2018)"
    own_error_memory = True
    int32_indices = True

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.residues: dict[str, torch.Tensor] = {}

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        flat = x.reshape(-1)
        d = flat.numel()
        dev = x.device
        if d == 0:
            return Packet(
                [pack_scale(torch.zeros(1, dtype=work_dtype(x.dtype), device=dev), x.dtype),
                 torch.empty(0, dtype=torch.uint8, device=dev),
                 torch.empty(0, dtype=torch.int32, device=dev)],
                x.shape, x.dtype,
            )
        dw = flat.to(work_dtype(x.dtype))
        finite = bool(torch.isfinite(dw).all())  # one host read (the selection reads one anyway)
        old = self.residues.get(ctx.key)
        if old is None or old.shape != dw.shape or old.device != dw.device:
            old = None
        if old is None:
            g = dw + 0.0  # G = 0 + dW in a fresh buffer
        elif finite and old.dtype == torch.promote_types(old.dtype, dw.dtype):
            g = old.add_(dw)  # the residue is updated in place
        else:
            g = old + dw
        size = self.bin_size or auto_bin_size(x.shape)
        idx = _select(g, dw, size)
        sent = g[idx]
        scale = mean_abs(sent)
        if not finite:
            scale = torch.full_like(scale, float("nan"))
        wire = pack_scale(scale, x.dtype)
        scale = unpack_scale(wire, x.dtype).reshape(())  # what the decoder gets
        q = torch.where(sent < 0, -scale, scale)
        if finite:
            g.index_put_((idx,), sent - q)
            self.residues[ctx.key] = g
        elif old is None:
            self.residues[ctx.key] = torch.zeros_like(g)
        signs = pack_bits((sent < 0).to(torch.uint8), 1)
        return Packet([wire, signs, idx.to(torch.int32)], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        scale, signs, idx = packet.tensors
        n = idx.numel()
        neg = unpack_bits(signs, 1, n).to(torch.bool)
        s = unpack_scale(scale, packet.dtype).reshape(())
        values = saturate_(torch.where(neg, -s, s), packet.dtype)
        return scatter_sparse(values, idx, packet.shape, packet.dtype)

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Payload for one element sent per bin (a first call's typical size
        is about that: the bin maximum passes the test)."""
        size = self.bin_size or DEFAULT_BIN
        n = -(-numel // size) if numel else 0
        return 4 + (n + 7) // 8 + 4 * n

    def gradient_state(self) -> list[torch.Tensor]:
        return list(self.residues.values())

    def state_nbytes(self) -> int:
        return tensor_bytes(self.residues)

    def state_dict(self) -> dict[str, Any]:
        return {"residues": {k: v.clone() for k, v in self.residues.items()}}

    def live_state(self) -> dict[str, Any]:
        return {"residues": dict(self.residues)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.residues = {k: v.clone() for k, v in state.get("residues", {}).items()}
