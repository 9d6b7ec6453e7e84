"""An ordinary DDP training script adopting gradpress (2 gloo workers).

* A compression state is per rank (residuals differ between ranks). The
  common DDP pattern ``if rank == 0: torch.save(...)``, then every rank
  loading that one file, handed rank 0's residuals to every rank: the hook
  and the algorithms accepted another rank's state silently (rank 0's
  residual fed back twice, rank 1's lost). Now refused, naming ``rank``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from distributed import run_workers
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)


def _hook_states(rank: int, world: int) -> dict:
    """Train a few steps through the hook, gather every rank's state; then each
    rank loads (a) its own state, (b) the other rank's, into a fresh hook."""
    model = _model()
    ddp = DDP(model)
    hook = gradpress.ddp.register(ddp, "topk:ratio=0.1", min_numel=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = _data(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    everyone: list = [None] * world
    torch.distributed.all_gather_object(everyone, hook.state_dict())
    hook.close()
    out = {}
    for label, source in (("own", rank), ("other", (rank + 1) % world)):
        fresh = gradpress.ddp.register(DDP(_model()), "topk:ratio=0.1", min_numel=16)
        try:
            fresh.load_state_dict(everyone[source])
            out[label] = "accepted"
        except ValueError as exc:
            out[label] = str(exc)
        fresh.close()
    return out


def _algorithm_states(rank: int, world: int) -> dict:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algo = gradpress.algorithms.create("localsgd:period=2", model, opt, compressor="topk:ratio=0.1", min_numel=16)
    for step in range(STEPS + 1):
        x, y = _data(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        algo.step()
    everyone: list = [None] * world
    torch.distributed.all_gather_object(everyone, algo.state_dict())
    out = {}
    for label, source in (("own", rank), ("other", (rank + 1) % world)):
        m = _model()
        fresh = gradpress.algorithms.create("localsgd:period=2", m, torch.optim.SGD(m.parameters(), lr=0.1),
                                            compressor="topk:ratio=0.1", min_numel=16)
        try:
            fresh.load_state_dict(everyone[source])
            out[label] = "accepted"
        except ValueError as exc:
            out[label] = str(exc)
    return out


@pytest.mark.parametrize("which", [_hook_states, _algorithm_states], ids=["hook", "algorithm"])
def test_another_ranks_compression_state_is_refused_naming_the_rank(which) -> None:  # noqa: ANN001
    results = run_workers(which, 2)
    for rank, res in enumerate(results):
        assert res["own"] == "accepted", f"rank {rank}: its own state was refused: {res['own']}"
        other = (rank + 1) % 2
        assert res["other"] != "accepted", f"rank {rank} silently loaded rank {other}'s compression state"
        assert "rank" in res["other"] and f"saved by rank {other}" in res["other"] \
            and f"loaded on rank {rank}" in res["other"], res["other"]
