"""Which parameter a residual store key belongs to, for parameter names that
look like a store key's suffix (``nn.ParameterDict({"w#0": ...})`` names
its parameter ``pd.w#0``; ``register_parameter`` and ``nn.ModuleDict`` take
'#' and '/').

The store keys are built by the test as the exchange builds them (the
worker's own residual: the parameter's key escaped, whole; a strategy's:
``Feedback.key(namespace, key)`` with the ``#ps`` suffix at a PS root). A
parameter's residuals are those built from its own key, whatever other
parameters are called. ``owner()`` parsed a key without knowing the
parameters, so it cut ``pd.w#0`` to ``pd.w``: ``upgrade_layout`` then left
such a parameter's old worker residual in bucket memory order (or dropped
another parameter's), and ``sync_agreeing`` let the exchange change the PS
root residual of a parameter no rank had (both fixed: the owner was looked
up among the parameters' keys; since keys are built from escaped names,
:mod:`gradpress.exchange.keys`, ``pd.w%230`` is no partition of anything).
About 3 s (one spawn of 2 gloo workers).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from gradpress.exchange.feedback import Feedback, escape
from gradpress.exchange.strategies.ps import ROOT
from gradpress.exchange.strategies.ring import RING


def _memory_order(r: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """By the definition (state_format module doc): element ``i`` of the old flat residual was the one at
    memory position ``i`` of ``p``; the element at index ``idx`` of ``p`` sits at ``sum(idx * stride)``."""
    flat, out = r.double().reshape(-1), torch.empty(p.shape, dtype=torch.float64)
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in p.shape]).tolist():
        out[tuple(idx)] = flat[sum(i * s for i, s in zip(idx, p.stride()))]
    return out


def test_an_old_worker_residual_of_a_parameter_named_like_a_partition_is_re_indexed() -> None:
    """A transposed parameter ``pd.w#0`` (its worker residual's key is its name) is re-indexed; the worker
    residual of ``pd.v#1`` (contiguous: nothing to re-index) is kept as it was although a transposed ``pd.v``
    exists, and ``pd.v``'s own ring residual (a strategy's: cannot be re-indexed) is dropped. The state is from
    before keys were escaped: loaded as the hook loads it, keys first (``upgrade_keys``), then the layout."""
    from gradpress.ddp.state_format import upgrade_layout
    from gradpress.exchange.keys import upgrade_keys

    pd = nn.ParameterDict({"w#0": nn.Parameter(torch.zeros(4, 3).t()), "v": nn.Parameter(torch.zeros(5, 2).t()),
                           "v#1": nn.Parameter(torch.zeros(2, 5))})
    params = {f"pd.{k}": p for k, p in pd.named_parameters()}
    assert set(params) == {"pd.w#0", "pd.v", "pd.v#1"}
    r_w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    r_v1 = -torch.arange(10, dtype=torch.float32).reshape(2, 5)
    ring_v = torch.ones(10)
    state = {"feedback": {"residuals": {"pd.w#0": r_w, "pd.v#1": r_v1, Feedback.key(RING, "pd.v"): ring_v}}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fixed = upgrade_layout(upgrade_keys(state, list(params)), params)["feedback"]["residuals"]
    torch.testing.assert_close(fixed[escape("pd.w#0")].double(), _memory_order(r_w, params["pd.w#0"]), rtol=0,
                               atol=0)
    assert escape("pd.v#1") in fixed and torch.equal(fixed[escape("pd.v#1")], r_v1), sorted(fixed)
    assert Feedback.key(RING, "pd.v") not in fixed, sorted(fixed)
    assert any(Feedback.key(RING, "pd.v") in str(w.message) for w in caught)


class _Net(nn.Module):
    """A body always used and a ParameterDict head ``side.h#0`` used on the first steps only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 8)
        self.side = nn.ParameterDict({"h#0": nn.Parameter(torch.randn(8, 8) * 0.3)})

    def forward(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        y = self.body(x)
        return y + x @ self.side["h#0"] if side else y


def _steps_without_the_head(rank: int, world: int) -> dict:
    import gradpress.algorithms as algorithms

    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    # synchronous steps (keys grad:<name>) averaged through a parameter server with QSGD: the root keeps a
    # re-compression residual per tensor (root/grad:<name>#ps) where it owns it
    algo = algorithms.create("postlocalsgd:period=2,switch=8", net, opt, compressor="qsgd:levels=4",
                             strategy="ps", min_numel=16, error_feedback=True)
    snaps = []
    for step in range(4):  # steps 0, 1 use the head; 2, 3 do not (no rank has its gradient)
        opt.zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        nn.functional.mse_loss(net(x, step < 2), y).backward()
        algo.step()
        snaps.append({k: v.clone() for k, v in algo.engine.feedback.residuals.items()})
    return {"snaps": snaps}


def test_a_parameter_named_like_a_partition_that_no_rank_has_keeps_its_residuals() -> None:
    """``sync_agreeing``: a parameter no rank has is exchanged, but every residual of it (the worker's and the
    PS root's, keys built here from its escaped engine key ``grad:side.h#0``) stays exactly as it was; the
    root's was changed by the exchange (its key was taken for a partition of ``grad:side.h``)."""
    from distributed import run_workers

    key = escape("grad:side.h#0")
    mine = {key, Feedback.key(ROOT, key + "#ps")}
    runs = run_workers(_steps_without_the_head, 2)
    held = [k for r in runs for k in r["snaps"][1] if k in mine]
    assert Feedback.key(ROOT, key + "#ps") in held and key in held, held  # the head's residuals exist
    for rank, r in enumerate(runs):
        before = {k: v for k, v in r["snaps"][1].items() if k in mine}
        for step in (2, 3):
            after = {k: v for k, v in r["snaps"][step].items() if k in mine}
            assert sorted(after) == sorted(before), (rank, step, sorted(after))
            for k in before:
                assert torch.equal(after[k], before[k]), f"rank {rank} step {step}: {k} changed"
