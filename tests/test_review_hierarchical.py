"""Review of ``hierarchical``: 4 gloo workers as 2 hosts x 2, the strategy
called directly; references in float64 here."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers

WORLD, PER_HOST = 4, 2
MIXED = [((30, 10), torch.float16), ((50,), torch.float32)]
STEPS = 3
#: ``auto`` costs under which a flat strategy beats hierarchical (no fast link inside hosts is declared)
FLAT_WINS = {
    "allreduce": (2e-4, 2e-4, 1e-7), "allgather": (2e-4, 2e-4, 2e-7), "broadcast": (2e-4, 2e-4, 1e-7),
    "p2p": (2e-4, 2e-4, 1e-7), "encode": (2e-5, 2e-5, 5e-9), "decode": (1e-5, 1e-5, 2e-9),
    "wire": (0.0, 0.0, 0.5), "root_wire": (0.0, 0.0, 0.5),
}


def _grads(rank: int, spec: list) -> list[torch.Tensor]:  # noqa: ANN001
    gen = torch.Generator().manual_seed(rank + 7)
    return [(torch.randn(s, generator=gen, dtype=torch.float64) * (rank + 1)).to(d) for s, d in spec]


def _call(rank: int, spec: str, compressor: str, grads: list[torch.Tensor]) -> tuple:
    from gradpress.compress import create
    from gradpress.compress.base import Context
    from gradpress.exchange.base import parse_strategy
    from gradpress.exchange.strategies.hierarchical import Hierarchical

    strategy = Hierarchical(None, **parse_strategy(spec)[1])
    ctxs = [Context(key=f"k{i}", rank=rank, world_size=WORLD) for i in range(len(grads))]
    res = strategy.exchange(create(compressor), grads, ctxs, None)
    return [t.clone() for t in res.tensors], res.bytes_sent, res.host_bytes, list(res.tensor_bytes)


def _hook_calls(rank: int, compressor: str, strategy: str, **kw) -> dict:  # noqa: ANN003
    """A few DDP steps (several buckets) through the hook: whether it
    coalesced, the engine calls per step, the strategies the plan uses and
    whether each of the engine's strategies pipelines this compressor."""
    import gradpress

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4))
    # 2 buckets: DDP closes one once it holds >= 4 KiB (the last three parameters' 17.7 KB, then the first two)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)
    hook = gradpress.ddp.register(ddp, compressor, strategy=strategy, min_numel=200, **kw)
    engine, calls = hook.engine, [0]
    sync = engine.sync

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        return sync(*args, **kwargs)

    engine.sync = counted  # type: ignore[method-assign]
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    per_step = []
    for _ in range(STEPS):
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        opt.zero_grad()
        before = calls[0]
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        per_step.append(calls[0] - before)
    # after the first step (DDP rebuilds its buckets then)
    out = {"coalescing": hook.coalescing, "calls_per_step": max(per_step[1:]) if min(per_step[1:]) == max(per_step[1:]) else per_step,
           "planned": sorted({d.strategy for d in engine.plan.decisions.values() if d.compressed}),
           "pipelines": {name: s.pipelines(engine.compressor) if hasattr(s, "pipelines") else None
                         for name, s in engine.strategies.items()}}
    hook.close()
    return out


def _worker(rank: int, world: int) -> dict:
    out = {}
    for chunk in (0, 64):
        spec = f"hierarchical:workers_per_host={PER_HOST},chunk={chunk}"
        out[f"mixed{chunk}"] = _call(rank, spec, "none", _grads(rank, MIXED))
    spec = f"hierarchical:workers_per_host={PER_HOST},chunk=256"
    out["hook"] = {
        "pipelined": _hook_calls(rank, "qsgd:levels=8", spec),
        "ring": _hook_calls(rank, "topk:ratio=0.1", spec + ",outer=ring"),
        "one_host": _hook_calls(rank, "qsgd:levels=8", f"hierarchical:workers_per_host={WORLD},chunk=256"),
        "powersgd": _hook_calls(rank, "powersgd:rank=1", spec),
    }
    os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"] = str(PER_HOST), str(rank % PER_HOST)
    out["hook"]["auto"] = _hook_calls(rank, "qsgd:levels=8", "auto", plan_costs=FLAT_WINS)
    del os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"]
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


@pytest.mark.parametrize("chunk", [0, 64])
def test_mixed_dtypes_keep_their_dtype_and_bytes(results: list[dict], chunk: int) -> None:
    """An fp16 tensor beside an fp32 one: the unpipelined path fused both into
    one promoted (fp32) buffer, so the fp16 result came back fp32 and its
    host bytes and packets counted (and moved) twice its size."""
    per = [_grads(r, MIXED) for r in range(WORLD)]
    refs = [sum(p[i].double() for p in per) / WORLD for i in range(len(MIXED))]
    dense = sum(t.numel() * t.element_size() for t in per[0])  # 600 + 200
    for rank, r in enumerate(results):
        tensors, sent, host, tensor_bytes = r[f"mixed{chunk}"]
        for t, ref, (shape, dtype) in zip(tensors, refs, MIXED):
            assert t.dtype == dtype and tuple(t.shape) == shape
            tol = 4e-3 if dtype == torch.float16 else 1e-6
            assert torch.allclose(t.double(), ref, atol=tol, rtol=0)
            assert torch.equal(t, results[0][f"mixed{chunk}"][0][MIXED.index((shape, dtype))])
        leader = rank % PER_HOST == 0
        assert host == dense * (2 if leader else 1)
        # 'none' between two leaders: an allreduce of the dense host means
        assert sent == (3 * dense if leader else dense)
        assert tensor_bytes == [t.numel() * t.element_size() for t in per[0]]


def test_the_hook_coalesces_only_when_hierarchical_pipelines(results: list[dict]) -> None:
    """``chunk > 0``: a step's buckets are averaged in one engine call only
    when the call pipelines (one-round compressor, allreduce/allgather
    between leaders, more than one host). With ``outer=ring``, on one host
    or under ``auto`` with hierarchical a candidate the plan does not use,
    each bucket is its own call (the exchange overlaps backward). PowerSGD
    does not pipeline either; the hook coalesces it by its own rule for
    multi-round compressors (docs/strategies.md)."""
    for r, res in enumerate(results):
        hook = res["hook"]
        # 2 buckets per step: one engine call per step when coalesced, one per bucket otherwise
        assert [(hook[n]["coalescing"], hook[n]["calls_per_step"]) for n in ("pipelined", "ring", "one_host", "auto")] \
            == [(True, 1), (False, 2), (False, 2), (False, 2)], (r, hook)
        assert list(hook["pipelined"]["pipelines"].values()) == [True], hook["pipelined"]
        for name in ("ring", "one_host"):
            assert list(hook[name]["pipelines"].values()) == [False], (name, hook[name])
        auto = hook["auto"]  # hierarchical is a candidate that would pipeline, but the plan does not use it
        assert auto["pipelines"]["hierarchical"] and "hierarchical" not in auto["planned"] and auto["planned"], auto
        assert not any(auto["pipelines"][k] for k in auto["planned"]), auto
        power = hook["powersgd"]
        assert list(power["pipelines"].values()) == [False], power
        assert power["coalescing"] and power["calls_per_step"] == 1, power
