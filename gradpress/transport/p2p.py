"""Point-to-point byte exchange (the ring and parameter-server strategies, gossip).

:func:`exchange_bytes` sends one uint8 buffer to each of some peers and
receives one from each of some (possibly other) peers, all posted at once with
``isend``/``irecv`` and then waited on, so no ordering of the calls across
ranks can deadlock (a blocking ``send`` on a gloo ring would wait for the
neighbour's ``recv``, which waits for its own ``send``...). A message whose
size the receiver cannot know (variable-size packets) is preceded by its size
as one int64; a message the receiver knows to be empty is not sent at all
(gloo and NCCL refuse empty point-to-point messages).

gloo's point-to-point calls read host memory only: handed a CUDA tensor,
they write from its device address as if it were host memory and the
process aborts (``writev ... Bad address``, seen on an H200 with torch
2.11). On a gloo group the messages therefore travel from and into host
copies (:func:`wire_device`), and the received buffers are moved to the
caller's device; NCCL sends device memory directly.

Peers are *group* ranks; they are translated to the global ranks that
``torch.distributed``'s point-to-point calls take (``get_global_rank``), so
the helpers work on sub-groups with every torch >= 2.2.

Invariant: every rank calls :func:`exchange_bytes` in the same order (the
hook's single communication thread), and a pair of calls agrees: if rank a
sends to b then b expects from a, with the same known size or ``None``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

__all__ = ["global_rank", "exchange_bytes", "swap_bytes", "wire_device"]

_SIZE_TAG = 1
_DATA_TAG = 2


def global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    """The global rank of ``rank`` in ``group`` (the default group: itself)."""
    if group is None or group is dist.GroupMember.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def wire_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """Where point-to-point messages of ``group`` must live: ``device``,
    except on gloo (host memory only), where it is the CPU."""
    if device.type != "cpu" and dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return device


def exchange_bytes(
    sends: Mapping[int, torch.Tensor],
    expect: Mapping[int, int | None],
    group: dist.ProcessGroup | None,
    sized: bool,
    device: torch.device | None = None,
    recv_group: dist.ProcessGroup | None = None,
) -> tuple[dict[int, torch.Tensor], int]:
    """Send ``sends[peer]`` (uint8) to each peer and receive one buffer from
    each peer in ``expect``. Peers are group ranks. ``recv_group``: receive
    on this group instead (the same ranks; see :func:`swap_bytes`).

    ``expect[peer]`` is the byte size of the message from ``peer`` when this
    side knows it (fixed-size packets), or ``None`` when the sender prefixes
    its message with its size. ``sized``: this rank prefixes its own sends
    (variable-size data). Both sides derive these from the same compressor
    trait, so they agree.

    Returns the received buffers by peer (on ``device``, default: the
    sends' device) and the bytes handed over (size prefixes included).
    """
    if device is None:
        device = next(iter(sends.values())).device if sends else torch.device("cpu")
    home, device = device, wire_device(group, device)
    incoming = group if recv_group is None else recv_group
    sent = 0
    keep: list[torch.Tensor] = []
    works = []
    size_in: dict[int, torch.Tensor] = {}
    if sized:
        for peer, buf in sends.items():
            t = torch.tensor([buf.numel()], dtype=torch.int64, device=device)
            keep.append(t)
            works.append(dist.isend(t, global_rank(group, peer), group=group, tag=_SIZE_TAG))
            sent += 8
    for peer, known in expect.items():
        if known is None:
            t = torch.empty(1, dtype=torch.int64, device=device)
            size_in[peer] = t
            works.append(dist.irecv(t, global_rank(incoming, peer), group=incoming, tag=_SIZE_TAG))
    for w in works:
        w.wait()
    sizes = {peer: int(size_in[peer].item()) if known is None else int(known) for peer, known in expect.items()}
    works = []
    out: dict[int, torch.Tensor] = {}
    for peer, n in sizes.items():
        buf = torch.empty(n, dtype=torch.uint8, device=device)
        out[peer] = buf
        if n:
            works.append(dist.irecv(buf, global_rank(incoming, peer), group=incoming, tag=_DATA_TAG))
    for peer, buf in sends.items():
        if buf.numel():
            data = buf.to(device).contiguous()
            keep.append(data)
            works.append(dist.isend(data, global_rank(group, peer), group=group, tag=_DATA_TAG))
            sent += data.numel()
    for w in works:
        w.wait()
    if home != device:
        out = {peer: buf.to(home) for peer, buf in out.items()}
    return out, sent


def swap_bytes(
    buffer: torch.Tensor, peer: int, send_group: dist.ProcessGroup, recv_group: dist.ProcessGroup, size: int | None,
) -> tuple[torch.Tensor, int]:
    """Send ``buffer`` (uint8) to ``peer`` on ``send_group`` and receive the
    peer's buffer on ``recv_group`` (``size`` bytes, or ``None``: prefixed
    with its size), all posted at once. With one group per direction (the
    peer sends on this rank's ``recv_group``) each TCP connection carries
    data one way only: a bulk exchange both ways over one gloo pair ran at
    about half the link rate through a shaped link (docs/strategies.md,
    "Pipelining"). Peers are ranks of both groups, which hold the same ranks.
    Returns the peer's buffer and the bytes handed over."""
    got, sent = exchange_bytes({peer: buffer}, {peer: size}, send_group, size is None, buffer.device, recv_group)
    return got[peer], sent
