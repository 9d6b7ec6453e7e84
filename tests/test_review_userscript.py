"""An ordinary DDP training script adopting gradpress (2 gloo workers).

* A compression state is per rank (residuals differ between ranks). The
  common DDP pattern ``if rank == 0: torch.save(...)``, then every rank
  loading that one file, handed rank 0's residuals to every rank: the hook
  and the algorithms accepted another rank's state silently (rank 0's
  residual fed back twice, rank 1's lost). Now refused, naming ``rank``.
* docs/integrations.md's "Your own DDP script" runs as written (hook and
  DiLoCo), and an interrupted run resumes bit-identically.
* Accumulation under ``no_sync`` and ``clip_grad_norm_`` follow the
  documented definition, in float64.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

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


def _own_and_other(state: dict, rank: int, world: int, load: Callable[[dict], None]) -> dict:
    """Gather every rank's ``state``, then ``load`` (into fresh objects) this
    rank's own and the next rank's: "accepted" or the ValueError's message,
    by label ``own`` / ``other``. Collective: the load builds objects that
    agree across ranks."""
    everyone: list = [None] * world
    torch.distributed.all_gather_object(everyone, state)
    out = {}
    for label, source in (("own", rank), ("other", (rank + 1) % world)):
        try:
            load(everyone[source])
            out[label] = "accepted"
        except ValueError as exc:
            out[label] = str(exc)
    return out


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
    state = hook.state_dict()
    hook.close()

    def load(saved: dict) -> None:
        fresh = gradpress.ddp.register(DDP(_model()), "topk:ratio=0.1", min_numel=16)
        try:
            fresh.load_state_dict(saved)
        finally:
            fresh.close()

    return _own_and_other(state, rank, world, load)


def _algorithm_states(rank: int, world: int) -> dict:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algo = gradpress.algorithms.create("localsgd:period=2", model, opt, compressor="topk:ratio=0.1", min_numel=16)
    for step in range(STEPS + 1):
        x, y = _data(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        algo.step()

    def load(saved: dict) -> None:
        m = _model()
        gradpress.algorithms.create("localsgd:period=2", m, torch.optim.SGD(m.parameters(), lr=0.1),
                                    compressor="topk:ratio=0.1", min_numel=16).load_state_dict(saved)

    return _own_and_other(algo.state_dict(), rank, world, load)


@pytest.mark.parametrize("which", [_hook_states, _algorithm_states], ids=["hook", "algorithm"])
def test_another_ranks_compression_state_is_refused_naming_the_rank(which) -> None:  # noqa: ANN001
    results = run_workers(which, 2)
    for rank, res in enumerate(results):
        assert res["own"] == "accepted", f"rank {rank}: its own state was refused: {res['own']}"
        other = (rank + 1) % 2
        assert res["other"] != "accepted", f"rank {rank} silently loaded rank {other}'s compression state"
        assert "rank" in res["other"] and f"saved by rank {other}" in res["other"] \
            and f"loaded on rank {rank}" in res["other"], res["other"]


# ------------------------------------------------------- docs/integrations.md "Your own DDP script"
DOC = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"


def _doc_script() -> str:
    text = DOC.read_text()
    section = text[text.index("### Your own DDP script"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


class _Net(nn.Module):
    """A compressed 2-D weight (>= 1024 entries), BatchNorm buffers, a frozen layer."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(8, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                                  nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.frozen(x))


def _batches(rank: int, interrupt_at: int | None = None):  # noqa: ANN202
    def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if step == interrupt_at:
            raise KeyboardInterrupt  # Ctrl-C between two steps
        return [_data(rank, 10 * step + m) for m in range(3)]
    return batches


def _run_doc_script(rank: int, world: int, root: str) -> dict:
    namespace: dict = {}
    exec(compile(_doc_script(), str(DOC), "exec"), namespace)  # noqa: S102 - the documented script itself
    train = namespace["train"]
    out: dict = {}
    for label, options in (("hook", {"spec": "topk:ratio=0.1"}),
                           ("diloco", {"spec": "topk:ratio=0.1", "algorithm": "diloco:period=2"})):
        full, part = f"{root}/{label}-full", f"{root}/{label}-part"
        os.makedirs(full, exist_ok=True)
        os.makedirs(part, exist_ok=True)
        model = _Net(0)
        train(model, _batches(rank), 6, full, save_every=3, **options)
        straight = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            train(_Net(0), _batches(rank, interrupt_at=4), 6, part, save_every=3, **options)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        resumed = _Net(1)  # other weights: everything must come from the checkpoint
        train(resumed, _batches(rank), 6, part, save_every=3, **options)
        saved = torch.load(f"{part}/step00000006-rank{rank}.pt", weights_only=True)["gradpress"]
        engine = saved if label == "hook" else saved["exchange"]
        out[label] = {"straight": straight, "resumed": dict(resumed.state_dict()), "interrupted": interrupted,
                      "files": sorted(os.listdir(part)), "residuals": engine["feedback"]["residuals"]}
    return out


def test_the_documented_script_trains_compressed_and_resumes_bit_identically(tmp_path: Path) -> None:
    """docs/integrations.md's script (no_sync accumulation over 3 micro-batches,
    clipping, a cosine schedule, bf16 autocast, BatchNorm, a frozen layer), with
    the hook and with DiLoCo: interrupted by Ctrl-C after its checkpoint at step
    3, then resumed in a fresh model, it ends bit for bit where the run that was
    never interrupted ends; each rank wrote its own files; residuals are kept."""
    results = run_workers(_run_doc_script, 2, str(tmp_path))
    for label in ("hook", "diloco"):
        for rank, res in enumerate(results):
            r = res[label]
            assert r["interrupted"], label
            assert r["files"] == ["step00000003-rank0.pt", "step00000003-rank1.pt", "step00000006-rank0.pt",
                                  "step00000006-rank1.pt"], (label, r["files"])
            assert any(v.abs().sum() > 0 for v in r["residuals"].values()), f"{label}: nothing was compressed"
            for k, v in r["straight"].items():
                assert torch.equal(r["resumed"][k], v), f"{label} rank {rank}: {k} differs after the resume"
        if label == "hook":  # DDP: the replicas agree
            for k, v in results[0][label]["straight"].items():
                if "running" not in k:
                    assert torch.equal(results[1][label]["straight"][k], v), f"replicas differ: {k}"


# ------------------------------------------- accumulation and clipping against the definition
RATIO, MAX_NORM, MICRO = 0.1, 0.05, 3


def _accumulate_and_clip(rank: int, world: int) -> list[dict]:
    """Two steps of the documented loop through the hook (top-k, error
    feedback): 3 micro-batches under no_sync, bf16 autocast, clip_grad_norm_.
    Per step: this rank's own accumulated gradient (autograd on the bare
    module, summed in float32 as .grad accumulates), the gradient DDP leaves
    before and after the clip, the residuals."""
    model = _model()
    ddp = DDP(model)
    hook = gradpress.ddp.register(ddp, f"topk:ratio={RATIO}", min_numel=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(2):
        micro = [_data(rank, 10 * step + m) for m in range(MICRO)]
        local = None
        for x, y in micro:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x), y) / MICRO
            g = torch.autograd.grad(loss, list(model.parameters()))
            local = list(g) if local is None else [a + b for a, b in zip(local, g)]
        opt.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(micro):
            with ddp.no_sync() if i < MICRO - 1 else contextlib.nullcontext():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = nn.functional.cross_entropy(ddp(x), y) / MICRO
                loss.backward()
        names = [n for n, _ in model.named_parameters()]
        pre = {n: p.grad.clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        out.append({"local": dict(zip(names, [g.double() for g in local])), "pre": pre,
                    "post": {n: p.grad.clone() for n, p in model.named_parameters()},
                    "residuals": {k: v.double().clone() for k, v in hook.memory.residuals.items()}})
        opt.step()
    hook.close()
    return out


def _topk(p: torch.Tensor) -> torch.Tensor:
    flat = p.reshape(-1)
    k = max(1, math.ceil(RATIO * flat.numel()))
    order = torch.sort(-flat.abs(), stable=True).indices[:k]
    kept = torch.zeros_like(flat)
    kept[order] = flat[order]
    return kept.reshape(p.shape)


def test_accumulated_gradient_is_compressed_once_and_the_clip_applies_to_the_average() -> None:
    """By the definition, in float64: per rank p = e + g (g: the three
    micro-batches' gradients summed), s = topk(p), e <- p - s; the gradient
    handed back is mean_r s_r (1-D biases: the plain mean of g); the clip
    scales that average by min(1, max_norm / (||average|| + 1e-6)), the same
    on every rank, and leaves the residuals alone (docs/integrations.md)."""
    runs = run_workers(_accumulate_and_clip, 2)
    residual = [dict() for _ in runs]
    clipped_once = False
    for step in range(2):
        want = {}
        for n, g0 in runs[0][step]["local"].items():
            g = [run[step]["local"][n] for run in runs]
            if g0.dim() > 1:
                ps = [(res.get(n, torch.zeros_like(x)) + x).float().double() for res, x in zip(residual, g)]
                sent = [_topk(p) for p in ps]
                for res, p, s in zip(residual, ps, sent):
                    res[n] = p - s
            else:
                sent = g
            want[n] = sum(sent) / len(sent)
        norm = torch.sqrt(sum(w.square().sum() for w in want.values())).item()
        scale = min(1.0, MAX_NORM / (norm + 1e-6))
        clipped_once |= scale < 1.0
        for n, w in want.items():
            for rank, run in enumerate(runs):
                pre, post = run[step]["pre"][n].double(), run[step]["post"][n].double()
                tol = 1e-6 * max(w.abs().max().item(), 1e-30)
                assert (pre - w).abs().max().item() <= tol, f"step {step} rank {rank} {n}: averaged gradient"
                assert (post - w * scale).abs().max().item() <= tol, f"step {step} rank {rank} {n}: clipped"
                if w.dim() > 1:
                    assert (run[step]["residuals"][n] - residual[rank][n]).abs().max().item() <= tol, \
                        f"step {step} rank {rank} {n}: residual"
            assert torch.equal(runs[0][step]["post"][n], runs[1][step]["post"][n]), f"replicas differ: {n}"
    assert clipped_once, "the clip never applied: the test would prove nothing about it"
