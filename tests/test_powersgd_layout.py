"""PowerSGD's warm-start Q in a DDP-hook checkpoint written before gradients had their parameter's layout
(no ``layout`` entry: gradpress/ddp/state_format.py).

PowerSGD factors the gradient seen as an n x m matrix (``shape[0]`` x the rest); its Q (m x r) has one row
per column of that matrix. Before the layout change the hook handed a channels_last or transposed parameter's
gradient in DDP's bucket memory order, so the matrix was the memory read row by row: ``M_old[o, off]`` is
the element at memory position ``o * m + off``. For a channels_last conv weight (O, I, H, W) dimension 0 is
the outermost in memory (stride ``I*H*W = m``), so row o of ``M_old`` is row o of today's matrix with its
columns permuted (column j, the (i, h, w) in row-major order, sits at offset ``sum(idx * stride[1:])``):
``M_old = M Pi`` and ``P = M_old Q_old = M (Pi Q_old)``: today's Q is ``Q[j] = Q_old[offset(j)]``, exact.
A transposed matrix's memory rows are columns of the parameter: no row permutation of Q gives the same
product for every gradient, so its Q restarts (a fresh Gaussian from the shared seed, as a new parameter's),
with a warning. The loaded Q used to be kept as it was: the first step after the resume factored today's
matrix with another matrix's Q (it differed from the uninterrupted run; fixed).

One spawn of 2 gloo workers, about 8 s.
"""

from __future__ import annotations

import io
import itertools
import warnings

import pytest
import torch
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

SPEC = "powersgd:rank=1,start_iter=0"


class Net(nn.Module):
    """Two channels_last convolutions and a transposed matrix (strides (1, 12))."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.c1, self.c2 = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 4, 3)
        self.t = nn.Parameter(torch.randn(12, 10).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(torch.tanh(self.c1(x))).mean((2, 3)) @ self.t[:4]


def _hook() -> tuple[nn.Module, DDP, object]:
    import gradpress

    model = Net()
    model.c1.to(memory_format=torch.channels_last)
    model.c2.to(memory_format=torch.channels_last)
    ddp = DDP(model)
    return model, ddp, gradpress.ddp.register(ddp, SPEC, min_numel=16)


def _step(model: nn.Module, ddp: DDP, rank: int, step: int) -> dict[str, torch.Tensor]:
    model.zero_grad()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(10 * step + rank))
    ddp(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _memory_order(v: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``v`` (indexed like ``p``) with element ``i`` the one at ``p``'s memory position ``i``, shaped as ``v``."""
    out = torch.empty(v.numel(), dtype=v.dtype)
    for idx in itertools.product(*[range(n) for n in p.shape]):
        out[sum(i * s for i, s in zip(idx, p.stride()))] = v[idx]
    return out.reshape(v.shape)


def _old_q(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Today's Q as the old code held it: row ``offset(j)`` is today's row j, ``offset(j)`` the memory offset in
    its row of column j of today's matrix (the index ``idx`` of ``shape[1:]`` in row-major order)."""
    old = torch.empty_like(q)
    for j, idx in enumerate(itertools.product(*[range(n) for n in p.shape[1:]])):
        old[sum(i * s for i, s in zip(idx, p.stride()[1:]))] = q[j]
    return old


def _worker(rank: int, world: int) -> dict:
    model, ddp, hook = _hook()
    for step in range(3):
        _step(model, ddp, rank, step)
    state = hook.state_dict()
    params = dict(model.named_parameters())
    q_today = {k: v.clone() for k, v in state["compressor"]["q"].items()}
    old = {k: v for k, v in state.items() if k != "layout"}
    old["feedback"] = {**state["feedback"], "residuals": {k: _memory_order(v, params[k])
                                                          for k, v in state["feedback"]["residuals"].items()}}
    old["compressor"] = {"q": {k: _old_q(v, params[k]) if k.startswith("c") else v for k, v in q_today.items()}}
    buf = io.BytesIO()
    torch.save(old, buf)
    uninterrupted = _step(model, ddp, rank, 3)
    hook.close()
    model, ddp, hook = _hook()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buf.seek(0)
        hook.load_state_dict(torch.load(buf, weights_only=True))
    q_loaded = {k: v.clone() for k, v in hook.engine.compressor.state_dict()["q"].items()}
    resumed = _step(model, ddp, rank, 3)
    hook.close()
    return {"q_today": q_today, "q_old": old["compressor"]["q"], "q_loaded": q_loaded,
            "warnings": [str(w.message) for w in caught], "uninterrupted": uninterrupted, "resumed": resumed}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_workers(_worker, 2)


def test_a_channels_last_convs_q_from_before_the_layout_change_is_re_indexed(runs: list[dict]) -> None:
    """The old Q of each channels_last conv loads as today's Q (bit for bit), and the first step after the
    resume equals the uninterrupted run's for those convs (P = M Q, warm-started)."""
    for rank, run in enumerate(runs):
        for k in ("c1.weight", "c2.weight"):
            assert not torch.equal(run["q_old"][k], run["q_today"][k]), f"{k}: same in both layouts; proves nothing"
            assert torch.equal(run["q_loaded"][k], run["q_today"][k]), f"rank {rank} {k}: Q of the old matrix view"
            assert torch.equal(run["resumed"][k], run["uninterrupted"][k]), f"rank {rank} {k}: resumed step differs"


def test_a_transposed_parameters_q_from_before_the_layout_change_restarts_with_a_warning(runs: list[dict]) -> None:
    """No row permutation of Q maps the old matrix (the memory of ``t``, a transposed parameter, read row by
    row) to today's: its Q is dropped (a fresh one from the shared seed next step), the warning names it, and
    the replicas still agree."""
    for rank, run in enumerate(runs):
        assert "t" in run["q_today"] and "t" not in run["q_loaded"], (rank, sorted(run["q_loaded"]))
        assert any("t" in w.split("residuals or compressor buffers ")[-1].split(" of ")[0].split(", ")
                   for w in run["warnings"]), run["warnings"]
    assert torch.equal(runs[0]["resumed"]["t"], runs[1]["resumed"]["t"])
