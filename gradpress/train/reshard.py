"""``gradpress train --resume --reshard``: continue a checkpoint of N
workers on M (a preempted job that gets fewer or more workers back).

Without ``--reshard`` a checkpoint of another world size is refused (the
message names both sizes, the flag and the global batch the run would
have). With it, before any worker starts, the checkpoint must use
``--split iid`` and, inside an epoch, leave a number of batches the M
workers can share evenly (:func:`check`); then every new rank ``r`` of M
starts from:

* ``algorithm``, and for algorithms whose replicas differ between
  synchronizations (every one but ``ddp``) ``model`` and ``optimizer``: the
  N saved ranks' folded by :func:`gradpress.exchange.reshard.fold` (equal
  leaves kept, differing floating leaves averaged in float64 and cast back,
  so the mean of additive per-rank state such as residuals is unchanged;
  the rest refused, naming the key path and the strategy, compressor or
  algorithm: ``lsgd`` and the compressed Adams are refused, their state
  being cut by the world size; ``ring`` when a saved rank holds hop state,
  ``Strategy.reshard_held``, and ``hierarchical`` when its outer ring does;
  compressed ``sgp`` onto a graph of other hop offsets; ``ps`` and
  ``hierarchical`` place their own state, ``Strategy.reshard_fold``: root
  residuals moved whole to the keys' new roots, every new host given the
  mean of the saved hosts' residuals);
* RNG: a fresh stream seeded from (seed, step) as a fresh run seeds its ranks
  (``torch.manual_seed``, ``np.random.seed``, ``random.seed``; a fresh run
  seeds every rank alike, so the new ranks are seeded alike too). A
  resharded run is therefore not bit-identical to any uninterrupted run;
* data: at an epoch boundary, the next epoch from its start, dealt to M
  ranks as a fresh M-worker run deals it (:func:`gradpress.train.loop.epoch_order`:
  the epoch's permutation depends on (seed, epoch) only). Inside epoch e
  (``--steps`` stopped the run after batch b of it), the samples the N
  ranks have seen are known exactly (rank r's slice of the permutation, its
  first b batches), and every rank has the same ``S_N - b`` batches left
  (``S_N``: the checkpoint's ``steps_per_epoch``): the M ranks take exactly
  those, each once, K = ``N (S_N - b) / M`` whole batches each, numbered
  ``S_M - K`` .. ``S_M - 1`` so the epoch ends where an M-worker epoch does
  (:func:`epoch_rows`, :func:`start`). Refused when M does not divide
  ``N (S_N - b)`` (part batches or unequal step counts would change what a
  step averages; the message names the batch at which N workers could stop
  instead), or when the checkpoint does not record ``steps_per_epoch``. A
  non-IID ``--split`` is refused: its shards are dealt for N workers (each
  worker's local data set), and re-dealing them for M would change every
  worker's data, not continue the run;
* step count and learning rate: steps keep counting from the checkpoint's
  step S; the schedule continues at the fraction of the run done
  (``e / epochs`` after e epochs): the schedule's position is shifted by
  ``e * steps_per_epoch(M) - S`` (:func:`schedule_shift`; inside epoch e
  ``(e + 1) * steps_per_epoch(M) - K - S``) and the run ends after the
  remaining epochs of M workers (``--steps`` still caps the step count).

Every reshard is recorded (``{"from", "to", "step", "epoch"}``, inside an
epoch also ``batch`` and ``left``: b and K) in the
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

__all__ = ["saved_world", "check", "left", "epoch_rows", "entry", "seed_fresh", "reshards", "start", "schedule_shift",
           "refusal"]


def saved_world(state: Mapping[str, Any]) -> int:
    """The world size a checkpoint was written on."""
    return int(state["config"].get("world_size", len(state["ranks"])))


def refusal(saved: int, world: int, batch_size: int) -> str:
    """The world-size entry of the refusal of a checkpoint of another world size without ``--reshard``."""
    return (f"world_size: checkpoint has {saved}, this run has {world}; pass --reshard to fold the per-rank state "
            f"into {world} ranks (the global batch becomes {batch_size * world})")


def check(state: Mapping[str, Any], split: str, world: int) -> None:
    """Refuse (ValueError, one line) a reshard this module cannot do: a
    non-IID split, a mid-epoch position whose remaining batches do not deal
    evenly to ``world`` workers, or one of a checkpoint that does not record
    its epoch's length (module docstring)."""
    saved = saved_world(state)
    if split != "iid":
        raise ValueError(f"resume --reshard: split {split!r} deals fixed shards to the checkpoint's {saved} "
                         f"workers (each worker's own data); {world} workers would each get other data, which is "
                         f"another run: resume on {saved} workers, or start a fresh run on {world} with --split "
                         f"{split}")
    batch = int(state.get("batch", 0))
    if batch == 0:
        return
    where = (f"the checkpoint stopped inside epoch {state['epoch'] + 1} (after batch {batch} of it, step "
             f"{state['step']})")
    spe = state.get("steps_per_epoch")
    if not isinstance(spe, int) or not batch < spe:
        raise ValueError(f"resume --reshard: {where} and does not record the epoch's length (written before "
                         f"mid-epoch reshards): resume on {saved} workers until the epoch ends, then reshard")
    left = saved * (spe - batch)
    if left % world:
        fits = next((b for b in range(batch + 1, spe) if saved * (spe - b) % world == 0), None)
        when = f"after batch {fits} of it" if fits is not None else "at its end"
        raise ValueError(f"resume --reshard: {where}; its {saved} workers have {left} batches of it left, which "
                         f"{world} workers cannot share evenly (each sample of the epoch once, whole batches): "
                         f"resume on {saved} workers until {when} (--steps {state['step'] + (fits or spe) - batch}), "
                         "then reshard")


def left(state: Mapping[str, Any], world: int) -> int:
    """The batches each of ``world`` new ranks takes of the checkpoint's epoch: the saved ranks' remaining
    ones shared evenly (:func:`check` has refused the rest; 0 at an epoch boundary)."""
    batch = int(state.get("batch", 0))
    return 0 if batch == 0 else saved_world(state) * (int(state["steps_per_epoch"]) - batch) // world


def epoch_rows(n: int, seed: int, epoch: int, batch_size: int,
               done: list[Mapping[str, int]]) -> tuple[torch.Tensor, int] | None:
    """Who trains on what in ``epoch`` when a reshard happened inside it (None: none did, the epoch is dealt as
    :func:`gradpress.train.loop.shard_batches` deals it): a ``[world, left * batch_size]`` tensor of sample
    indices, row r rank r's in order, and the batch number of its first batch. The epoch starts as the first
    reshard's ``from`` workers deal it (rank r: ``order[r P:(r + 1) P]``, P = n // world, its first
    ``steps * batch_size``); at each reshard of the epoch (``batch`` b of the old world's numbering, ``left``
    K) every old rank's unseen part (from batch b on) is joined in rank order and cut into ``to`` rows of K
    batches, numbered ``steps_per_epoch(to) - K`` on so that the epoch still ends at its last batch."""
    from gradpress.train.loop import epoch_order

    mids = [r for r in done if int(r["epoch"]) == epoch and int(r.get("left", 0)) > 0]
    if not mids:
        return None
    world = int(mids[0]["from"])
    per_rank = n // world
    rows = epoch_order(n, seed, epoch)[: world * per_rank].view(world, per_rank)
    rows, first = rows[:, : per_rank // batch_size * batch_size], 0
    for r in mids:
        if int(r["from"]) != world:
            raise ValueError(f"reshards: epoch {epoch} continued on {world} workers, then resharded from "
                             f"{r['from']}")
        rest = rows[:, (int(r["batch"]) - first) * batch_size:].reshape(-1)
        world, k = int(r["to"]), int(r["left"])
        if rest.numel() != world * k * batch_size:
            raise ValueError(f"reshards: {rest.numel()} samples of epoch {epoch} left for {world} workers x {k} "
                             f"batches of {batch_size}")
        rows, first = rest.view(world, k * batch_size), (n // world) // batch_size - k
    return rows, first


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
    """The checkpoint's reshards, plus this resume's when ``world`` is not the checkpoint's (inside an epoch
    also its ``batch``, in the saved world's numbering, and the batches ``left`` to each new rank)."""
    done = [dict(r) for r in state.get("reshards", [])]
    saved = saved_world(state)
    if saved != world:
        done.append({"from": saved, "to": world, "step": int(state["step"]), "epoch": int(state["epoch"])})
        if int(state.get("batch", 0)):
            done[-1].update(batch=int(state["batch"]), left=left(state, world))
    return done


def start(state: Mapping[str, Any], world: int, steps_per_epoch: int) -> tuple[int, int]:
    """The position (epoch, batch) a run of ``world`` workers resumes at: the checkpoint's, or after a reshard
    inside the epoch the first batch of the new world's share of it (:func:`left` batches, numbered so that
    the epoch ends at its last batch, ``steps_per_epoch - 1``)."""
    if saved_world(state) != world and int(state.get("batch", 0)):
        return int(state["epoch"]), steps_per_epoch - left(state, world)
    return int(state["epoch"]), int(state["batch"])


def schedule_shift(done: list[Mapping[str, int]], steps_per_epoch: int) -> int:
    """What to add to the step count for the learning-rate schedule: after
    the last reshard (at step S, epoch e), ``e * steps_per_epoch - S``, so
    the schedule is where ``e`` epochs of this world would have put it;
    inside epoch e, with K batches of it left to each new rank,
    ``(e + 1) * steps_per_epoch - K - S``: the epoch ends where it would."""
    if not done:
        return 0
    last = done[-1]
    k = int(last.get("left", 0))
    return (int(last["epoch"]) + (1 if k else 0)) * steps_per_epoch - k - int(last["step"])
