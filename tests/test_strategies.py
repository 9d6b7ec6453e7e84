"""Ring and parameter-server strategies, directly and through the DDP hook.

One spawn per world size (2, 3, 4) runs every check for that size; the
parent compares what the ranks return (exact averages, bit-identical
replicas, falling losses, identical plans).
"""

from __future__ import annotations

import functools

import pytest
import torch
from distributed import run_workers

import gradpress
from gradpress.compress import Context, create
from gradpress.exchange import get_strategy
from gradpress.exchange.feedback import Feedback

SHAPES = [(37, 11), (1001,), (5, 7), (3,), (64, 17)]
# a slow link: 10 MB/s with 0.2 ms latency; cheap compressor; 1/4 the bytes
SLOW = {
    "allreduce": (2e-4, 2e-4, 1e-7), "allgather": (2e-4, 2e-4, 1e-7), "broadcast": (2e-4, 2e-4, 1e-7),
    "p2p": (2e-4, 2e-4, 1e-7), "encode": (1e-5, 1e-5, 1e-9), "decode": (1e-5, 1e-5, 1e-9),
    "wire": (0.0, 0.0, 1.0), "root_wire": (0.0, 0.0, 1.0),
}

# a link on which point-to-point and allreduce are slow but broadcast is fast: the PS with K > 1 wins
PS_LINK = dict(SLOW, allreduce=(2e-4, 2e-4, 1e-6), allgather=(2e-4, 2e-4, 4e-6), p2p=(2e-4, 2e-4, 1e-6),
               broadcast=(5e-5, 5e-5, 1e-8))


def rank_tensors(rank: int, bucket: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * bucket + rank)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _direct(rank: int, world: int) -> dict:
    """Strategies called directly: several buckets, odd sizes."""
    out: dict = {}
    for name in ("ring", "ps"):
        for spec in ("none", "topk:ratio=1.0", "fp16", "randomk:ratio=0.3", "topk:ratio=0.05", "qsgd"):
            strat = get_strategy(name, None)
            comp = create(spec)
            for bucket in range(3):
                ts = rank_tensors(rank, bucket)
                ctxs = [Context(key=f"b{bucket}/t{i}", step=bucket, rank=rank, world_size=world) for i in range(len(ts))]
                orig = [t.clone() for t in ts]  # the strategy may turn its inputs into residuals in place
                feedback = Feedback()
                res = strat.exchange(comp, ts, ctxs, feedback)
                feedback.commit()
                ests = [o - r for o, r in zip(orig, res.residuals)]
                ts = orig
                exact = [sum(rank_tensors(r, bucket)[i] for r in range(world)) / world for i in range(len(ts))]
                out[(name, spec, bucket)] = {
                    "avg": res.tensors,
                    "err": max((a - e).abs().max().item() for a, e in zip(res.tensors, exact)),
                    "est_err": max((a - t).abs().max().item() for a, t in zip(ests, ts)),
                    "shapes_ok": all(a.shape == t.shape and a.dtype == t.dtype for a, t in zip(res.tensors, ts)),
                    "bytes": res.bytes_sent,
                }
    return out


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(13, 37)
        self.b = torch.nn.Linear(37, 29)
        self.c = torch.nn.Linear(29, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randn(32, 13, generator=g)
    w = torch.linspace(-1, 1, 13 * 3).view(13, 3)
    return x, x @ w


def _ddp_grads(rank: int, world: int, strategy: str | None, spec: str = "none", **kw) -> list[torch.Tensor]:
    """Gradients of one backward pass, plain DDP (strategy None) or hooked;
    tiny buckets so the hook sees several per step."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(_Net(), bucket_cap_mb=0.002)
    hook = None
    if strategy is not None:
        hook = gradpress.ddp.register(model, spec, strategy=strategy, min_numel=16, **kw)
    grads = []
    for step in range(2):  # the second step runs on DDP's rebuilt buckets
        model.zero_grad()
        x, y = _data(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    if hook is not None:
        stats = hook.stats
        hook.close()
        assert stats["compressed_tensors"] > 0, stats
    return grads


def _train(rank: int, world: int, spec: str, strategy: str, steps: int = 40, **kw) -> dict:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(_Net(), bucket_cap_mb=0.002)
    hook = gradpress.ddp.register(model, spec, strategy=strategy, min_numel=64, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        x, y = _data(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    state = hook.state_dict()
    out = {"losses": losses, "params": params, "stats": hook.stats, "plan": hook.plan.to_dict(),
           "strategy_state": sorted(state["strategies"])}
    hook.close()
    return out


def _resume(rank: int, world: int, spec: str, strategy: str) -> bool:
    """Stop after 4 steps, restore model, optimizer and hook (residuals at
    hops and roots included) into fresh objects: the next 4 steps match.
    One bucket: a fresh DDP runs its first step on its initial buckets, and a
    ring fuses a bucket's tensors, so its chunks (not its residuals, which
    are kept per tensor) depend on the grouping."""
    import copy

    def build():
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(_Net())
        hook = gradpress.ddp.register(model, spec, strategy=strategy, min_numel=64)
        return model, hook, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def steps(model, opt, start):
        for step in range(start, start + 4):
            opt.zero_grad()
            x, y = _data(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    model, hook, opt = build()
    steps(model, opt, 0)
    saved = copy.deepcopy((model.module.state_dict(), opt.state_dict(), hook.state_dict()))
    steps(model, opt, 4)
    ref = [p.detach().clone() for p in model.parameters()]
    hook.close()
    model, hook, opt = build()
    model.module.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    hook.load_state_dict(saved[2])
    namespace = {"ring": "ring/", "ps": "root/"}[strategy]  # the strategies' residuals, in the one feedback store
    assert any(k.startswith(namespace) for k in saved[2]["feedback"]["residuals"]), "no strategy residuals saved"
    steps(model, opt, 4)
    hook.close()
    return all(torch.equal(a, b) for a, b in zip(ref, model.parameters()))


def _worker(rank: int, world: int) -> dict:
    torch.manual_seed(rank)
    out: dict = {"direct": _direct(rank, world)}
    out["ddp_plain"] = _ddp_grads(rank, world, None)
    for strategy in ("ring", "ps"):
        out[f"ddp_{strategy}"] = _ddp_grads(rank, world, strategy)
    # partitioned tensors (name#k) through the hook: lossless non-summable compressor, slow link
    out["ddp_auto_parts"] = _ddp_grads(rank, world, "auto", "topk:ratio=1.0", plan_costs=PS_LINK)
    model = torch.nn.parallel.DistributedDataParallel(_Net())
    hook = gradpress.ddp.register(model, "topk:ratio=1.0", strategy="auto", min_numel=16, plan_costs=PS_LINK)
    out["auto_plan"] = hook.plan.to_dict()
    hook.close()
    if world == 3:
        for spec in ("topk:ratio=0.05", "qsgd:levels=4"):
            for strategy in ("ring", "ps"):
                out[("train", spec, strategy)] = _train(rank, world, spec, strategy)
    if world == 2:
        # live measurement at registration: identical plan on every rank
        model = torch.nn.parallel.DistributedDataParallel(_Net())
        hook = gradpress.ddp.register(model, "topk:ratio=0.01", strategy="auto", min_numel=16)
        out["measured_plan"] = hook.plan.to_dict()
        out["measured_table"] = hook.plan.table()
        out["cost_model"] = hook.cost_model.to_tensor()
        hook.close()
        out[("train", "topk:ratio=0.05", "auto")] = _train(rank, world, "topk:ratio=0.05", "auto", plan_costs=SLOW)
        out["resume"] = {s: _resume(rank, world, "topk:ratio=0.05", s) for s in ("ring", "ps")}
    return out


@functools.cache
def _results(world: int) -> list[dict]:
    return run_workers(_worker, world)


@pytest.fixture(params=[2, 3, 4])
def results(request):
    return request.param, _results(request.param)


def test_direct_exact_and_identical(results):
    world, res = results
    for key, r0 in res[0]["direct"].items():
        name, spec, bucket = key
        for r in range(world):
            rr = res[r]["direct"][key]
            assert rr["shapes_ok"], key
            for a, b in zip(r0["avg"], rr["avg"]):
                assert torch.equal(a, b), f"replicas differ: {key} rank {r}"
        if spec in ("none", "topk:ratio=1.0"):
            # lossless: the exact average (float tolerance) and exact estimates
            for r in range(world):
                assert res[r]["direct"][key]["err"] < 1e-5, (key, res[r]["direct"][key]["err"])
                assert res[r]["direct"][key]["est_err"] < 1e-5, key
        elif spec in ("fp16",):
            assert r0["err"] < 5e-3, key
        else:
            _check_lossy(world, name, spec, bucket, r0["avg"])


def _ref_direct(world: int, name: str, ratio: float, bucket: int) -> list[torch.Tensor]:
    """Top-k through the ring or the PS, residuals starting at zero, by the
    strategies' definitions (float64; see tests/test_references.py)."""
    from references import topk as ref_topk
    from test_references import chunks

    xs = [[t.double() for t in rank_tensors(r, bucket)] for r in range(world)]
    out = []
    for i in range(len(SHAPES)):
        if name == "ps":  # each rank sends top-k; the root re-sparsifies the mean at density ratio * N
            mean = sum(ref_topk(xs[r][i], ratio) for r in range(world)) / world
            out.append(ref_topk(mean, min(1.0, ratio * world)))
            continue
        flats = [xs[r][i].reshape(-1) / world for r in range(world)]
        res = torch.zeros_like(flats[0])
        for c, (a, b) in enumerate(chunks(flats[0].numel(), world)):
            acc = None
            for j in range(world):  # chunk c starts at rank c and is re-compressed at every hop
                value = flats[(c + j) % world][a:b] if acc is None else acc + flats[(c + j) % world][a:b]
                acc = ref_topk(value, ratio)
            res[a:b] = acc
        out.append(res.reshape(xs[0][i].shape))
    return out


def _check_lossy(world: int, name: str, spec: str, bucket: int, avg: list[torch.Tensor]) -> None:
    """Lossy results checked against what the method must give, not "the
    right scale": top-k against its float64 reference; random-k (shared
    indices, summable) equal to the exact average wherever it kept an
    entry, on at least ceil(0.3 n) entries per piece; QSGD (unbiased, no
    reference) projected on the exact average within 25% of it (all zeros,
    the negated mean or the sum instead of the mean fail)."""
    exact = [sum(rank_tensors(r, bucket)[i] for r in range(world)) / world for i in range(len(SHAPES))]
    if spec.startswith("topk"):
        ref = _ref_direct(world, name, float(spec.split("=")[1]), bucket)
        for a, e in zip(avg, ref):
            assert torch.allclose(a.double(), e, rtol=0, atol=1e-5), (name, spec, bucket, float((a - e).abs().max()))
    elif spec.startswith("randomk"):
        for a, e in zip(avg, exact):
            kept = a != 0
            assert int(kept.sum()) >= 0.3 * a.numel() - world, (name, spec, int(kept.sum()), a.numel())
            assert torch.allclose(a[kept], e[kept], rtol=1e-5, atol=1e-6), (name, spec, bucket)
    else:
        a = torch.cat([t.reshape(-1).double() for t in avg])
        e = torch.cat([t.reshape(-1).double() for t in exact])
        proj = float(a @ e / (e @ e))
        assert 0.75 < proj < 1.25, (name, spec, bucket, proj)


def test_lossy_compression_sends_fewer_bytes(results):
    world, res = results
    d = res[0]["direct"]
    for name in ("ring", "ps"):
        assert d[(name, "topk:ratio=0.05", 0)]["bytes"] < d[(name, "none", 0)]["bytes"] / 2
        assert d[(name, "qsgd", 0)]["bytes"] < d[(name, "none", 0)]["bytes"] / 2


def test_ddp_none_matches_plain_ddp(results):
    world, res = results
    for key in ("ddp_ring", "ddp_ps", "ddp_auto_parts"):
        for r in range(world):
            for step in range(2):
                for a, b, ref in zip(res[0][key][step], res[r][key][step], res[r]["ddp_plain"][step]):
                    assert torch.equal(a, b), f"{key}: rank {r} differs from rank 0"
                    assert torch.allclose(b, ref, atol=1e-6, rtol=1e-5), f"{key}: not the average"


def test_auto_plan_partitions_large_tensors(results):
    world, res = results
    plan = res[0]["auto_plan"]
    assert all(res[r]["auto_plan"] == plan for r in range(world))
    assert plan["a.bias"]["strategy"] == "uncompressed"
    assert plan["b.weight"] == {"strategy": "ps", "parts": world}  # 37 x 29, partitioned name#k


def test_training_falls_and_replicas_agree(results):
    world, res = results
    keys = [k for k in res[0] if isinstance(k, tuple) and k[0] == "train"]
    if world == 3:
        assert len(keys) == 4
    for key in keys:
        losses = res[0][key]["losses"]
        assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, (key, losses[:5], losses[-5:])
        for r in range(world):
            assert torch.equal(res[r][key]["params"], res[0][key]["params"]), f"{key}: rank {r} diverged"
        stats = res[0][key]["stats"]
        assert stats["ratio"] > 1.5, (key, stats["ratio"])
        assert res[0][key]["strategy_state"], key


def test_measured_plan_identical():
    """How long measuring takes is a benchmark's business (gradpress bench
    plan), not a unit test's: no wall-clock bound here."""
    world, res = 2, _results(2)
    assert all(torch.equal(res[r]["cost_model"], res[0]["cost_model"]) for r in range(world))
    assert all(res[r]["measured_plan"] == res[0]["measured_plan"] for r in range(world))
    assert "b.weight" in res[0]["measured_table"]


def test_resume_restores_strategy_residuals():
    res = _results(2)
    for r in range(2):
        assert res[r]["resume"] == {"ring": True, "ps": True}


@pytest.mark.parametrize("strategy", ["ring", "ps"])
@pytest.mark.parametrize(
    "spec, reason",
    [
        ("randomk:ratio=0.1>natural", "shared-seed indices"),  # receivers could not rebuild the indices
        ("dgc:ratio=0.01", "own error memory"),  # momentum would be applied again to partial sums
        ("adacomp", "own error memory"),
        ("signsgd", "vote"),
        ("powersgd", "multi-round"),
    ],
)
def test_recompressing_strategies_refuse_what_they_cannot_carry(strategy: str, spec: str, reason: str) -> None:
    assert reason in (get_strategy(strategy, None).supports(create(spec)) or "")


@pytest.mark.parametrize("strategy", ["ring", "ps"])
@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "qsgd", "randomk:ratio=0.1", "topk:ratio=0.1>natural", "sidco:ratio=0.01"])
def test_recompressing_strategies_accept_the_rest(strategy: str, spec: str) -> None:
    assert get_strategy(strategy, None).supports(create(spec)) is None


def test_sparse_sum_equals_the_rank_order_fold_of_dense_decodes() -> None:
    """Allgather averages exact-value sparse packets with one accumulated
    scatter: bit-equal to the dense fold (decode each, add in rank order) and
    close to the float64 sum, overlapping indices included."""
    from gradpress.compress.sparse import scatter_sparse, sparse_sum

    gen = torch.Generator().manual_seed(7)
    d, ranks = 1000, 5
    vals = [torch.randn(300, generator=gen) for _ in range(ranks)]
    idxs = [torch.randperm(d, generator=gen)[:300].to(torch.int32) for _ in range(ranks)]
    got = sparse_sum(vals, idxs, d, torch.float32)
    dense = [scatter_sparse(v, i, torch.Size([d]), torch.float32) for v, i in zip(vals, idxs)]
    fold = dense[0].clone()
    for t in dense[1:]:
        fold += t
    assert torch.equal(got, fold)
    ref = torch.zeros(d, dtype=torch.float64)
    for v, i in zip(vals, idxs):
        ref[i.long()] += v.double()
    assert torch.allclose(got.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(sparse_sum([], [], 4, torch.float32), torch.zeros(4))
