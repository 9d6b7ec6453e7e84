"""The shared half of the strategies that average exact values on a support
(``cyclic``: one rank's support; ``union``: every rank's): the values
scaled by 1/N and summed by one allreduce, then written back as dense
tensors with the rank's residual (everything off the support)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from gradpress.compress.base import Compressor
from gradpress.transport.collectives import fused_allreduce

__all__ = ["mean_on_support", "sparsifier_refusal"]


def sparsifier_refusal(compressor: Compressor, why: str, accepted: str) -> str | None:
    """None when ``compressor`` sends the input's own values at integer
    indices and is averaged by the mean (what a support strategy moves);
    else the reason, ``why`` the strategy needs one, the ``accepted``
    sparsifiers, the spec given, and for ``none`` a hint to pass one."""
    if compressor.exact_values and compressor.aggregation == "mean":
        return None
    hint = " (pass one, e.g. --compressor topk:ratio=0.01)" if compressor.identity else ""
    return (f"{why}, so it needs a sparsifier that sends the input's own values at integer indices ({accepted}), "
            f"not {compressor.spec()!r}{hint}")


def mean_on_support(tensors: list[torch.Tensor], flats: list[torch.Tensor], support: list[torch.Tensor],
                    group: dist.ProcessGroup | None, world_size: int, out: list[torch.Tensor] | None,
                    keep_residuals: bool) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, list[int], int, float]:
    """Per tensor, the mean over the ranks of ``flats[i]`` on the int64
    indices ``support[i]`` (identical on every rank), zero elsewhere:
    ``(results, residuals, value bytes per tensor, bytes handed over,
    seconds in the allreduce)``. Values are scaled by 1/N before the sum, as
    ``allreduce`` scales its payloads: N values near the dtype's maximum
    (fp16: 65504) would overflow in the sum, their mean does not. A result
    goes into ``out[i]`` when it is contiguous and not the input itself
    while residuals are kept (the residual is the input off the support,
    written in place over ``flats[i]``, a view of the input or its
    contiguous copy)."""
    values = [f[idx].div_(world_size) for f, idx in zip(flats, support)]
    t0 = time.perf_counter()
    summed, sent = fused_allreduce(values, group)
    comm_s = time.perf_counter() - t0
    results, residuals = [], [] if keep_residuals else None
    for i, (t, idx, total) in enumerate(zip(tensors, support, summed)):
        dst = out[i] if out is not None and i < len(out) and out[i] is not None else None
        if dst is None or not dst.is_contiguous() or (keep_residuals and dst.data_ptr() == t.data_ptr()):
            dst = torch.empty_like(t, memory_format=torch.contiguous_format)
        dst.zero_().view(-1).index_copy_(0, idx, total)
        results.append(dst)
        if residuals is not None:
            flats[i].index_fill_(0, idx, 0)
            residuals.append(flats[i].view(t.shape))
    return results, residuals, [v.numel() * v.element_size() for v in values], sent, comm_s
