"""``gradpress train --resume --reshard``: continue a checkpoint of N
workers on M (a preempted job that gets fewer or more workers back).

Without ``--reshard`` a checkpoint of another world size is refused (the
message names both sizes, the flag and the global batch the run would
have). With it, before any worker starts, the checkpoint must be at an
epoch boundary and use ``--split iid``; then every new rank ``r`` of M
starts from:

* ``algorithm``, and for algorithms whose replicas differ between
  synchronizations (every one but ``ddp``) ``model`` and ``optimizer``: the
  N saved ranks' folded by :func:`gradpress.exchange.reshard.fold` (equal
  leaves kept, differing floating leaves averaged in float64 and cast back,
  so the mean of additive per-rank state such as residuals is unchanged;
  the rest refused, naming the key path and the strategy, compressor or
  algorithm: ``ps``, ``hierarchical``, ``lsgd`` and the compressed Adams
  are refused, their state being cut by the world size; ``ring`` when a saved
  rank holds hop state, ``Strategy.reshard_held``; compressed ``sgp`` onto a
  graph of other hop offsets);
* RNG: a fresh stream seeded from (seed, step) as a fresh run seeds its ranks
  (``torch.manual_seed``, ``np.random.seed``, ``random.seed``; a fresh run
  seeds every rank alike, so the new ranks are seeded alike too). A
  resharded run is therefore not bit-identical to any uninterrupted run;
* data: the next epoch from its start, dealt to M ranks as a fresh M-worker
  run deals it (:func:`gradpress.train.loop.epoch_order`: the epoch's
  permutation depends on (seed, epoch) only). A mid-epoch checkpoint
  (``--steps`` stopped the run inside an epoch) is refused: the samples the
  N ranks saw of that epoch are N slices of its permutation that M ranks'
  slices cannot continue. A non-IID ``--split`` is refused: its shards are
  dealt for N workers (each worker's local data set), and re-dealing them
  for M would change every worker's data, not continue the run;
* step count and learning rate: steps keep counting from the checkpoint's
  step S; the schedule continues at the fraction of the run done
  (``e / epochs`` after e epochs): the schedule's position is shifted by
  ``e * steps_per_epoch(M) - S`` (:func:`schedule_shift`) and the run ends
  after the remaining ``epochs - e`` epochs of M workers (``--steps`` still
  caps the step count).

Every reshard is recorded (``{"from", "to", "step", "epoch"}``) in the
checkpoint's and the summary's ``reshards`` list; a later plain resume on M
workers keeps the shift of the last one.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

# the algorithms' and the DDP hook's fold rules register as their modules load
import gradpress.algorithms.base  # noqa: F401
import gradpress.ddp.hook_state  # noqa: F401
from gradpress.exchange.reshard import fold

__all__ = ["saved_world", "check", "entry", "seed_fresh", "reshards", "schedule_shift", "refusal"]


def saved_world(state: Mapping[str, Any]) -> int:
    """The world size a checkpoint was written on."""
    return int(state["config"].get("world_size", len(state["ranks"])))


def refusal(saved: int, world: int, batch_size: int) -> str:
    """The world-size entry of the refusal of a checkpoint of another world size without ``--reshard``."""
    return (f"world_size: checkpoint has {saved}, this run has {world}; pass --reshard to fold the per-rank state "
            f"into {world} ranks (the global batch becomes {batch_size * world})")


def check(state: Mapping[str, Any], split: str, world: int) -> None:
    """Refuse (ValueError, one line) a reshard this module cannot do: a
    mid-epoch position, a non-IID split (module docstring)."""
    saved = saved_world(state)
    if state.get("batch", 0) != 0:
        raise ValueError(f"resume --reshard: the checkpoint stopped inside epoch {state['epoch'] + 1} (after batch "
                         f"{state['batch']} of it, step {state['step']}); its {saved} workers' slices of that epoch "
                         f"cannot be continued by {world}: resume on {saved} workers until the epoch ends "
                         "(drop --steps or raise it to the epoch's end), then reshard")
    if split != "iid":
        raise ValueError(f"resume --reshard: split {split!r} deals fixed shards to the checkpoint's {saved} "
                         f"workers (each worker's own data); {world} workers would each get other data, which is "
                         f"another run: resume on {saved} workers, or start a fresh run on {world} with --split "
                         f"{split}")


def entry(state: Mapping[str, Any], rank: int, world: int) -> dict[str, Any]:
    """New rank ``rank``'s ``algorithm`` (and ``model``, ``optimizer`` where
    the checkpoint has them per rank): the fold of the saved ranks'. The RNG
    is not folded (:func:`seed_fresh`). ValueError naming the key path."""
    spec = state["config"].get("algorithm", "ddp")
    parts = [{k: v for k, v in r.items() if k != "rng"} for r in state["ranks"]]
    try:
        return fold(parts, rank, world, owner=f"algorithm {spec!r}")
    except ValueError as exc:
        raise ValueError(f"resume --reshard: {exc}") from None


def seed_fresh(seed: int, step: int) -> None:
    """Seed torch, numpy and Python's global generators as a fresh run does, from (seed, step)."""
    derived = int(np.random.SeedSequence([seed, step, 0x5E5A4D]).generate_state(1)[0])
    torch.manual_seed(derived)
    np.random.seed(derived)
    random.seed(derived)


def reshards(state: Mapping[str, Any], world: int) -> list[dict[str, int]]:
    """The checkpoint's reshards, plus this resume's when ``world`` is not the checkpoint's."""
    done = [dict(r) for r in state.get("reshards", [])]
    saved = saved_world(state)
    if saved != world:
        done.append({"from": saved, "to": world, "step": int(state["step"]), "epoch": int(state["epoch"])})
    return done


def schedule_shift(done: list[Mapping[str, int]], steps_per_epoch: int) -> int:
    """What to add to the step count for the learning-rate schedule: after
    the last reshard (at step S, epoch e), ``e * steps_per_epoch - S``, so
    the schedule is where ``e`` epochs of this world would have put it."""
    if not done:
        return 0
    last = done[-1]
    return int(last["epoch"]) * steps_per_epoch - int(last["step"])
