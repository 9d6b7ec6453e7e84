"""Collectives on flat buffers: a fused allreduce of many tensors and an
allgather of byte buffers whose sizes may differ between ranks.

Both return the bytes this rank handed to the collective (payload, padding,
size exchanges), which is what ``stats["bytes_sent"]`` counts. A world of
one (or no process group) moves nothing but still counts what would be
handed over, so figures compare across world sizes. No empty collective is
ever issued.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["fused_allreduce", "allgather_bytes"]


def fused_allreduce(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> tuple[list[torch.Tensor], int]:
    """Allreduce-sum ``tensors`` (grouped by dtype, one collective per dtype).
    Returns the summed tensors (same order, same shapes) and the bytes handed over."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(i)
        else:
            out[i] = t
    sent = 0
    for idxs in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in idxs])
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
        sent += flat.numel() * flat.element_size()
        offset = 0
        for i in idxs:
            n = tensors[i].numel()
            out[i] = flat[offset : offset + n].view_as(tensors[i])
            offset += n
    return out, sent  # type: ignore[return-value]


def allgather_bytes(buffer: torch.Tensor, group: dist.ProcessGroup | None, world_size: int, variable: bool) -> tuple[list[torch.Tensor], int]:
    """Gather every rank's uint8 ``buffer`` (sizes may differ when
    ``variable``: one int64 size exchange first, then padding to the largest,
    rounded up to 8 bytes; gloo has no allgatherv). Returns the per-rank
    buffers and the bytes handed over."""
    if world_size == 1 or not dist.is_initialized():
        # nothing travels, but count what would be handed over, as the allreduce paths do
        return [buffer], buffer.numel()
    sent = 0
    if variable:
        size = torch.tensor([buffer.numel()], dtype=torch.int64, device=buffer.device)
        sizes_out = [torch.empty_like(size) for _ in range(world_size)]
        dist.all_gather(sizes_out, size, group=group)
        sent += size.numel() * size.element_size()
        sizes = [int(s) for s in torch.cat(sizes_out).tolist()]
    else:
        sizes = [buffer.numel()] * world_size
    width = (max(sizes) + 7) // 8 * 8
    padded = torch.zeros(width, dtype=torch.uint8, device=buffer.device)
    padded[: buffer.numel()] = buffer
    gathered = torch.empty(world_size * width, dtype=torch.uint8, device=buffer.device)
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_single(gathered, padded, group=group)
    sent += width
    return [gathered[r * width : r * width + sizes[r]] for r in range(world_size)], sent
