"""A parameter that no rank used in a step costs no bytes (the DDP hook
with ``find_unused_parameters=True``), 2 and 3 gloo workers.

A branch ``b`` (a 16x16 weight, compressed, and its 16-entry bias, left
dense) is used by every rank at steps 0 and 3, by none at step 1, by rank 0
only at step 2; the model fits one DDP bucket. DDP's reducer leaves the
gradient of a parameter no rank used as it was and discards the bucket's
value of it (``finalize_bucket_dense``), so nothing of it needs to travel.
Checked against what the test computes itself:

* ``fp16`` through ``allreduce``: the bytes the collectives were handed
  each step (a shim around ``torch.distributed``) and ``last_step_bytes``
  equal the flags (one float32 per tensor of the bucket) plus, for each
  tensor some rank used, its compressed size
  (``compressor.wire_bytes``) or its dense size and its NaN/Inf flag; a
  tensor no rank used adds nothing. ``last_step_dense_bytes`` stays what
  DDP sends: the whole bucket;
* top-k + error feedback: every gradient follows the float64 definition
  (as tests/test_ddp_models.py), where no rank used ``b`` its gradient is
  plain DDP's (None) and its residual does not move, ``tensor_bytes`` of
  ``b`` is 0, the stats equal the shim's count, replicas stay identical;
* ``gradient_as_bucket_view=True`` with ``b``'s gradient left from step 0
  (only ``a`` and ``c`` zeroed): ``b.grad`` is a view of the bucket, and
  at step 1 it keeps its value bit for bit (DDP's rule: untouched), as with
  plain DDP at 2 workers (which writes the average of the ranks' identical
  values there).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn as nn
from distributed import worlds_fixture
from references import error_feedback_topk_mean
from test_accounting import Shim
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
from gradpress.compress import create

pytestmark = pytest.mark.slow

STEPS, MIN_NUMEL, RATIO = 4, 16, 0.25
#: a min_numel that compresses b.weight (256 entries) alone: a step no rank uses b compresses nothing
B_ONLY = 200


def _uses(step: int, rank: int) -> bool:
    return step != 1 and (step != 2 or rank == 0)


class Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use:
            h = h + self.b(h)
        return self.c(h)


def _x(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _run(rank: int, spec: str | None, strategy: str = "collective", view: bool = False,
         min_numel: int = MIN_NUMEL) -> dict:
    """STEPS steps (``spec`` None: plain DDP); per step this rank's own
    gradient (float64, autograd on the bare module), the gradients after the
    synced backward, the residuals, the bytes handed over and the stats."""
    model = Branch()
    ddp = DDP(model, find_unused_parameters=True, gradient_as_bucket_view=view)
    hook = None if spec is None else gradpress.ddp.register(ddp, spec, strategy=strategy, min_numel=min_numel)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shim = Shim()
    names = [n for n, _ in model.named_parameters()]
    out: dict = {"local": [], "grads": [], "before": [], "residuals": [], "bytes": [], "stats": []}
    for step in range(STEPS):
        x, use = _x(step, rank), _uses(step, rank)
        g = torch.autograd.grad(model(x, use).square().mean(), list(model.parameters()), allow_unused=True)
        out["local"].append({n: None if t is None else t.double() for n, t in zip(names, g)})
        if view:  # b's gradient (a view of the bucket) is left as step 0 made it
            for m in (model.a, model.c):
                m.zero_grad(set_to_none=False)
        else:
            opt.zero_grad()
        out["before"].append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        before = shim.bytes
        with shim.installed() if hook is not None else contextlib.nullcontext():
            ddp(x, use).square().mean().backward()
        out["grads"].append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        if hook is not None:
            out["bytes"].append(shim.bytes - before)
            out["stats"].append(hook.stats)
            out["residuals"].append({k: v.double().clone() for k, v in hook.memory.residuals.items()})
        opt.step()
    out["buckets"] = len(ddp.reducer._get_zeros_like_grad_buckets())
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    if hook is not None:
        hook.close()
    return out


def _worker(rank: int, world: int) -> dict:
    return {"fp16": _run(rank, "fp16", "allreduce"), "fp16_b": _run(rank, "fp16", "allreduce", min_numel=B_ONLY),
            "topk": _run(rank, f"topk:ratio={RATIO}"),
            "plain": _run(rank, None), "view": _run(rank, f"topk:ratio={RATIO}", view=True),
            "plain_view": _run(rank, None, view=True)}


world_results = worlds_fixture(_worker)


def _shapes() -> dict[str, torch.Size]:
    return {n: p.shape for n, p in Branch().named_parameters()}


def _compressed(shape: torch.Size, min_numel: int = MIN_NUMEL) -> bool:
    return len(shape) > 1 and math.prod(shape) >= min_numel


def _want_bytes(step: int, world: int, min_numel: int) -> int:
    """The flags (one float32 per tensor of the bucket), then for each tensor some rank used its payload,
    or its plain values and its NaN/Inf flag; when no tensor some rank used is compressed, the plain values
    alone (DDP's own allreduce of them: no NaN/Inf flags) and never the unused tensors' part of the bucket."""
    fp16, shapes = create("fp16"), _shapes()
    used = {n: any(_uses(step, rank) or not n.startswith("b.") for rank in range(world)) for n in shapes}
    compressing = any(used[n] and _compressed(s, min_numel) for n, s in shapes.items())
    want = 4 * len(shapes)
    for n, shape in shapes.items():
        if used[n]:
            numel = math.prod(shape)
            if not compressing:
                want += 4 * numel
            else:
                want += (fp16.wire_bytes(numel) if _compressed(shape, min_numel) else 4 * numel) + 4
    return want


@pytest.mark.parametrize(("run", "min_numel"), [("fp16", MIN_NUMEL), ("fp16_b", B_ONLY)])
def test_a_tensor_no_rank_used_costs_no_bytes(world_results, run: str, min_numel: int) -> None:  # noqa: ANN001
    """``fp16_b`` compresses b.weight alone (``plants4``: a step whose compressed tensors no rank used
    averaged the whole bucket, the unused tensors' part included, and went unnoticed). The bytes per
    strategy add up to the bytes handed over (the flags under ``uncompressed``)."""
    world, results = world_results
    shapes = _shapes()
    assert all(r[run]["buckets"] == 1 for r in results)  # the reference counts the flags of one bucket
    wrong = []
    for step in range(STEPS):
        want = _want_bytes(step, world, min_numel)
        dense = 4 * sum(math.prod(s) for s in shapes.values())
        for rank, r in enumerate(results):
            stats = r[run]["stats"][step]
            if (r[run]["bytes"][step], stats["last_step_bytes"]) != (want, want):
                wrong.append(f"rank {rank} step {step}: handed {r[run]['bytes'][step]} bytes, stats "
                             f"{stats['last_step_bytes']}, want {want}")
            assert stats["last_step_dense_bytes"] == dense, f"rank {rank} step {step}"
            assert sum(stats["strategy_bytes"].values()) == stats["bytes_sent"] == sum(r[run]["bytes"][:step + 1]), \
                f"rank {rank} step {step}: bytes per strategy {stats['strategy_bytes']}, sent {stats['bytes_sent']}"
    assert not wrong, f"world {world}: " + "; ".join(wrong)


def test_topk_follows_the_definition_and_a_tensor_no_rank_used_keeps_its_residual(world_results) -> None:  # noqa: ANN001
    world, results = world_results
    runs, plain = [r["topk"] for r in results], results[0]["plain"]
    shapes = _shapes()
    residual = [{n: torch.zeros(s, dtype=torch.float64) for n, s in shapes.items()} for _ in runs]
    for step in range(STEPS):
        for n, shape in shapes.items():
            where = f"world {world} step {step} {n}"
            local = [run["local"][step][n] for run in runs]
            got = [run["grads"][step][n] for run in runs]
            assert all((g is None) == (got[0] is None) and (g is None or torch.equal(g, got[0])) for g in got), \
                f"{where}: replicas differ"
            if all(g is None for g in local):  # DDP's rule: as plain DDP leaves it, nothing sent
                assert got[0] is None and plain["grads"][step][n] is None, where
                for run in runs:
                    assert run["stats"][step]["tensor_bytes"][n] == 0, where
            else:
                g = [t if t is not None else torch.zeros(shape, dtype=torch.float64) for t in local]
                want = error_feedback_topk_mean(residual, g, n, RATIO) if _compressed(shape) else sum(g) / len(g)
                err = (got[0].double() - want).abs().max().item()
                assert err <= 4 * 2.0**-23 * want.abs().max().item(), f"{where}: {err} from the reference"
            if _compressed(shape):
                for rank, run in enumerate(runs):
                    assert torch.equal(run["residuals"][step][n], residual[rank][n]), f"{where} rank {rank}: residual"
        for rank, run in enumerate(runs):
            assert run["stats"][step]["last_step_bytes"] == run["bytes"][step], f"step {step} rank {rank}"
    assert residual[0]["b.weight"].abs().sum() > 0  # step 1 had a residual of b to lose
    for n, p in runs[0]["params"].items():
        assert all(torch.equal(run["params"][n], p) for run in runs), f"world {world} {n}: replicas diverged"


def test_a_bucket_view_no_rank_used_keeps_its_value(world_results) -> None:  # noqa: ANN001
    world, results = world_results
    for rank, r in enumerate(results):
        for run in ("view", "plain_view"):
            before, after = r[run]["before"][1]["b.weight"], r[run]["grads"][1]["b.weight"]
            assert before is not None and before.abs().sum() > 0, (run, rank)  # step 0's average, kept
            if run == "view" or world == 2:  # plain DDP writes the mean of the ranks' values: exact at 2
                assert torch.equal(after, before), f"world {world} rank {rank} {run}: b.weight.grad moved"
        assert r["view"]["stats"][1]["tensor_bytes"]["b.weight"] == 0
    for n, p in results[0]["view"]["params"].items():
        assert all(torch.equal(r["view"]["params"][n], p) for r in results), f"world {world} {n}: replicas diverged"
