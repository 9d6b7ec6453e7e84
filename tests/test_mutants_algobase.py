"""The algorithm base class's exchange helpers (``Algorithm.__init__``'s
planning, ``local_step``'s per-step counts): written for survivors of
``make mutants`` (``algobase`` group: algorithms/base.py's exchange
helpers, algorithms/loss_probe.py, algorithms/registry.py). One spawned
process (a world of one, gloo), every check in it: a few seconds.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers

pytestmark = pytest.mark.mutants

SHAPES = ((16, 12), (16,))  # Linear(12, 16): a 2-D weight the planner may compress, a 1-D bias it never does


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(12, 16)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, algo, seed: int) -> None:  # noqa: ANN001
    opt.zero_grad()
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    algo.step()


def _worker(rank: int, world: int) -> dict:
    import gradpress.algorithms as algorithms
    import gradpress.exchange.probe as probe

    out: dict = {}
    # a local step of local SGD (period 2) communicates nothing; the second one averages
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algo = algorithms.create("localsgd:period=2", model, opt)
    out["fresh"] = algo.stats
    _step(model, opt, algo, 1)
    out["local"] = algo.stats
    saved = algo.state_dict()
    _step(model, opt, algo, 2)
    out["synced"] = algo.stats
    # a resume after the local step: the same counts before its first step as the run it continues
    model = _model()
    resumed = algorithms.create("localsgd:period=2", model, torch.optim.SGD(model.parameters(), lr=0.1))
    resumed.load_state_dict(saved)
    out["resumed"] = resumed.stats

    # strategy=auto: the construction measures the group (once) and plans per tensor; the measurement is
    # the real one with a constant clock and small sizes (the planner's input, not its speed, is tested)
    calls = []
    real = probe.measure

    def quick(group, compressor, *, device="cpu"):  # noqa: ANN001, ANN202
        calls.append(compressor.spec())
        return real(group, compressor, device=device, comm_sizes=(1 << 10, 1 << 12), compute_sizes=(1 << 10, 1 << 12),
                    reps=1, timer=lambda fn, reps: 1e-3)

    probe.measure = quick
    try:
        for strategy in ("auto", "collective"):
            model = _model()
            algo = algorithms.create("localsgd:period=2", model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     compressor="topk:ratio=0.25", strategy=strategy, min_numel=64)
            out[strategy] = {"source": algo.engine.plan.source, "measured": list(calls), "strategy": algo.strategy_name,
                             "reasons": {k: d.reason for k, d in algo.engine.plan.decisions.items()}}
            calls.clear()
    finally:
        probe.measure = real
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    return run_workers(_worker, 1)[0]


def test_a_step_without_communication_counts_no_bytes(results: dict) -> None:
    """Invariant (the hook's vocabulary, exchange/stats.py): ``last_step_bytes``
    and ``last_step_host_bytes`` are what the last completed step sent (and
    kept inside a host); a local step of local SGD sends nothing, so both
    are 0, while ``last_step_dense_bytes`` is what DDP would have sent for
    that step: every parameter's gradient (16 x 12 + 16 float32 = 832 bytes)."""
    dense = sum(4 * torch.Size(s).numel() for s in SHAPES)
    fresh, local, synced = results["fresh"], results["local"], results["synced"]
    assert (fresh["steps"], fresh["last_step_bytes"], fresh["last_step_host_bytes"], fresh["last_step_dense_bytes"]) \
        == (0, 0, 0, 0), fresh
    assert local["steps"] == 1 and local["exchanges"] == 0, local
    assert (local["last_step_bytes"], local["last_step_host_bytes"], local["last_step_dense_bytes"]) == (0, 0, dense), local
    assert synced["steps"] == 2 and synced["exchanges"] == 1 and synced["dense_bytes"] == 2 * dense, synced
    assert synced["last_step_host_bytes"] == synced["host_bytes"] == 0, synced  # one worker: nothing inside a host
    assert synced["last_step_dense_bytes"] == dense, synced


def test_auto_strategy_measures_the_group_and_plans_at_construction(results: dict) -> None:
    """Invariant (``Algorithm`` docstring): ``strategy=auto`` measures the
    group and plans per tensor, as the DDP hook does: the construction
    measures once, with the algorithm's compressor, and every tensor's
    decision comes from that measurement or from the planner's fixed rule
    (1-D or below ``min_numel``: uncompressed); a forced strategy measures
    nothing."""
    auto, forced = results["auto"], results["collective"]
    assert auto["strategy"] == "auto" and auto["measured"] == ["topk:ratio=0.25"], auto
    assert auto["source"] == "measured", auto
    assert auto["reasons"] == {"weight": "cost model", "bias": "1-D or below min_numel"}, auto
    assert forced["measured"] == [] and forced["source"] == "forced", forced


def test_a_resumed_run_reports_the_dense_bytes_of_its_last_step(results: dict) -> None:
    """Invariant (the hook's vocabulary): ``last_step_dense_bytes`` is the
    dense bytes of the last completed step, and every step of an algorithm
    is one of DDP's (``dense_bytes == steps x`` every parameter's gradient):
    a run resumed after its first step reports, before any step of its own,
    that step's 832 bytes, as the run it continues did (the hook restores
    its figures from the state dict). It reported 0 (the constructor's
    value), as if no step had completed, beside ``steps == 1``."""
    dense = sum(4 * torch.Size(s).numel() for s in SHAPES)
    resumed = results["resumed"]
    assert resumed["steps"] == 1 and resumed["dense_bytes"] == dense, resumed
    assert resumed["last_step_dense_bytes"] == results["local"]["last_step_dense_bytes"] == dense, resumed
    assert (resumed["last_step_bytes"], resumed["last_step_host_bytes"]) == (0, 0), resumed  # a local step: nothing sent
