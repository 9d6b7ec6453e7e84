"""DDP's rule for a parameter whose ``.grad`` is None, for the algorithms
that average gradients (or momenta) every step: the ranks agree on which
parameters some rank has a contribution for, with one flag per parameter
riding in the exchange the step makes anyway (a 1-D tensor under
:data:`PRESENT_KEY`, which the engine sends in its plain allreduce: no
collective of its own). Missing on every rank: the parameter is left alone
(DDP leaves its ``.grad`` untouched, so the optimizer skips it); missing on
some ranks only: a zero contribution there (DDP's average).

Used by :meth:`gradpress.algorithms.base.Algorithm.ddp_step` (the
synchronous start of ``postlocalsgd`` and DiLoCo) and by the compressed
Adam variants (:mod:`gradpress.algorithms.compressed_adam`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gradpress.exchange.feedback import owner_among

if TYPE_CHECKING:
    from gradpress.algorithms.base import Algorithm

__all__ = ["PRESENT_KEY", "agreed", "flags", "sync_agreeing"]

#: the key under which an exchange carries the per-parameter "has a contribution" flags (1-D: uncompressed)
PRESENT_KEY = "gradpress/present"


def flags(mine: list[bool], like: torch.Tensor) -> torch.Tensor:
    """``mine`` as a 1-D tensor of 1s and 0s (``like``'s dtype and device), to be summed over ranks."""
    return torch.tensor([float(b) for b in mine], dtype=like.dtype).to(like.device, non_blocking=True)


def agreed(mine: list[bool], summed: torch.Tensor | None) -> list[bool]:
    """Per parameter: whether some rank has it, from this rank's ``mine``
    and the flags ``summed`` (or averaged) over ranks. A rank that has every
    parameter knows the answer (all) and reads nothing back; one that lacks
    some reads the flags (one host read, that case only)."""
    if all(mine) or summed is None:
        return [True] * len(mine)
    return (summed > 0).tolist()


def sync_agreeing(algo: Algorithm, tensors: list[torch.Tensor], mine: list[bool],
                  keys: list[str] | None = None,
                  extra: Sequence[tuple[str, torch.Tensor]] = ()) -> list[bool] | None:
    """Average ``tensors`` (one per trainable parameter, engine keys ``keys``,
    default the parameters' names) through ``algo``'s engine, with ``mine``
    (whether this rank has each parameter's contribution) summed over ranks
    in the same call. Returns which parameters some rank has (the same list
    on every rank), or None when the engine dropped the call
    (``nonfinite='skip'``). A parameter no rank has was exchanged too (every
    rank must issue the same collectives before it knows); its residuals
    (worker and strategies': every key of the parameter) are put back as
    they were and the caller leaves the rest of it alone, so for it the call
    changed nothing but the compressor's own state (e.g. PowerSGD's warm
    start) and the bytes counted. ``extra``: (key, 1-D tensor) pairs that
    ride in the same call, averaged in place (plain)."""
    engine = algo.engine
    names = keys if keys is not None else [n for n, _ in algo.named]
    assert engine is not None
    if not tensors:
        return []
    fb = engine.feedback
    kept = {}
    known = set(names)  # a store key's owner is looked up among them ('pd.w#0' is no partition of 'pd.w')
    if not all(mine) and fb is not None:  # what the call may change for a parameter that no rank has
        lacking = {n for n, ok in zip(names, mine) if not ok}
        kept = {k: v.clone() for k, v in fb.residuals.items() if owner_among(k, known) in lacking}
    present_flags = flags(mine, tensors[0])
    algo.sync([*tensors, present_flags, *(t for _, t in extra)], keys=[*names, PRESENT_KEY, *(k for k, _ in extra)])
    if engine.last_step_skipped:
        return None
    present = agreed(mine, present_flags)
    gone = {n for n, ok in zip(names, present) if not ok}
    if gone and fb is not None:
        for k in [k for k in fb.residuals if owner_among(k, known) in gone]:
            del fb.residuals[k]
        fb.residuals.update(kept)
    return present
