"""Resharding: the per-rank states of N saved ranks folded into the state of
one of M new ranks, so that a run preempted on N workers resumes on M
(``gradpress train --resume --reshard``, ``load_rank_state(..., reshard=True)``
of the framework integrations).

:func:`fold` walks the N saved states leaf by leaf (nested dicts, lists and
tuples of tensors, numbers, strings, None); every saved rank must have the
same keys and list lengths. A leaf

* equal on every saved rank (tensors: bitwise, same dtype and shape) is kept
  as it is on every new rank: replicated state (PowerSGD's warm-start Q,
  step counters, DiLoCo's outer momentum, configurations);
* a floating tensor (or Python float) that differs between ranks but has
  the same dtype and shape on all of them becomes, on every new rank, its
  mean over the N saved ranks, computed in float64 and cast back to the
  leaf's dtype. For state that is additive over the ranks (error-feedback
  residuals, DGC's momentum and velocity, Signum's and Comprex's momentum,
  gossip's push-sum numerators and weights and public copies, local models
  and optimizer state between synchronizations) this keeps the average:
  ``sum_new / M = sum_old / N`` (the new sum is ``M / N`` times the old one,
  so a residual's contribution to the averaged update is what it was);
* anything else (integers, booleans or strings that differ, shapes or dtypes
  that differ, keys or lengths that differ) is refused with a ``ValueError``
  naming the key path and the piece that owns it.

A state that carries a ``format`` with a registered rule (:func:`rule`) is
folded by that rule instead: the exchange engine's (:data:`STATE_FORMAT`,
here; the DDP hook's and the algorithms' register theirs) rewrites what
names the world (``config.world_size``, ``rank``), keeps rank 0's
``stats`` counters (accounting, not training state: bytes already sent stay
counted once) and refuses the strategies whose state depends on the world
size (``Strategy.reshard_refusal``: the ring's per-hop residuals); a strategy
that can fold what it keeps of the world size (``Strategy.reshard_fold``:
the parameter server's roots and root residuals,
:mod:`~gradpress.exchange.strategies.ps_reshard`; hierarchical's host
residuals, :mod:`~gradpress.exchange.strategies.hierarchical_reshard`)
takes that out of the saved states, places it on the new rank itself and
leaves the rest to the generic rule;
one that can tell what in a saved state it is about
(``Strategy.reshard_held``: the ring's) is refused only when some saved rank
holds some of it, decided by the checkpoint's content (the ring's own state,
its hop residuals, compressor state under a hop key): a ring that ran a
summable compressor, or error feedback off, keeps none and folds;
an algorithm whose state names ranks refuses through
``Algorithm.reshard_refused`` (leader SGD, the compressed Adams; SGP's
per-offset copies onto a graph of other offsets).

Invariant: the fold never changes a saved state (new containers; a kept
tensor is the saved one, which the loaders copy), and for every new rank
``r`` the folded floating leaves are the same tensor values, so replicas
stay replicas.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from gradpress.exchange.state import STATE_FORMAT

__all__ = ["Fold", "fold", "fold_leaves", "rule", "fold_engine", "fold_config", "refuse", "merge", "ACTION"]

#: what a refusal tells the user to do
ACTION = ("resume on the checkpoint's {n} worker(s) without resharding, or start a fresh run on {m} worker(s) "
          "(a new --out)")


@dataclasses.dataclass(frozen=True)
class Fold:
    """Where a fold is: the new ``rank`` of ``world``, the key ``path`` of
    the subtree, and its ``owner`` (the piece named in a refusal)."""

    rank: int
    world: int
    path: str = ""
    owner: str = "state"

    def at(self, key: Any, owner: str | None = None) -> Fold:
        return dataclasses.replace(self, path=f"{self.path}/{key}", owner=owner or self.owner)


#: format tag -> its rule: (the N saved states, where) -> the folded state
_RULES: dict[str, Callable[[list[Any], Fold], Any]] = {}


def rule(fmt: str) -> Callable[[Callable[[list[Any], Fold], Any]], Callable[[list[Any], Fold], Any]]:
    """Decorator: fold every subtree whose ``format`` is ``fmt`` (on every saved rank) by this function."""
    def put(fn: Callable[[list[Any], Fold], Any]) -> Callable[[list[Any], Fold], Any]:
        _RULES[fmt] = fn
        return fn
    return put


def refuse(vals: Sequence[Any], at: Fold, why: str) -> ValueError:
    """The refusal of the subtree at ``at``: its path, owner, why, and what to do."""
    where = at.path or "/"
    return ValueError(f"cannot reshard {len(vals)} rank(s) into {at.world}: {where} ({at.owner}): {why}; "
                      + ACTION.format(n=len(vals), m=at.world))


def fold(states: Sequence[Any], rank: int, world: int, owner: str = "state") -> Any:
    """The state of new rank ``rank`` of ``world`` from the ``states`` of the
    N saved ranks (rank order): the module's rule, leaf by leaf. ValueError
    naming the key path and ``owner`` (or the piece a rule names) when a
    leaf cannot be folded."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"reshard: world must be an integer >= 1, got {world!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"reshard: rank must be an integer from 0 to {world - 1}, got {rank!r}")
    states = list(states)
    if not states:
        raise ValueError("reshard: no saved rank to fold")
    return fold_leaves(states, Fold(rank, world, "", owner))


def fold_leaves(vals: list[Any], at: Fold) -> Any:
    """The generic rule on one subtree (a registered ``format`` goes to its rule)."""
    first = vals[0]
    if isinstance(first, Mapping):
        if not all(isinstance(v, Mapping) for v in vals):
            raise refuse(vals, at, "a dict on some saved ranks only")
        fmt = first.get("format")
        if isinstance(fmt, str) and fmt in _RULES and all(v.get("format") == fmt for v in vals):
            return _RULES[fmt](vals, at)
        keys = list(first)
        for r, v in enumerate(vals):
            if set(v) != set(keys):
                odd = sorted(map(str, set(v) ^ set(keys)))
                raise refuse(vals, at, f"saved ranks 0 and {r} hold different keys ({', '.join(odd)}): "
                                       "per-rank state that exists on some ranks only")
        return {k: fold_leaves([v[k] for v in vals], at.at(k)) for k in keys}
    if type(first) in (list, tuple):
        if not all(type(v) is type(first) and len(v) == len(first) for v in vals):
            raise refuse(vals, at, f"lengths differ between saved ranks ({[len(v) for v in vals]})")
        return type(first)(fold_leaves([v[i] for v in vals], at.at(i)) for i in range(len(first)))
    if isinstance(first, torch.Tensor):
        return _fold_tensor(vals, at)
    if all(type(v) is type(first) and v == first for v in vals):
        return first
    if all(type(v) is float for v in vals):
        return math.fsum(vals) / len(vals)
    raise refuse(vals, at, f"values differ between saved ranks ({_show(vals)}) and are not floating point: "
                           "per-rank state that has no mean")


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.detach().reshape(-1).contiguous().view(torch.uint8),
                       b.detach().reshape(-1).contiguous().view(torch.uint8))


def _fold_tensor(vals: list[Any], at: Fold) -> torch.Tensor:
    first = vals[0]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        raise refuse(vals, at, "a tensor on some saved ranks only")
    if all(_bitwise_equal(first, v) for v in vals[1:]):
        return first
    if any(v.dtype != first.dtype or v.shape != first.shape for v in vals):
        raise refuse(vals, at, "shapes or dtypes differ between saved ranks "
                               f"({', '.join(f'{v.dtype} {tuple(v.shape)}' for v in vals)})")
    if not first.is_floating_point():
        raise refuse(vals, at, f"a {first.dtype} tensor that differs between saved ranks: per-rank state that has "
                               "no mean")
    total = torch.zeros(first.shape, dtype=torch.float64, device=first.device)
    for v in vals:  # one add per saved rank, each a whole tensor
        total += v.to(torch.float64)
    return (total / len(vals)).to(first.dtype)


def _show(vals: list[Any]) -> str:
    text = ", ".join(repr(v) for v in vals[:4])
    return text + (", ..." if len(vals) > 4 else "")


@rule(STATE_FORMAT)
def fold_engine(vals: list[Any], at: Fold) -> dict[str, Any]:
    """The exchange engine's state (also the DDP hook's, which adds ``step``,
    ``layout`` and ``loss_scale``): ``config.world_size`` and ``rank`` set to
    the new world and rank, rank 0's ``stats``, the strategies' refusals
    (``Strategy.reshard_refusal``) and folds (``Strategy.reshard_fold``:
    what it returns as placed is merged over the fold of the rest), every
    other part by the generic rule (the compressor's state named after the
    compressor)."""
    from gradpress.exchange.base import strategy_class

    config = vals[0].get("config", {})
    compressor = f"compressor {config.get('compressor')!r}" if isinstance(config, Mapping) else "compressor"
    placed: list[dict[str, Any]] = []
    for name in sorted({n for v in vals for n in (v.get("strategies") or {})}):
        try:
            cls = strategy_class(name.partition(":")[0])  # an engine names a strategy by its key (with parameters)
        except ValueError:
            continue
        if cls.reshard_fold is not None:  # the strategy takes out what it places itself; the rest goes on
            vals, mine = cls.reshard_fold(vals, at, name)
            placed.append(mine)
            continue
        why = cls.reshard_refusal
        if why and cls.reshard_held is not None:  # refused by what the saved ranks hold, if anything
            held = [(r, h) for r, v in enumerate(vals) if (h := cls.reshard_held(v)) is not None]
            why = f"{why}: saved rank {held[0][0]} holds {held[0][1]}" if held else None
        if why:
            raise refuse(vals, at.at("strategies").at(name, f"strategy {name!r}"), why)
    out: dict[str, Any] = {}
    for key in vals[0]:
        if key == "stats":
            out[key] = vals[0][key]  # rank 0's counters: the summary reports rank 0's bytes
        elif key == "rank":
            out[key] = at.rank
        elif key == "config" and isinstance(config, Mapping):
            out[key] = fold_config(vals, at)
        elif key == "compressor":
            out[key] = fold_leaves([v.get(key) for v in vals], at.at(key, compressor))
        elif key == "feedback":
            out[key] = fold_leaves([v.get(key) for v in vals], at.at(key, f"error feedback of {compressor}"))
        else:
            if not all(key in v for v in vals):
                raise refuse(vals, at.at(key), "present on some saved ranks only")
            out[key] = fold_leaves([v[key] for v in vals], at.at(key))
    for mine in placed:
        merge(out, mine)
    return out


def merge(into: dict[str, Any], placed: Mapping[str, Any]) -> None:
    """Put ``placed`` (nested dicts) into the folded state ``into``: dicts merged key by key, the rest set."""
    for key, value in placed.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = dict(value) if isinstance(value, Mapping) else value


def fold_config(vals: list[Any], at: Fold) -> dict[str, Any]:
    """A saved ``config`` with ``world_size`` the new world's (every other field must agree)."""
    configs = [{k: c for k, c in v["config"].items() if k != "world_size"} for v in vals]
    out = fold_leaves(configs, at.at("config", "configuration"))
    if "world_size" in vals[0]["config"]:
        out["world_size"] = at.world
    return out
