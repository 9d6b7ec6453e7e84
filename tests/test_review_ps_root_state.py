"""The PS root's re-encoding compressor keeps its state in the engine's
compressor, also after that state was reloaded (a checkpoint, or the
snapshot ``nonfinite='skip'`` restores after a dropped step).

``ps`` re-encodes each partial sum with a densified copy of the compressor
(``ratio * N``); a stateful estimator's per-key state of the root
(``redsync``'s warm-start positions under ``<key>#ps``) must live in the
compressor whose ``state_dict`` a checkpoint holds. A copy made once and
cached kept the dicts the compressor had *before* a ``load_state_dict``, so
after a skipped step the root learned into a detached dict: the checkpoint
lost it and a resumed run diverged from the one that did not stop.
"""

from __future__ import annotations

import io

import torch
from distributed import run_workers

from gradpress.exchange import Synchronizer

SHAPES = [(64, 40), (48, 33)]
KEYS = ["w", "v"]


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    # heavier tails from step 2 on: the root's warm-start position moves far from step 0's
    return [torch.randn(s, generator=g) ** (3 if step >= 2 else 1) for s in SHAPES]


def _engine() -> Synchronizer:
    return Synchronizer("redsync:ratio=0.01", params=[(k, s, torch.float32) for k, s in zip(KEYS, SHAPES)],
                        strategy="ps", min_numel=0, nonfinite="skip")


def _resume_after_skip(rank: int, world: int) -> dict:
    a = _engine()
    for step in range(4):
        g = _grads(rank, step)
        if step == 1 and rank == 1:
            g[0][0, 0] = float("nan")  # dropped on every rank: the compressor state snapshot is restored
        a.sync(KEYS, g, step=step)
    skipped_once = a.stats["skipped_steps"] == 1
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = _engine()
    b.load_state_dict(torch.load(buf, weights_only=True))
    same = []
    for step in range(4, 8):
        ga, gb = _grads(rank, step), _grads(rank, step)
        a.sync(KEYS, ga, step=step)  # the run that did not stop
        b.sync(KEYS, gb, step=step)  # the run resumed from its checkpoint
        same.append(all(torch.equal(x, y) for x, y in zip(ga, gb)))
    return {"skipped_once": skipped_once, "same": same}


def test_ps_root_state_survives_skip_and_checkpoint() -> None:
    for r, out in enumerate(run_workers(_resume_after_skip, 2)):
        assert out["skipped_once"], out
        assert all(out["same"]), f"rank {r}: resumed run differs from the uninterrupted one at steps 4..7: {out['same']}"
