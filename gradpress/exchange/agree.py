"""Cross-rank agreement on a configuration, before any worker trains.

Every rank exchanges its configuration (or the error that stopped it
building one) and all raise the same ``ValueError`` if any rank failed or
any configuration differs, naming the rank, the field and both values.
Runs once at construction, off the hot path (``all_gather_object`` is only
used here, never per step).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

__all__ = ["agree", "by_message", "config_diff", "same_config"]


def _same_field(field: str, theirs: Any, mine: Any, world: Any = None) -> bool:
    """The strategy compares by what it runs (an earlier version named a
    strategy with parameters by the spec as given, defaults included; a host
    layout given or from the environment: resolved on this run's ``world``)."""
    from gradpress.exchange.base import same_strategy

    if field != "strategy":
        return theirs == mine
    return same_strategy(theirs, mine, world if isinstance(world, int) and not isinstance(world, bool) else None)


def same_config(theirs: dict[str, Any], mine: dict[str, Any]) -> bool:
    """Whether a saved configuration (a state dict's) is this one."""
    world = mine.get("world_size")
    return all(_same_field(f, theirs.get(f), mine.get(f), world) for f in set(theirs) | set(mine))


def config_diff(theirs: dict[str, Any], mine: dict[str, Any], theirs_name: str = "checkpoint",
                mine_name: str = "this run") -> str:
    """``field: <theirs_name> has X, <mine_name> has Y; ...`` for every field that differs."""
    fields = [f for f in sorted(set(theirs) | set(mine))
              if not _same_field(f, theirs.get(f), mine.get(f), mine.get("world_size"))]
    return "; ".join(
        f"{f}: {theirs_name} has {theirs.get(f)!r}, {mine_name} has {mine.get(f)!r}" for f in fields if f != "parameters"
    ) or "parameters: names or shapes differ"


def by_message(errors: list[str | None]) -> list[str]:
    """``rank R: message`` per distinct message of ``errors`` (one entry per rank, None where it did not
    fail), in the order of the first rank that gave it, the ranks that gave the same one named together
    (``ranks 0, 1, 2: message``): a refusal every rank makes alike is said once, not once per worker."""
    ranks: dict[str, list[int]] = {}
    for r, error in enumerate(errors):
        if error:
            ranks.setdefault(error, []).append(r)
    return [f"rank {rs[0]}: {m}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}: {m}" for m, rs in ranks.items()]


def agree(mine: dict[str, Any] | None, error: str | None, group: dist.ProcessGroup | None, what: str = "gradpress",
          stage: str = "registration", hints: Mapping[str, str] | None = None) -> None:
    """Raise on every rank if any rank failed (``error``) or the
    configurations differ; return silently when all agree. ``stage`` names
    what failed in the message (``"registration"`` of a DDP hook,
    ``"construction"`` of an algorithm). ``hints``: by field, what to do when
    that field differs (appended once to the message)."""
    world = dist.get_world_size(group)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, {"config": mine, "error": error}, group=group)
    errors = by_message([e["error"] for e in everyone])
    if errors:
        raise ValueError(f"{what} {stage} failed: " + "; ".join(errors))
    configs = [e["config"] for e in everyone]
    if all(c == configs[0] for c in configs):
        return
    base = configs[0]
    diffs = []
    for r, cfg in enumerate(configs):
        for field in sorted(set(base) | set(cfg)):
            if cfg.get(field) != base.get(field):
                if field == "parameters":
                    diffs.append(f"rank {r} has different parameter names/shapes/dtypes than rank 0")
                else:
                    diffs.append(f"rank {r} has {field}={cfg.get(field)!r} but rank 0 has {base.get(field)!r}")
    fixes = [hint for field, hint in (hints or {}).items()
             if any(cfg.get(field) != base.get(field) for cfg in configs)]
    raise ValueError(f"{what} configuration differs between ranks: " + "; ".join(diffs + fixes))
