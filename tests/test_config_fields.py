"""Every configuration field has its own mismatch test, and resume works
under every strategy (gloo, 2 workers).

* Cross-rank check: for each field of ``Synchronizer.config()`` that can
  differ between ranks, rank 1 asks for another value, through
  ``gradpress.ddp.register`` and through ``gradpress.algorithms.create``:
  every rank raises ``ValueError`` naming the field.
* Checkpoint check: a state saved under the base configuration is refused by
  an engine, a hook and an algorithm built with one field changed, naming it
  (``world_size``: a state from 2 ranks loaded on a group of 1).
* The list of fields is checked against ``config()`` itself, so a new field
  without a mismatch test fails here.
* Resume (engine, float32, error feedback on): stop after 3 steps, restore
  into a fresh engine, the next 3 steps are bit-identical, under
  ``allreduce``, ``allgather``, ``ring``, ``ps``, ``collective`` and
  ``auto``; under ``auto`` the plan had been changed by a ``replan`` after
  construction, so only a restored plan (partitions and strategies the
  residuals are keyed by) continues exactly.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers

import gradpress
import gradpress.algorithms as algorithms
from gradpress.exchange import Synchronizer

pytestmark = pytest.mark.mutants

SHAPES = {"w": (33, 10), "v": (9, 7), "b": (5,)}
#: the link of tests/test_strategies.py on which the PS with K > 1 partitions wins
PS_LINK = {
    "allreduce": (2e-4, 2e-4, 1e-6), "allgather": (2e-4, 2e-4, 4e-6), "broadcast": (5e-5, 5e-5, 1e-8),
    "p2p": (2e-4, 2e-4, 1e-6), "encode": (1e-5, 1e-5, 1e-9), "decode": (1e-5, 1e-5, 1e-9),
    "wire": (0.0, 0.0, 1.0), "root_wire": (0.0, 0.0, 1.0),
}
#: a link where one allgather beats everything else
AG_LINK = dict(PS_LINK, allgather=(1e-6, 1e-6, 1e-12), p2p=(1e-2, 1e-2, 1e-5), broadcast=(1e-2, 1e-2, 1e-5))

BASE = {"spec": "topk:ratio=0.1", "error_feedback": None, "strategy": "collective", "min_numel": 16,
        "nonfinite": "propagate", "seed": 0}
#: field -> (options of the base run, options of the other rank / the resumed run)
VARIANTS: dict[str, tuple[dict, dict]] = {
    "compressor": ({}, {"spec": "topk:ratio=0.2"}),
    "error_feedback": ({}, {"error_feedback": False}),
    "strategy": ({}, {"strategy": "ring"}),
    "min_numel": ({}, {"min_numel": 32}),
    "nonfinite": ({}, {"nonfinite": "skip"}),
    "seed": ({}, {"seed": 5}),
    "plan_costs": ({"strategy": "auto", "plan_costs": PS_LINK}, {"strategy": "auto", "plan_costs": AG_LINK}),
    "parameters": ({}, {"shapes": {"w": (33, 11)}}),
    "world_size": ({}, {"world": 1}),
}
CROSS_RANK = [f for f in VARIANTS if f != "world_size"]  # ranks of one group share their world size
#: algorithms measure the live group under auto: they take no injected costs
NO_ALGORITHM = {"plan_costs"}


def options(field: str, variant: bool) -> dict:
    opts = dict(BASE)
    opts.update(VARIANTS[field][1 if variant else 0])
    return opts


def shapes_of(opts: dict) -> dict:
    return {**SHAPES, **opts.get("shapes", {})}


def engine_kwargs(opts: dict) -> dict:
    kw = {k: opts[k] for k in ("error_feedback", "strategy", "min_numel", "nonfinite", "seed")}
    if "plan_costs" in opts:
        kw["plan_costs"] = opts["plan_costs"]
    return kw


class Model(torch.nn.Module):
    def __init__(self, shapes: dict) -> None:
        super().__init__()
        torch.manual_seed(0)
        for k, s in shapes.items():
            self.register_parameter(k, torch.nn.Parameter(torch.randn(s)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((p * x).sum() for p in self.parameters())


def grads(rank: int, step: int, shapes: dict) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(s, generator=g) for s in shapes.values()]


def build_engine(opts: dict, group=None) -> Synchronizer:  # noqa: ANN001
    shapes = shapes_of(opts)
    return Synchronizer(opts["spec"], params=[(k, s, torch.float32) for k, s in shapes.items()], group=group,
                        **engine_kwargs(opts))


def _catch(fn) -> str:  # noqa: ANN001
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "no error"


def _cross_rank(rank: int, field: str) -> dict:
    opts = options(field, variant=rank == 1)
    out = {}
    if field != "parameters":  # DDP itself refuses models of other shapes, before gradpress sees them
        def hook() -> None:
            ddp = torch.nn.parallel.DistributedDataParallel(Model(SHAPES))
            h = gradpress.ddp.register(ddp, opts["spec"], **engine_kwargs(opts))
            h.close()
        out["hook"] = _catch(hook)

    def algo() -> None:
        model = Model(shapes_of(opts))
        algorithms.create("localsgd:period=2", model, torch.optim.SGD(model.parameters(), lr=0.1),
                          compressor=opts["spec"], **engine_kwargs(opts))
    if field not in NO_ALGORITHM:
        out["algorithm"] = _catch(algo)
    return out


def _checkpoint(rank: int, field: str, group1) -> dict:  # noqa: ANN001
    base = options(field, variant=False)
    other = options(field, variant=True)
    engine = build_engine(base)
    engine.sync(list(shapes_of(base)), grads(rank, 0, shapes_of(base)), step=0)
    state = engine.state_dict()
    out = {}
    if other.get("world") == 1:
        fresh = build_engine(base, group=group1) if group1 is not None else None
        out["engine"] = _catch(lambda: fresh.load_state_dict(state)) if fresh is not None else None
        return out
    out["engine"] = _catch(lambda: build_engine(other).load_state_dict(state))
    # the hook and an algorithm refuse the same state in their own formats
    ddp = torch.nn.parallel.DistributedDataParallel(Model(shapes_of(base)))
    h = gradpress.ddp.register(ddp, base["spec"], **engine_kwargs(base))
    hook_state = h.state_dict()
    h.close()
    if field != "parameters":
        ddp2 = torch.nn.parallel.DistributedDataParallel(Model(shapes_of(other)))
        h2 = gradpress.ddp.register(ddp2, other["spec"], **engine_kwargs(other))
        out["hook"] = _catch(lambda: h2.load_state_dict(hook_state))
        h2.close()
    if field in NO_ALGORITHM:
        return out
    model = Model(shapes_of(base))
    a = algorithms.create("localsgd:period=2", model, torch.optim.SGD(model.parameters(), lr=0.1),
                          compressor=base["spec"], **engine_kwargs(base))
    algo_state = a.state_dict()
    model2 = Model(shapes_of(other))
    a2 = algorithms.create("localsgd:period=2", model2, torch.optim.SGD(model2.parameters(), lr=0.1),
                           compressor=other["spec"], **engine_kwargs(other))
    out["algorithm"] = _catch(lambda: a2.load_state_dict(algo_state))
    return out


RESUME = [
    ("allreduce", "fp16", {"error_feedback": True}),
    ("allreduce", "randomk:ratio=0.3", {}),
    ("allgather", "topk:ratio=0.1", {}),
    ("ring", "topk:ratio=0.1", {}),
    ("ps", "topk:ratio=0.1", {}),
    ("ps", "qsgd:levels=4", {"error_feedback": True}),
    ("collective", "powersgd:rank=2,start_iter=1", {}),
    ("auto", "topk:ratio=0.1", {"plan_costs": AG_LINK}),
]


def _resume(rank: int, strategy: str, spec: str, kw: dict) -> dict:
    keys = list(SHAPES)

    def build() -> Synchronizer:
        e = Synchronizer(spec, params=[(k, s, torch.float32) for k, s in SHAPES.items()], strategy=strategy,
                         min_numel=16, seed=3, **kw)
        return e

    def run(e: Synchronizer, start: int, stop: int) -> list[list[torch.Tensor]]:
        out = []
        for step in range(start, stop):
            ts = grads(rank, step, SHAPES)
            e.sync(keys, ts, step=step)
            out.append(ts)
        return out

    engine = build()
    fresh_plan = engine.plan.to_dict()
    if strategy == "auto":
        engine.replan(PS_LINK)  # the plan the residuals will be keyed by differs from a fresh engine's
    run(engine, 0, 3)
    buf = io.BytesIO()
    torch.save(engine.state_dict(), buf)
    straight = run(engine, 3, 6)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    again_engine = build()
    again_engine.load_state_dict(saved)
    again = run(again_engine, 3, 6)
    return {"straight": straight, "again": again, "fresh_plan": fresh_plan, "saved_plan": saved["plan"],
            "restored_plan": again_engine.plan.to_dict(),
            "residual_keys": sorted(saved["feedback"]["residuals"]),
            "residual_norm": sum(float(v.abs().sum()) for v in saved["feedback"]["residuals"].values())}


def _worker(rank: int, world: int) -> dict:
    group1 = dist.new_group(ranks=[0])  # every rank takes part in creating it
    out: dict = {"config_fields": sorted(build_engine(BASE).config())}
    for field in CROSS_RANK:
        out[("cross", field)] = _cross_rank(rank, field)
    for field in VARIANTS:
        out[("checkpoint", field)] = _checkpoint(rank, field, group1 if rank == 0 else None)
    for strategy, spec, kw in RESUME:
        out[("resume", strategy, spec)] = _resume(rank, strategy, spec, kw)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, 2)


def test_every_config_field_has_a_variant(results: list[dict]) -> None:
    assert results[0]["config_fields"] == sorted(VARIANTS), "a configuration field has no mismatch test"


def _names(message: str, field: str) -> bool:
    if field == "parameters":
        return "parameter" in message
    return f"{field}=" in message or f"{field}:" in message


@pytest.mark.parametrize("field", CROSS_RANK)
def test_cross_rank_mismatch_names_the_field(results: list[dict], field: str) -> None:
    for r, res in enumerate(results):
        for path, message in res[("cross", field)].items():
            assert "differs between ranks" in message, (field, path, r, message)
            assert _names(message, field), (field, path, r, message)


@pytest.mark.parametrize("field", list(VARIANTS))
def test_checkpoint_of_another_configuration_is_refused_naming_the_field(results: list[dict], field: str) -> None:
    for r, res in enumerate(results):
        for path, message in res[("checkpoint", field)].items():
            if message is None:  # world_size: only rank 0 holds a group of 1
                continue
            assert "different configuration" in message, (field, path, r, message)
            assert _names(message, field), (field, path, r, message)


@pytest.mark.parametrize("case", RESUME, ids=lambda c: f"{c[0]}-{c[1]}")
def test_resume_is_bit_identical_under_every_strategy(results: list[dict], case) -> None:  # noqa: ANN001
    strategy, spec, _ = case
    for r, res in enumerate(results):
        out = res[("resume", strategy, spec)]
        assert out["residual_norm"] > 0 or spec.startswith("powersgd"), "no state saved: the test proves nothing"
        for a_step, b_step in zip(out["straight"], out["again"]):
            for a, b in zip(a_step, b_step):
                assert torch.equal(a, b), (case, r)
        if strategy == "auto":
            assert out["saved_plan"] != out["fresh_plan"], "replan changed nothing: the test proves nothing"
            assert out["restored_plan"] == out["saved_plan"]
