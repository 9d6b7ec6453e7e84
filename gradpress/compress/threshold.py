"""``threshold``: keep every entry with |x| > tau.

Strom 2015 ("Scalable distributed DNN training using commodity GPU cloud
computing"); Dryden et al. 2016. The number of kept entries depends on the
data (``variable_size``): the wire carries a header of element counts.
Biased, so error feedback is on by default. NaN entries are never kept
(|NaN| > tau is false).

``tau`` is in gradient units: the entries kept are those with
|x| > tau * ``ctx.loss_scale``, the scale the DDP hook following a loss
scaler (``register(..., scaler=)``) puts in the Context (1 otherwise), so
under fp16 loss scaling it keeps |g| > tau of the unscaled gradient g, and
the method is homogeneous (``scale_degree = 1``).

Packet: ``[values (input dtype), indices (int32)]``, ``values_index = 0``;
(element size + 4) bytes per kept entry. Invariant: exactly the entries with
|x| > tau * ctx.loss_scale are kept, in increasing index order.
"""

from __future__ import annotations

import torch

from gradpress.compress.base import Compressor, Context, Packet, Param
from gradpress.compress.registry import register
from gradpress.compress.sparse import scatter_sparse


@register
class Threshold(Compressor):
    name = "threshold"
    PARAMS = (Param("tau", float, 1e-3, "tau >= 0", lambda v: v >= 0, "keep entries with |x| > tau"),)
    variable_size = True
    values_index = 0
    exact_values = True
    int32_indices = True
    scale_degree = 1  # tau is in gradient units: compared with |x| / ctx.loss_scale
    summary = "hard-threshold sparsification |x| > tau (Strom 2015), variable size"
    uses_context = False  # a pure function of x and of ctx.loss_scale (1 in a standalone call)

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        flat = x.reshape(-1)
        mag = flat.abs()
        if mag.dtype in (torch.float16, torch.bfloat16):  # compare in fp32: tau is not rounded to 16 bits
            mag = mag.float()
        idx = torch.nonzero(mag > self.tau * ctx.loss_scale).reshape(-1)  # tau in the gradient's units
        return Packet([flat[idx], idx.to(torch.int32)], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        values, indices = packet.tensors[0], packet.tensors[1]
        return scatter_sparse(values, indices, packet.shape, packet.dtype)
