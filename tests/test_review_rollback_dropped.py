"""A failed load puts back the count of dropped steps and the ``auto`` plan: one process, a one-rank gloo group,
about 15 s on the shared machine (imports most of it).

``Algorithm.load_state_dict`` loads the engine's state first (its ``dropped_steps`` included: the steps
``nonfinite='skip'`` dropped, which the compressors' Context step leaves out), then the algorithm's extra
state. An extra state found bad there must leave the algorithm as it was (``exchange/rollback.py``), the
count too: DiLoCo (period 1, so the engine exchanges at every step) drops a step whose gradient is NaN, so
it has dropped 1 when a state saved before that step (0 dropped) with a broken outer optimizer is loaded.
``tests/test_load_rollback.py`` loads states whose count equals the live one (no step dropped there), so it
cannot see the count left at the loaded value.

Under ``strategy='auto'`` the engine's load replaces the plan before the stats (its last part): stats found bad
must leave the engine's own plan object. Neither is reached by ``tests/test_load_rollback.py`` (no ``auto``).

Planted: ``EngineState.restore_backup`` not putting ``dropped_steps`` back: the count is 0 after the failed
load (``assert 0 == 1``); not putting ``plan`` back: the engine keeps the loaded plan (``is`` fails).
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn as nn
from distributed import one_rank_module

import gradpress.algorithms as algorithms

group = one_rank_module  # the module's one-process gloo group
F64 = torch.float64


def _step(model: nn.Module, opt: torch.optim.Optimizer, algo: algorithms.Algorithm, step: int, bad: bool) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(5, 6, generator=g, dtype=F64)
    opt.zero_grad(set_to_none=True)
    loss = ((model(x) - x[:, :3]) ** 2).mean()
    (loss * math.nan if bad else loss).backward()
    algo.step()


def _saved(algo: algorithms.Algorithm) -> dict:
    buf = io.BytesIO()
    torch.save(algo.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_a_failed_load_keeps_the_dropped_count(group) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    algo = algorithms.create("diloco:period=1,outer_momentum=0.5", model, opt, compressor="topk:ratio=0.5",
                             min_numel=1, nonfinite="skip")
    _step(model, opt, algo, 0, bad=False)
    early = _saved(algo)
    assert early["exchange"]["dropped_steps"] == 0
    _step(model, opt, algo, 1, bad=True)  # dropped on the (only) rank
    _step(model, opt, algo, 2, bad=False)
    before = _saved(algo)
    assert before["exchange"]["dropped_steps"] == 1 and algo.engine.guard.dropped == 1

    early["extra"]["outer"]["param_groups"] = []  # fails in the extra state, after the engine's loaded
    with pytest.raises(ValueError, match="nothing was loaded"):
        algo.load_state_dict(early)
    assert algo.engine.guard.dropped == 1
    after = _saved(algo)
    assert after["exchange"]["dropped_steps"] == 1
    assert after["steps"] == before["steps"] and after["exchanges"] == before["exchanges"]


def test_a_failed_engine_load_keeps_the_auto_plan(group) -> None:  # noqa: ANN001
    """``strategy='auto'``: the load replaces the plan (the partitions the residuals are keyed by) before the
    stats, its last part; stats found bad there must leave the engine's own plan, not the state's."""
    from gradpress.exchange.engine import Synchronizer

    engine = Synchronizer("topk:ratio=0.5", params=[("w", (16, 32), torch.float32)], strategy="auto", min_numel=1,
                          nonfinite="skip")
    engine.sync(["w"], [torch.randn(16, 32, generator=torch.Generator().manual_seed(1))], step=0)
    mine = engine.plan
    state = engine.state_dict()
    assert state["plan"] and "w" in state["plan"]
    other = {"strategy": "allgather", "parts": mine["w"].parts + 1}
    assert state["plan"]["w"] != other
    state["plan"] = {**state["plan"], "w": other}
    state["stats"] = {**state["stats"], "tensor_bytes": 5}  # refused by the stats counter, after the plan loaded
    with pytest.raises(ValueError, match=r"stats.*nothing was loaded"):
        engine.load_state_dict(state)
    assert engine.plan is mine and engine.plan.to_dict()["w"] != other
