"""``topk``: keep the k = ceil(ratio * d) entries of largest magnitude.

Aji & Heafield 2017; Stich et al. 2018 ("Sparsified SGD with memory").
Biased and contractive (class B3(d/k)), so error feedback is on by default.
Packet: ``[values (input dtype), indices (int32)]``, 4 + element-size bytes per
kept entry. Invariant: exactly the k largest |x| are kept (ties broken by
``torch.topk``).
"""

from __future__ import annotations

import torch

from gradpress.compress.base import Compressor, Context, Packet
from gradpress.compress.params import ratio_param
from gradpress.compress.sparse import kept_count, scatter_sparse


class TopK(Compressor):
    name = "topk"
    PARAMS = (ratio_param(0.01),)
    values_index = 0
    exact_values = True
    summary = "top-k sparsification (Aji & Heafield 2017), values + int32 indices"
    uses_context = False  # a pure function of x

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        flat = x.reshape(-1)
        k = kept_count(flat.numel(), self.ratio)
        _, idx = torch.topk(flat.abs(), k, sorted=False)
        return Packet([flat[idx], idx.to(torch.int32)], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        values, indices = packet.tensors[0], packet.tensors[1]
        return scatter_sparse(values, indices, packet.shape, packet.dtype)
