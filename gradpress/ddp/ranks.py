"""Every rank's hook state in one dictionary, for frameworks whose
checkpoints are written by rank 0 alone (Lightning, Accelerate, the
Transformers Trainer): residuals differ between ranks, so rank 0's own
state is not enough to resume.

Invariant: :func:`gather_states` is collective (every rank of the hook's
group calls it, on gradpress's own group so it never interleaves with DDP's
collectives); :func:`load_rank_state` gives each rank exactly the state it
saved, and refuses a checkpoint of another world size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from gradpress.ddp.hook import GradpressHook

__all__ = ["RANKS_FORMAT", "gather_states", "load_rank_state"]

RANKS_FORMAT = "gradpress-ranks/1"


def gather_states(state: GradpressHook) -> dict[str, Any]:
    """``{"format", "world_size", "ranks": [state_dict of rank 0, 1, ...]}``
    (plain tensors, numbers, strings: loads with ``torch.load(weights_only=True)``)."""
    world = dist.get_world_size(state.group)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, state.state_dict(), group=state.group)
    return {"format": RANKS_FORMAT, "world_size": world, "ranks": everyone}


def load_rank_state(state: GradpressHook, saved: Mapping[str, Any], rank: int, world_size: int,
                    where: str = "checkpoint") -> None:
    """Load rank ``rank``'s entry of ``saved`` (from :func:`gather_states`)
    into ``state`` (kept until it binds if it is not bound yet)."""
    fmt = saved.get("format") if isinstance(saved, Mapping) else type(saved).__name__
    if fmt != RANKS_FORMAT:
        raise ValueError(f"{where}: gradpress state has format {fmt!r}; expected {RANKS_FORMAT!r}")
    if saved.get("world_size") != world_size or len(saved.get("ranks", ())) != world_size:
        raise ValueError(f"{where}: world_size: the checkpoint has {saved.get('world_size')!r}, this run has "
                         f"{world_size}; the compression state is per rank")
    state.load_state_dict(saved["ranks"][rank])
