"""Random algorithm x compressor x strategy configurations on 2 and 3 gloo
workers (a seeded fuzz of the algorithms layer).

Each case draws an algorithm with small parameters (periods of 1-4 steps, a
freeze or switch within the run, each of its documented options), a
compressor (none, the algorithm's default, or any registered one with its
small test spec), a strategy and an optimizer, and trains a small model with
BatchNorm for 5 steps, saves model, optimizer and algorithm through
``torch.load(weights_only=True)``, trains 5 more, and replays those 5 from
the checkpoint in fresh objects. Checked against what the test states:

* a configuration is either built on every rank or refused on every rank
  with a ``ValueError`` (never a crash, never on some ranks only);
* parameters and buffers stay finite;
* the resumed run is bit-identical to the straight one (the checkpoint holds
  all state).

The suite runs 2 x 24 seeded cases; ``-m long`` runs 400 more.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterable

import pytest
import torch
from distributed import checkpoint, restore
from fuzzing import check_cases, raised, run_cases
from test_compressors import spec_for

import gradpress.algorithms as algorithms
from gradpress.compress import registry

ALGORITHMS = {
    "localsgd": ["period=2", "period=3,optimizer_state=average", "period=1"],
    "postlocalsgd": ["period=2,switch=3", "period=3,switch=2,warmup=2"],
    "diloco": ["period=2", "period=3,outer_momentum=0.5,keep_residual=true", "period=2,residual_decay=0.8",
               "period=2,switch=3", "period=2,switch=2,switch_exchange=dense,inner_state=reset",
               "period=3,select=model,evaluate=average"],
    "streaming-diloco": ["period=4,fragments=2,overlap=1", "period=3,fragments=2,overlap=0,alpha=0"],
    "lsgd": ["tau=2,c=0.5", "tau=2,c=1", "tau=3,c=0.25,average=true", "tau=2,groups=2,tau_global=4,window=2"],
    "sgp": ["peers=1", "peers=1,overlap=1"],
    "choco": ["gamma=0.5", "gamma=0.3,topology=complete"],
    "dpsgd": ["topology=ring", "topology=complete"],
    "comprex": ["staleness=1", "staleness=0", "staleness=2,lookahead=off", "staleness=1,update=optimizer",
                "staleness=1,warmup=3,stages=2,schedule=linear,rebroadcast_every=3"],
    "onebit_adam": ["freeze_step=3", "freeze_step=2,bias_correction=false"],
    "zeroone_adam": ["var_freeze_step=4,local_step_clipper=2,local_step_scaler=2", "var_freeze_step=100"],
    "lgc": ["dense_steps=2,ae_steps=2,ratio=0.1", "dense_steps=1,ae_steps=2,ratio=0.1,variant=ps"],
    "scaffold": ["period=2", "period=3,control=displacement", "period=2,warmup=3,global_lr=0.8"],
}
STRATEGIES = [None, "collective", "allgather", "ring", "ps", "hierarchical:workers_per_host=1", "union", "auto"]
CUT, STEPS = 5, 10


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(12, 48)
        self.bn = torch.nn.BatchNorm1d(48)
        self.b = torch.nn.Linear(48, 40)
        self.c = torch.nn.Linear(40, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.relu(self.bn(self.a(x))))))


def draw_case(seed: int, only: list[str] | None = None) -> dict:
    """A case of ``seed``; with ``only``, its algorithm spec is one of those (:func:`check_algorithm_specs`)."""
    rnd = random.Random(seed)
    if only is None:
        name = rnd.choice(sorted(ALGORITHMS))
        spec = f"{name}:{rnd.choice(ALGORITHMS[name])}"
    else:
        spec = rnd.choice(only)
        name = spec.split(":")[0]
    return {"seed": seed, "spec": spec,
            "compressor": rnd.choice([None, None, *[spec_for(n) for n in registry.names()]]),
            "strategy": rnd.choice(STRATEGIES), "min_numel": rnd.choice([0, 64, 1024]),
            "optimizer": "adam" if name.endswith("adam") else rnd.choice(["sgd", "momentum", "adam"])}


def build(rank: int, case: dict):  # noqa: ANN201
    torch.manual_seed(case["seed"])
    model = Net()
    if rank == 1:  # other initial weights: every algorithm starts from rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    if case["optimizer"] == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9 if case["optimizer"] == "momentum" else 0.0)
    kw = {k: case[k] for k in ("compressor", "strategy") if case[k] is not None}
    return model, opt, algorithms.create(case["spec"], model, opt, min_numel=case["min_numel"], **kw)


def train(rank: int, model, opt, algo, start: int, stop: int, seed: int) -> torch.Tensor:  # noqa: ANN001
    for step in range(start, stop):
        gen = torch.Generator().manual_seed(seed * 1000 + step * 10 + rank)
        x, y = torch.randn(16, 12, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        opt.zero_grad()
        model.train()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        algo.step()
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()]
                     + [b.detach().reshape(-1).double() for b in model.buffers()])


def _worker(rank: int, world: int, seeds: list[int], only: list[str] | None = None) -> list[dict]:
    def run(case: dict, res: dict) -> None:
        seed = case["seed"]
        try:
            model, opt, algo = build(rank, case)
        except ValueError as exc:
            res["refused"] = str(exc)
            return
        train(rank, model, opt, algo, 0, CUT, seed)
        saved = checkpoint(algo=algo, model=model, opt=opt)
        res["straight"] = train(rank, model, opt, algo, CUT, STEPS, seed)
        algo.close()
        model, opt, algo = build(rank, case)
        restore(saved, model=model, opt=opt, algo=algo)
        res["again"] = train(rank, model, opt, algo, CUT, STEPS, seed)
        algo.close()

    return run_cases(seeds, functools.partial(draw_case, only=only), run)


def problems(per_rank: list[dict]) -> list[str]:
    if raised(per_rank):
        return raised(per_rank)
    refused = ["refused" in r for r in per_rank]
    if any(refused):
        return [] if all(refused) else ["refused on some ranks only"]
    found = []
    for rank, r in enumerate(per_rank):
        if not torch.isfinite(r["straight"]).all():
            found.append(f"rank {rank}: non-finite parameters")
        elif not torch.equal(r["straight"], r["again"]):
            diff = (r["straight"] - r["again"]).abs().max().item()
            found.append(f"rank {rank}: the resumed run differs (max {diff:.3g})")
    return found


def _check(world: int, seeds: list[int], only: list[str] | None = None) -> None:
    check_cases(functools.partial(_worker, only=only), problems, world, seeds, least=len(seeds) // 3,
                accepted=lambda r: "refused" not in r)


def check_algorithm_specs(specs: list[str], world: int, seeds: Iterable[int]) -> None:
    """This fuzz on algorithm specs of your own (a plugin's, docs/authoring-algorithms.md): each case one of
    ``specs`` with a drawn compressor, strategy, ``min_numel`` and optimizer, on ``world`` gloo workers, held
    to :func:`problems` (built or refused on every rank, finite, resumed bit-identically mid-run). A plugin
    algorithm needs ``$GRADPRESS_PLUGINS`` naming its module when this is called: the workers load it from
    there (tests/test_plugins.py runs this on its plugin)."""
    _check(world, list(seeds), list(specs))


@pytest.mark.parametrize("world,seeds", [(2, range(0, 24)), (3, range(1000, 1024))])
def test_random_algorithm_configurations(world: int, seeds: range) -> None:
    _check(world, list(seeds))


@pytest.mark.long
@pytest.mark.parametrize("world,seeds", [(2, range(2000, 2200)), (3, range(3000, 3200))])
def test_random_algorithm_configurations_long(world: int, seeds: range) -> None:
    _check(world, list(seeds))
