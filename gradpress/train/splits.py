"""How the training set is dealt to the workers: ``--split``.

* ``iid`` (the default): every epoch is a permutation of the whole training
  set drawn from (seed, epoch); rank r takes slice r of it
  (:func:`gradpress.train.loop.epoch_order`, unchanged).
* ``dirichlet:alpha=A`` (Hsu et al. 2019, "Measuring the Effects of
  Non-Identical Data Distribution for Federated Visual Classification"):
  worker w draws its class distribution ``q_w ~ Dir(A p)``, ``p`` the
  training set's class frequencies; then the ``world x (n // world)`` sample
  slots are filled in the order (slot 0 of worker 0, slot 0 of worker 1,
  ..., slot 1 of worker 0, ...), each slot's class drawn from its worker's
  ``q_w`` restricted to the classes that still have samples (renormalized;
  from ``p`` so restricted if ``q_w`` is 0 on all of them), the sample taken
  from a seeded shuffle of that class. Small A: each worker sees few classes;
  large A: each sees about ``p``.
* ``labels:k=K`` (McMahan et al. 2017, the "pathological non-IID" split):
  the training set sorted by label (ties in a seeded random order) is cut
  into ``world x K`` equal shards and each worker gets K of them (dealt by a
  seeded permutation), so a worker sees about K labels (a shard that
  straddles two labels holds both; two shards of one label give fewer).

Non-IID shards are fixed for the whole run (a worker's local data set, as
in federated learning) and have one size on every worker (``n // world``
for ``dirichlet``, ``K (n // (world K))`` for ``labels``; the few samples
left over are never used). An epoch is one pass of every worker over its own
shard, in an order drawn from (seed, epoch, rank): the same number of steps
on every rank (the collectives run in lockstep), every sample at most once
per epoch, and the position in the data is still (epoch, batch), so resume
is exact. The assignment depends on (seed, labels, world) alone, never on
the rank: every rank computes the same one, without communicating. The
global RNGs are not touched.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

__all__ = ["KINDS", "ALLOWED", "Split", "parse_split", "check_workload", "assign", "shard_order"]

KINDS = ("iid", "dirichlet", "labels")
#: what ``--split`` accepts, as error messages say it
ALLOWED = "iid, dirichlet:alpha=A (A > 0), labels:k=K (1 <= K <= the number of classes)"
#: streams of the split's own generators (numpy SeedSequence entropy after the seed)
_STREAM = {"dirichlet": 0x5D1, "labels": 0x1AB}


@dataclasses.dataclass(frozen=True)
class Split:
    """A parsed ``--split``: ``kind`` and its parameter (``alpha`` or ``k``)."""

    kind: str = "iid"
    alpha: float | None = None
    k: int | None = None

    def spec(self) -> str:
        """The canonical spec (what the summary and a checkpoint record)."""
        if self.kind == "dirichlet":
            return f"dirichlet:alpha={self.alpha!r}"
        if self.kind == "labels":
            return f"labels:k={self.k}"
        return "iid"


def _bad(value: Any, why: str) -> ValueError:
    return ValueError(f"split {value!r}: {why}; allowed: {ALLOWED}")


def parse_split(value: Any) -> Split:
    """Parse ``iid``, ``dirichlet:alpha=A`` or ``labels:k=K``; ValueError naming
    the field (``split``), the value and what is allowed otherwise."""
    if isinstance(value, Split):
        return value
    if not isinstance(value, str) or not value.strip():
        raise _bad(value, "must be a spec string")
    kind, _, rest = value.strip().partition(":")
    kind = kind.strip()
    if kind not in KINDS:
        raise _bad(value, f"unknown kind {kind!r}")
    params: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, val = item.partition("=")
        if not eq:
            raise _bad(value, f"parameter {item!r} is not key=value")
        params[key.strip()] = val.strip()
    want = {"iid": (), "dirichlet": ("alpha",), "labels": ("k",)}[kind]
    unknown = sorted(set(params) - set(want))
    if unknown:
        raise _bad(value, f"{kind!r} takes {' or '.join(want) or 'no parameters'}; got {', '.join(unknown)}")
    if kind == "iid":
        return Split()
    if want[0] not in params:
        raise _bad(value, f"{kind!r} needs {want[0]}=")
    raw = params[want[0]]
    if kind == "dirichlet":
        try:
            alpha = float(raw)
        except ValueError:
            raise _bad(value, f"alpha must be a number > 0, got {raw!r}") from None
        if not math.isfinite(alpha) or alpha <= 0:
            raise _bad(value, f"alpha must be a finite number > 0, got {raw}")
        return Split("dirichlet", alpha=alpha)
    try:
        k = int(raw)
    except ValueError:
        raise _bad(value, f"k must be an integer >= 1, got {raw!r}") from None
    if k < 1:
        raise _bad(value, f"k must be an integer >= 1, got {k}")
    return Split("labels", k=k)


def check_workload(split: Split, workload: str, has_labels: bool) -> None:
    """Refuse a label split for a workload whose targets are not class labels."""
    if split.kind != "iid" and not has_labels:
        raise ValueError(f"split: {split.spec()!r} deals samples by class label, and workload {workload!r} has no "
                         f"class labels (its targets are sequences); allowed for it: iid")


def _labels(y: torch.Tensor, split: Split) -> tuple[np.ndarray, np.ndarray]:
    """(labels as int64, the sorted distinct labels); ValueError for targets that are not one class label per
    sample, or a K above the number of classes."""
    if y.dim() != 1 or y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
        raise ValueError(f"split: {split.spec()!r} needs one integer class label per training sample; the targets "
                         f"have shape {tuple(y.shape)} and dtype {y.dtype}; allowed here: iid")
    labels = y.detach().cpu().numpy().astype(np.int64)
    classes = np.unique(labels)
    if split.kind == "labels" and split.k > len(classes):  # type: ignore[operator]
        raise ValueError(f"split: labels:k={split.k} asks for more labels per worker than the {len(classes)} "
                         f"classes of the training set; allowed: k from 1 to {len(classes)}")
    return labels, classes


def assign(split: Split, y: torch.Tensor, world: int, seed: int) -> list[torch.Tensor] | None:
    """Every worker's shard (sample indices, int64, one size on every worker), or None for ``iid``
    (the per-epoch slices of :func:`gradpress.train.loop.epoch_order`). Depends on (split, y, world,
    seed) only."""
    if split.kind == "iid":
        return None
    labels, classes = _labels(y, split)
    rng = np.random.Generator(np.random.PCG64([int(seed), _STREAM[split.kind]]))
    n = len(labels)
    if split.kind == "labels":
        shards = world * split.k  # type: ignore[operator]
        size = n // shards
        if size < 1:
            raise ValueError(f"split: labels:k={split.k} cuts the {n} training samples into {world} x {split.k} "
                             f"shards, which leaves a shard empty; allowed: k at most {max(n // world, 1)} here")
        keep = rng.permutation(n)[:shards * size]
        cut = keep[np.argsort(labels[keep], kind="stable")].reshape(shards, size)
        deal = rng.permutation(shards).reshape(world, split.k)  # type: ignore[arg-type]
        return [torch.from_numpy(cut[row].reshape(-1).copy()) for row in deal]
    return _dirichlet(split.alpha, labels, classes, world, rng)  # type: ignore[arg-type]


def _dirichlet(alpha: float, labels: np.ndarray, classes: np.ndarray, world: int,
               rng: np.random.Generator) -> list[torch.Tensor]:
    """The sequential fill of the module doc, computed in chunks of slots: the classes allowed (and so every
    worker's CDF) change only when a class runs out, so the slots up to that one are drawn at once."""
    n, c = len(labels), len(classes)
    code = np.searchsorted(classes, labels)
    counts = np.bincount(code, minlength=c)
    prior = counts / n
    q = rng.dirichlet(alpha * prior, size=world)  # world x C
    pools = [rng.permutation(np.flatnonzero(code == j)) for j in range(c)]
    per = n // world
    u = rng.random(per * world)  # slot s = t * world + w
    left = counts.copy()
    drawn = np.empty(per * world, dtype=np.int64)
    pos = 0
    while pos < len(drawn):
        allowed = left > 0
        weights = q * allowed
        empty = weights.sum(axis=1) <= 0
        weights[empty] = prior * allowed
        cdf = np.cumsum(weights, axis=1)
        chunk = min(len(drawn) - pos, max(64, 2**20 // c))
        worker = (pos + np.arange(chunk)) % world
        rows = cdf[worker]
        cls = (rows <= (u[pos:pos + chunk] * rows[:, -1])[:, None]).sum(axis=1)
        cls = np.minimum(cls, np.flatnonzero(allowed)[-1])  # u * total rounded up to the total
        used = np.cumsum(np.eye(c, dtype=np.int64)[cls], axis=0)[np.arange(chunk), cls]
        out = np.flatnonzero(used >= left[cls])  # the slot that takes a class's last sample
        stop = chunk if len(out) == 0 else int(out[0]) + 1
        got = cls[:stop]
        drawn[pos:pos + stop] = got
        np.subtract.at(left, got, 1)
        pos += stop
    # slot s takes the next sample of its class's shuffled pool: the i-th slot (in slot order) of class j
    # takes pools[j][i]
    order = np.argsort(drawn, kind="stable")
    by_class = drawn[order]
    within = np.arange(len(drawn)) - np.searchsorted(by_class, by_class)
    flat = np.concatenate(pools)
    offset = np.concatenate([[0], np.cumsum(counts)[:-1]])
    sample = np.empty(len(drawn), dtype=np.int64)
    sample[order] = flat[offset[by_class] + within]
    return [torch.from_numpy(sample[w::world].copy()) for w in range(world)]


def shard_order(shard: torch.Tensor, seed: int, epoch: int, rank: int) -> torch.Tensor:
    """This rank's shard in the order of ``epoch`` (its own generator: the global RNG is not touched)."""
    mixed = ((seed * 1_000_003 + epoch * 7919 + 17) * 65_537 + rank * 104_729 + 3) % (2**63 - 1)
    g = torch.Generator().manual_seed(mixed)
    return shard[torch.randperm(len(shard), generator=g)]

