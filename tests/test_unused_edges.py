"""Edges of the unused-parameter and missing-state handling, 2 gloo workers, one spawn (about 5 s).

* Local SGD with ``nonfinite='skip'`` averaging the optimizer state, where one
  rank never stepped a parameter (no momentum there): a synchronization that
  the engine drops (a replica's parameter went infinite) zeroes the
  "state missing" flags that rode in it; the ranks then disagreed on which
  states to average and gloo aborted ("collective mismatch"). Checked against
  the definition, in float64: the dropped synchronization restarts every
  replica from the anchor with its optimizer state as it was there (none: the
  anchor is the start; it left each rank's momentum as the period made it
  until tests/test_skip_restart.py, which shows why that left a dead run); the
  next one averages the parameters and the momentum every rank holds, and
  leaves the one only rank 0 holds alone.
* The DDP hook with a frozen ``nn.Embedding(sparse=True)`` (a pretrained
  table): DDP hands it no gradient, so nothing sparse reaches the hook; it
  was refused at registration. ``none`` equals plain DDP bit for bit.
* A hook checkpoint written before gradients were handed over in their
  parameter's layout (no ``layout`` entry): a channels_last parameter's
  residual was indexed in DDP's bucket memory order; loaded today it was
  added to other elements. Such a state is built here from today's by the
  definition (the residual's elements in channels_last memory order) and
  must load as today's residual. The same for a compressor's own per-element
  state (DGC's momentum and velocity, AdaComp's residue, Signum's momentum:
  flat buffers in the gradient's element order, so in memory order then; they
  were loaded as they were), and for residuals saved as views of one shared
  storage (at an offset: they were read from the storage's start).
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn
from distributed import run_workers
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress

F64 = torch.float64
LR, MU = 0.1, 0.9
STEPS, PERIOD, BAD_STEP = 4, 2, 1


class Branch(nn.Module):
    """``b`` is used on rank 0 only: rank 1 never holds its momentum."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b, self.c = (nn.Linear(4, 4).to(F64) for _ in range(3))

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use:
            h = h + self.b(h)
        return self.c(h)


def _momenta(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()
            if opt.state.get(p, {}).get("momentum_buffer") is not None}


def _localsgd_skip(rank: int) -> dict:
    model = Branch()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MU)
    algo = gradpress.algorithms.create(f"localsgd:period={PERIOD}", model, opt, nonfinite="skip")
    local: dict = {}
    opt.register_step_post_hook(lambda o, a, k: local.update(
        params={n: p.detach().clone() for n, p in model.named_parameters()}, momenta=_momenta(opt, model)))
    out: dict = {"init": {n: p.detach().clone() for n, p in model.named_parameters()}, "steps": []}
    for step in range(STEPS):
        opt.zero_grad()
        x = torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x, rank == 0).square().mean().backward()
        if step == BAD_STEP and rank == 0:
            with torch.no_grad():
                model.c.weight[0, 0] = float("inf")  # this replica diverged: its delta is not finite
        algo.step()
        out["steps"].append({"local": dict(local), "skipped": algo.engine.last_step_skipped,
                             "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                             "momenta": _momenta(opt, model)})
    out["skipped_steps"] = algo.stats["skipped_steps"]
    return out


class FrozenTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.emb = nn.Embedding(16, 8, sparse=True).requires_grad_(False)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(x))


def _frozen_sparse(rank: int, spec: str | None) -> list[dict]:
    model = FrozenTable()
    ddp = DDP(model)
    hook = gradpress.ddp.register(ddp, spec, min_numel=16) if spec is not None else None
    grads = []
    for step in range(2):
        model.zero_grad(set_to_none=True)
        x = torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(10 * step + rank))
        ddp(x).square().mean().backward()
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
    if hook is not None:
        hook.close()
    return grads


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(9)
        self.c1, self.c2 = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(torch.tanh(self.c1(x))).mean((2, 3))


def _conv_hook(spec: str = "topk:ratio=0.25") -> tuple[nn.Module, DDP, gradpress.ddp.GradpressHook]:
    model = Conv().to(memory_format=torch.channels_last)
    ddp = DDP(model)
    return model, ddp, gradpress.ddp.register(ddp, spec, min_numel=16)


#: compressors whose state holds a flat buffer per parameter in the gradient's element order, and its entries
ELEMENT_STATE = {"dgc:ratio=0.25": ("momentums", "velocities"), "adacomp": ("residues",), "signum": ("momentum",)}


def _memory_order(v: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``v`` (indexed like a parameter of ``shape``, or flat in its element order) with its elements in the
    order of a channels_last parameter's memory: the layout of a state written before the change."""
    mem = v.reshape(shape).contiguous(memory_format=torch.channels_last).as_strided((v.numel(),), (1,))
    return mem.reshape(v.shape).clone()


def _old_checkpoint(rank: int, spec: str = "topk:ratio=0.25", shared: bool = False) -> dict:
    model, ddp, hook = _conv_hook(spec)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    for step in range(2):
        model.zero_grad()
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        ddp(x).square().mean().backward()
    state = hook.state_dict()
    hook.close()
    today = {k: v.clone() for k, v in state["feedback"]["residuals"].items()}
    old = {k: v for k, v in state.items() if k != "layout"}
    # before: element i of the saved residual was the one at channels_last memory position i
    residuals = {k: _memory_order(v, shapes[k]) for k, v in today.items()}
    if shared:  # saved as views of one storage, each at its offset (torch.save keeps the sharing)
        flat = torch.cat([v.reshape(-1) for v in residuals.values()])
        offsets = [0, *torch.tensor([v.numel() for v in residuals.values()]).cumsum(0).tolist()]
        residuals = {k: flat[o:o + v.numel()].view(v.shape) for (k, v), o in zip(residuals.items(), offsets)}
    old["feedback"] = {**state["feedback"], "residuals": residuals}
    names = ELEMENT_STATE.get(spec, ())
    compressor_today = {e: {k: v.clone() for k, v in state["compressor"][e].items()} for e in names}
    old["compressor"] = {**state["compressor"], **{e: {k: _memory_order(v, shapes[k]) for k, v in entry.items()}
                                                   for e, entry in compressor_today.items()}}
    buf = io.BytesIO()
    torch.save(old, buf)
    buf.seek(0)
    model, ddp, hook = _conv_hook(spec)
    hook.load_state_dict(torch.load(buf, weights_only=True))
    loaded = {k: v.clone() for k, v in hook.memory.residuals.items()}
    compressor = hook.engine.compressor.state_dict()
    hook.close()
    return {"today": today, "old": old["feedback"]["residuals"], "loaded": loaded,
            "compressor_today": compressor_today, "compressor_old": {e: old["compressor"][e] for e in names},
            "compressor_loaded": {e: compressor[e] for e in names}}


def _worker(rank: int, world: int) -> dict:
    out: dict = {"localsgd": _localsgd_skip(rank), "old_checkpoint": _old_checkpoint(rank),
                 "old_shared": _old_checkpoint(rank, shared=True)}
    for spec in ELEMENT_STATE:
        out[f"old/{spec}"] = _old_checkpoint(rank, spec)
    for spec in (None, "none", "topk:ratio=0.25"):
        try:
            out[f"sparse/{spec}"] = _frozen_sparse(rank, spec)
        except ValueError as exc:
            out[f"sparse/{spec}"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, 2)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    tol = 8 * torch.finfo(F64).eps * max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= tol, f"{what}: {got} vs {want}"


def test_localsgd_skipped_sync_restores_the_anchors_state_and_the_next_averages_it(results: list[dict]) -> None:
    runs = [r["localsgd"] for r in results]
    init = runs[0]["init"]
    for rank, run in enumerate(runs):
        assert run["skipped_steps"] == 1, f"rank {rank}"
        bad = run["steps"][BAD_STEP]
        assert bad["skipped"], f"rank {rank}: the synchronization with an infinite delta was not dropped"
        for n, p in bad["params"].items():  # every replica restarts from the anchor (the start, here)
            assert torch.equal(p, init[n]), f"rank {rank} {n}: not the anchor after the dropped synchronization"
        assert bad["local"]["momenta"], f"rank {rank}: the period built no momentum"
        # the state goes back to what it was at the anchor, the start: none (the period never happened)
        assert bad["momenta"] == {}, f"rank {rank}: momentum left after the dropped synchronization"
    assert "b.weight" in runs[0]["steps"][BAD_STEP]["local"]["momenta"]
    assert "b.weight" not in runs[1]["steps"][BAD_STEP]["local"]["momenta"]
    last = STEPS - 1  # a good synchronization (PERIOD divides STEPS)
    local = [run["steps"][last]["local"] for run in runs]
    anchor = runs[0]["steps"][BAD_STEP]["params"]
    for n in init:
        want = anchor[n] + sum(loc["params"][n] - anchor[n] for loc in local) / len(runs)
        for rank, run in enumerate(runs):
            _close(run["steps"][last]["params"][n], want, f"rank {rank} {n}: averaged parameter")
    for n in ("a.weight", "a.bias", "c.weight", "c.bias"):  # held by every rank: averaged
        want = sum(loc["momenta"][n] for loc in local) / len(runs)
        for rank, run in enumerate(runs):
            _close(run["steps"][last]["momenta"][n], want, f"rank {rank} {n}: averaged momentum")
    for n in ("b.weight", "b.bias"):  # only rank 0 holds it: left alone
        assert torch.equal(runs[0]["steps"][last]["momenta"][n], local[0]["momenta"][n]), n
        assert n not in runs[1]["steps"][last]["momenta"], n


def test_a_frozen_sparse_embedding_is_accepted_and_none_is_plain_ddp(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        for spec in ("none", "topk:ratio=0.25"):
            assert not isinstance(r[f"sparse/{spec}"], str), f"rank {rank} {spec}: refused: {r[f'sparse/{spec}']}"
        for step, (plain, none) in enumerate(zip(r["sparse/None"], r["sparse/none"])):
            assert plain["emb.weight"] is None and none["emb.weight"] is None
            for n in ("out.weight", "out.bias"):
                assert torch.equal(none[n], plain[n]), f"rank {rank} step {step} {n}"
    for step in range(2):  # top-k: replicas identical
        for n in ("out.weight", "out.bias"):
            assert torch.equal(results[0]["sparse/topk:ratio=0.25"][step][n], results[1]["sparse/topk:ratio=0.25"][step][n])


def test_a_checkpoint_from_before_the_layout_change_loads_re_indexed(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        run = r["old_checkpoint"]
        assert run["today"].keys() == run["loaded"].keys() == {"c1.weight", "c2.weight"}
        for k, v in run["today"].items():
            assert not torch.equal(run["old"][k], v), f"{k}: the old layout is the same here; the test proves nothing"
            assert torch.equal(run["loaded"][k], v), f"rank {rank} {k}: residual loaded in the old memory order"


def test_residuals_saved_as_views_of_one_storage_load_re_indexed(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        run = r["old_shared"]
        assert run["today"].keys() == run["loaded"].keys() == {"c1.weight", "c2.weight"}
        assert any(v.storage_offset() > 0 for v in run["old"].values()), "no view at an offset: proves nothing"
        for k, v in run["today"].items():
            assert torch.equal(run["loaded"][k], v), f"rank {rank} {k}: read from another place of the storage"


@pytest.mark.parametrize("spec", list(ELEMENT_STATE))
def test_a_compressors_element_state_from_before_the_layout_change_loads_re_indexed(results: list[dict],
                                                                                   spec: str) -> None:
    for rank, r in enumerate(results):
        run = r[f"old/{spec}"]
        for entry, today in run["compressor_today"].items():
            assert today.keys() == run["compressor_loaded"][entry].keys() == {"c1.weight", "c2.weight"}, entry
            for k, v in today.items():
                assert v.abs().sum() > 0, f"{entry} {k}: zero state; the test proves nothing"
                assert not torch.equal(run["compressor_old"][entry][k], v), f"{entry} {k}: same in both layouts"
                assert torch.equal(run["compressor_loaded"][entry][k], v), \
                    f"rank {rank} {spec} {entry} {k}: loaded in the old memory order"
