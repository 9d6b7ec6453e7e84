"""The exchange engine's ``nonfinite="propagate"`` contract (gloo, 2 and 3 workers).

README, ``nonfinite``: "``propagate`` (default: a NaN/Inf on any rank reaches
every rank's gradient, so ``GradScaler`` skips the same step everywhere)".
The engine learns every rank's NaN/Inf flags in the prelude and, after the
compressed exchange, marks the flagged tensors NaN on every rank
(``exchange/engine.py:_sync``). A compressor can drop the NaN itself before
it travels: ``threshold`` keeps entries with ``|x| > tau`` and ``NaN > tau``
is false, so without that marking the other ranks would see a finite
average and step on while the NaN's rank would not. Written for a survivor
of ``make mutants`` (``engine`` group: the propagate branch never taken);
the expected values come from the contract, not from the code.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import worlds_fixture

from gradpress.exchange import Synchronizer

pytestmark = pytest.mark.mutants

SHAPES = {"w": (6, 5), "v": (4, 4), "b": (3,)}
KEYS = list(SHAPES)
STRATEGIES = ("allgather", "ring", "ps", "cyclic", "union")
SPEC = "threshold:tau=0.5"
BAD_STEP = 1


def grads(rank: int, world: int, step: int) -> list[torch.Tensor]:
    """Finite gradients, except one NaN in ``w`` on the last rank at BAD_STEP."""
    g = torch.Generator().manual_seed(97 * step + rank)
    out = [torch.randn(s, generator=g) for s in SHAPES.values()]
    if step == BAD_STEP and rank == world - 1:
        out[0][2, 3] = float("nan")
    return out


def _worker(rank: int, world: int) -> dict:
    out = {}
    for strategy in STRATEGIES:
        engine = Synchronizer(SPEC, params=[(k, s, torch.float32) for k, s in SHAPES.items()], strategy=strategy,
                              min_numel=8, nonfinite="propagate")
        steps = []
        for step in range(BAD_STEP + 1):
            tensors = grads(rank, world, step)
            engine.sync(KEYS, tensors, step=step)
            steps.append([t.clone() for t in tensors])
        out[strategy] = steps
    dist.barrier()
    return out


world_results = worlds_fixture(_worker)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_propagate_marks_the_nan_tensor_on_every_rank(world_results, strategy: str) -> None:  # noqa: ANN001
    """Invariant: at the step where one rank's ``w`` holds a NaN, every rank's
    ``w`` holds a NaN (even though the compressor dropped it), and the other
    tensors stay finite and bit-identical on every rank; the step before is
    finite everywhere."""
    world, res = world_results
    for r in range(world):
        before, bad = res[r][strategy]
        assert all(bool(torch.isfinite(t).all()) for t in before), (strategy, r, "finite step")
        assert bool(torch.isnan(bad[0]).any()), (strategy, r, "the NaN of the last rank did not reach this rank")
        for i in (1, 2):
            assert bool(torch.isfinite(bad[i]).all()), (strategy, r, KEYS[i])
            assert torch.equal(bad[i], res[0][strategy][BAD_STEP][i]), (strategy, r, KEYS[i])
