"""The warning of a DDP hook state that does not know the DDP model's
``find_unused_parameters`` (``make_hook(spec)`` binding itself at the first
backward, or bound to the bare module), 2 gloo workers, one launch (a few
seconds).

A branch ``b`` is used on steps 0 and 3 by both ranks, on step 1 by none,
on step 2 by rank 0 only. Such a state compresses ``b`` at step 1 although
no rank used it, and DDP discards what it sends: what its residual held is
lost. Checked, each with ``zero_grad(set_to_none=True)`` and ``False``:

* the state warns exactly once per rank (both ranks miss ``b`` at step 1),
  naming the parameter by its key and its shape (a self-bound state's keys
  are ``param{i}``: the key is found in the state's config by ``b``'s shape,
  which no other parameter has) and saying what to do (bind to the DDP
  model); with ``set_to_none=False`` the unused parameter keeps a zero
  ``.grad`` (with ``gradient_as_bucket_view``: a view of the bucket), so it
  is not seen as a None gradient;
* a state bound to the DDP model before the first backward (also after
  being bound to the bare module) does not warn, and ``b``'s residual does
  not move at step 1 (the DDP rule, test_ddp_models.py);
* a state on a model whose parameters are all used never warns.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn as nn
from distributed import run_workers
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress

pytestmark = pytest.mark.slow

SPEC = "topk:ratio=0.25"
B_SHAPE = (12, 12)
MODES = ("lazy", "module", "lazy_view", "ddp", "module_then_ddp")


class Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 12), nn.Linear(*B_SHAPE), nn.Linear(12, 4)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use:
            h = h + self.b(h)
        return self.c(h)


def _uses(step: int, rank: int) -> bool:
    return step != 1 and (step != 2 or rank == 0)


def _run(rank: int, mode: str, set_to_none: bool, unused: bool = True) -> dict:
    torch.manual_seed(7)
    model = Branch()
    ddp = DDP(model, find_unused_parameters=True, gradient_as_bucket_view=mode == "lazy_view")
    state, fn = gradpress.ddp.make_hook(SPEC, min_numel=16)
    if mode in ("module", "module_then_ddp"):
        state.bind(model)
    if mode in ("ddp", "module_then_ddp"):
        state.bind(ddp)
    ddp.register_comm_hook(state, fn)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    residuals = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            opt.zero_grad(set_to_none=set_to_none)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            ddp(x, _uses(step, rank) or not unused).square().mean().backward()
            opt.step()
            residuals.append({k: v.clone() for k, v in state.memory.residuals.items()})
    keys = {tuple(shape): key for key, shape, *_ in state.config()["parameters"]}
    state.close()
    return {"warnings": [str(w.message) for w in caught if "gradpress hook" in str(w.message)],
            "b_key": keys[B_SHAPE], "residuals": residuals}


def _worker(rank: int, world: int) -> dict:
    out = {(mode, stn): _run(rank, mode, stn) for mode in MODES for stn in (True, False)}
    out["all_used"] = _run(rank, "lazy", False, unused=False)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, 2)


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("mode", ["lazy", "module", "lazy_view"])
def test_a_state_without_the_ddp_model_warns_once_naming_the_parameter(results: list[dict], mode: str,
                                                                      set_to_none: bool) -> None:
    for rank, r in enumerate(results):
        run = r[(mode, set_to_none)]
        assert len(run["warnings"]) == 1, f"rank {rank}: {run['warnings']}"
        message, key = run["warnings"][0], run["b_key"]
        assert key == ("b.weight" if mode == "module" else key) and (mode == "module" or key.startswith("param"))
        named = re.findall(r"(\S+) \((\d+(?:x\d+)*)\)", message.split(" got no gradient")[0])
        assert named == [(key, "12x12")], message  # b.weight and only it: b.bias is 1-D, averaged plain
        assert "find_unused_parameters=True" in message and "state.bind(ddp)" in message, message
        assert "make_hook(spec, ddp)" in message and "before the first backward" in message, message


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("mode", ["ddp", "module_then_ddp"])
def test_binding_to_the_ddp_model_first_removes_the_warning_and_keeps_the_residual(results: list[dict], mode: str,
                                                                                   set_to_none: bool) -> None:
    for rank, r in enumerate(results):
        run = r[(mode, set_to_none)]
        assert run["warnings"] == [], f"rank {rank}: {run['warnings']}"
        before, after = run["residuals"][0]["b.weight"], run["residuals"][1]["b.weight"]
        assert before.abs().sum() > 0 and torch.equal(after, before), f"rank {rank}: b's residual moved at step 1"
        assert not torch.equal(run["residuals"][2]["b.weight"], after)  # used by rank 0 at step 2: exchanged


def test_the_unbound_state_loses_the_residual_it_warns_about(results: list[dict]) -> None:
    """What the warning is about, shown: bound to the bare module, ``b``'s
    residual is sent at step 1 (it moves) and DDP discards it."""
    for r in results:
        run = r[("module", False)]
        assert not torch.equal(run["residuals"][1]["b.weight"], run["residuals"][0]["b.weight"])


def test_a_model_with_every_parameter_used_does_not_warn(results: list[dict]) -> None:
    for r in results:
        assert r["all_used"]["warnings"] == []
