"""Every rank's hook state in one dictionary, for frameworks whose
checkpoints are written by rank 0 alone (Lightning, Accelerate, the
Transformers Trainer): residuals differ between ranks, so rank 0's own
state is not enough to resume.

Invariant: :func:`gather_states` is collective (every rank of the hook's
group calls it, on gradpress's own group so it never interleaves with DDP's
collectives); :func:`load_rank_state` gives each rank exactly the state it
saved, and refuses a checkpoint of another world size unless asked to
reshard (``reshard=True``): then every rank loads the N saved states folded
into one of M by :func:`gradpress.exchange.reshard.fold` (replicated state
kept, per-rank floating state such as residuals averaged in float64, so
their mean over the ranks is unchanged; strategies whose state depends on
the world size, ring, ps and hierarchical, refused by name).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from gradpress.ddp.hook import GradpressHook
from gradpress.exchange.reshard import fold

__all__ = ["RANKS_FORMAT", "gather_states", "load_rank_state", "rank_entry"]

RANKS_FORMAT = "gradpress-ranks/1"


def gather_states(state: GradpressHook) -> dict[str, Any]:
    """``{"format", "world_size", "ranks": [state_dict of rank 0, 1, ...]}``
    (plain tensors, numbers, strings: loads with ``torch.load(weights_only=True)``)."""
    world = dist.get_world_size(state.group)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, state.state_dict(), group=state.group)
    return {"format": RANKS_FORMAT, "world_size": world, "ranks": everyone}


def rank_entry(saved: Mapping[str, Any], rank: int, world_size: int, reshard: bool = False,
               where: str = "checkpoint", option: str = "reshard=True") -> Any:
    """Rank ``rank``'s hook state out of ``saved`` (from :func:`gather_states`):
    its own on the same world size; on another one, the fold of every saved
    rank's (``reshard``) or a ValueError naming both world sizes and
    ``option`` (how the user asks for the fold)."""
    fmt = saved.get("format") if isinstance(saved, Mapping) else type(saved).__name__
    if fmt != RANKS_FORMAT:
        raise ValueError(f"{where}: gradpress state has format {fmt!r}; expected {RANKS_FORMAT!r}")
    ranks = saved.get("ranks", ())
    n = saved.get("world_size")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or not isinstance(ranks, (list, tuple)) \
            or len(ranks) != n:
        count = len(ranks) if isinstance(ranks, (list, tuple)) else type(ranks).__name__
        raise ValueError(f"{where}: world_size: the checkpoint has {n!r}, this run has {world_size}, and the "
                         f"checkpoint holds {count} rank state(s): its header and entries disagree (a damaged file)")
    if n == world_size:
        return ranks[rank]
    if not reshard:
        raise ValueError(f"{where}: world_size: the checkpoint has {n}, this run has {world_size}; the "
                         f"compression state is per rank: pass {option} to fold the per-rank state into "
                         f"{world_size} ranks")
    try:
        return fold(ranks, rank, world_size, owner="hook state")
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def load_rank_state(state: GradpressHook, saved: Mapping[str, Any], rank: int, world_size: int,
                    where: str = "checkpoint", reshard: bool = False, option: str = "reshard=True") -> None:
    """Load rank ``rank``'s entry of ``saved`` (from :func:`gather_states`)
    into ``state`` (kept until it binds if it is not bound yet); a checkpoint
    of another world size only with ``reshard`` (:func:`rank_entry`)."""
    mine = rank_entry(saved, rank, world_size, reshard, where, option)  # refused before the hook is touched
    state.load_state_dict(mine)
