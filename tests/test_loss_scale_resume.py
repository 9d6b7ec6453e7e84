"""A hook state kept in a loss scale, resumed without a scaler (fp16 AMP, then bf16 or fp32).

The state dict records the scale its residuals are kept in (``loss_scale``). Resumed by a hook with no scaler,
they must be brought back to scale 1 before they are fed back: the float64 reference is the run that never
scaled (error-feedback top-k by its definition). Before the fix the residual was fed back 2**10 times too large.
Also covered: a compressor's own buffers in gradient units (DGC's momentum and velocity,
``Compressor.gradient_state``; reference ``references.dgc_run``), and a state loaded before the hook binds
(``make_hook(spec)``, ``load_state_dict``, then ``bind``, as Lightning does; or bound by the first backward),
a state reloaded under a scaler at a step whose scale the hook had already read (it reads it again), and
every scale-free average of a call (two tensors in one bucket) multiplied by the scale (the ``plants7`` session).
One process (a one-rank gloo group): the average of one rank is its own decoded message.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn
from distributed import one_rank_module
from references import dgc_run, error_feedback_topk_run
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress

group = one_rank_module  # the module's fixture
SHAPE = (8, 16)
RATIO = 0.125
SCALE = 2.0 ** 10
BETA = 0.9  # DGC's momentum (its default)
TOPK = f"topk:ratio={RATIO}"
DGC = f"dgc:ratio={RATIO}"  # 128 entries: the sampled threshold samples them all, so it selects the exact top-k


class _Scripted:
    """A scaler's reading side at a fixed scale."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def get_scale(self) -> float:
        return self.scale


class _Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(SHAPE, dtype=torch.float64))

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return (self.w * g).sum()


def _grad(step: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(7 + step), dtype=torch.float64)


def _reference(steps: int) -> list[torch.Tensor | None]:
    """Error-feedback top-k, unscaled, one rank."""
    return error_feedback_topk_run(lambda rank, step: _grad(step), 1, steps, RATIO)


def _dgc_reference(steps: int) -> list[torch.Tensor | None]:
    """DGC by its definition (no clipping, no warm-up), unscaled, one rank."""
    return dgc_run(lambda step: [_grad(step)], steps, lambda step: True, RATIO, BETA)


def _saved_under_scale(spec: str, lazy: bool) -> tuple[list[torch.Tensor], bytes]:
    """Two steps of ``spec`` under the loss scale: the unscaled averages and the saved state dict. ``lazy``: the
    hook binds itself at its first backward (keys ``param{i}``: its state loads only into one bound alike)."""
    model = _Probe()
    ddp = DDP(model)
    if lazy:
        hook, fn = gradpress.ddp.make_hook(spec, min_numel=1, scaler=_Scripted(SCALE))
        ddp.register_comm_hook(hook, fn)
    else:
        hook = gradpress.ddp.register(ddp, spec, min_numel=1, scaler=_Scripted(SCALE))
    got = []
    for step in range(2):
        model.zero_grad(set_to_none=True)
        ddp(_grad(step) * SCALE).backward()
        got.append(model.w.grad / SCALE)
    buf = io.BytesIO()
    torch.save(hook.state_dict(), buf)
    hook.close()
    assert hook.loss_scale == SCALE
    return got, buf.getvalue()


def _resumed(spec: str, saved: bytes, how: str) -> list[torch.Tensor]:
    """Steps 2 and 3 without a scaler, from ``saved``: loaded into a bound hook (``bound``), into an unbound one
    then bound (``pending``: make_hook, load_state_dict, bind), or into one that binds at its first backward
    (``first-backward``)."""
    state = torch.load(io.BytesIO(saved), weights_only=True)
    model = _Probe()
    ddp = DDP(model)
    if how == "bound":
        hook = gradpress.ddp.register(ddp, spec, min_numel=1)
        hook.load_state_dict(state)
    else:
        hook, fn = gradpress.ddp.make_hook(spec, min_numel=1)
        hook.load_state_dict(state)
        assert not hook.bound
        if how == "pending":
            hook.bind(ddp)
        ddp.register_comm_hook(hook, fn)
    got = []
    for step in range(2, 4):
        model.zero_grad(set_to_none=True)
        ddp(_grad(step)).backward()
        got.append(model.w.grad.clone())
    assert hook.loss_scale is None
    assert hook.step == 4
    hook.close()
    return got


@pytest.mark.parametrize(("spec", "how"), [(TOPK, "bound"), (TOPK, "pending"), (TOPK, "first-backward"),
                                           (DGC, "bound"), (DGC, "pending"), (DGC, "first-backward")])
def test_compressor_buffers_and_a_state_loaded_before_binding_resume_at_scale_one(group, spec: str,  # noqa: ANN001
                                                                                   how: str) -> None:
    got, saved = _saved_under_scale(spec, lazy=how == "first-backward")
    got += _resumed(spec, saved, how)
    ref = _reference(4) if spec == TOPK else _dgc_reference(4)
    for step, (g, want) in enumerate(zip(got, ref, strict=True)):
        assert torch.allclose(g, want, rtol=1e-12, atol=1e-12), (
            f"{spec} ({how}) step {step}: differs from the unscaled float64 definition by "
            f"{float((g - want).abs().max()):.3g}")


def test_a_state_reloaded_at_the_step_whose_scale_was_read_reads_the_scale_again(group) -> None:  # noqa: ANN001
    """A state loaded into a live hook at a step number it has already run (a roll back to the checkpoint of
    that step) is in the checkpoint's scale: the hook reads the scaler again at that step, even though it read
    it there before (``plants7``: without forgetting the step read, ``restore`` left the residual kept at
    2**10 fed into a gradient scaled by 2**9, off the float64 definition)."""
    scaler = _Scripted(SCALE)
    model = _Probe()
    ddp = DDP(model)
    hook = gradpress.ddp.register(ddp, TOPK, min_numel=1, scaler=scaler)

    def step(s: int) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        ddp(_grad(s) * scaler.scale).backward()
        return model.w.grad / scaler.scale

    step(0)
    saved = hook.state_dict()  # hook step 1, kept in SCALE
    step(1)  # the hook read the scale at step 1
    scaler.scale = SCALE / 2  # the step overflowed somewhere: the scaler backed off
    hook.load_state_dict(saved)  # back to step 1
    got = step(1)
    hook.close()
    want = _reference(2)[1]
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (
        f"step 1 replayed after the reload differs from the unscaled float64 definition by "
        f"{float((got - want).abs().max()):.3g}")
    assert hook.loss_scale == SCALE / 2


class _Pair(nn.Module):
    """Two parameters of different shapes in one DDP bucket (one engine call, two compressed tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(SHAPE, dtype=torch.float64))
        self.b = nn.Parameter(torch.zeros(SHAPE[::-1], dtype=torch.float64))

    def forward(self, g: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return (self.a * g).sum() + (self.b * h).sum()


@pytest.mark.parametrize("spec", ["signsgd", "signum"])
def test_every_scale_free_average_of_a_call_carries_the_scale(group, spec: str) -> None:  # noqa: ANN001
    """A scale-free compressor's averages (``scale_degree`` 0: +-1) are multiplied by the step's scale, every
    tensor of the call, not the first only (``plants7``: ``comp_idx[:1]`` went unnoticed, every other test
    gives the hook one tensor). One rank: the average is the rank's own sign, sign(0) = +1; Signum's first
    step's momentum is (1 - beta) g, of g's sign."""
    model = _Pair()
    ddp = DDP(model)
    hook = gradpress.ddp.register(ddp, spec, min_numel=1, scaler=_Scripted(SCALE))
    g, h = _grad(0), _grad(1).t().contiguous()
    ddp(g * SCALE, h * SCALE).backward()
    hook.close()
    for name, x, grad in (("a", g, model.a.grad), ("b", h, model.b.grad)):
        want = torch.where(x >= 0, 1.0, -1.0).double() * SCALE
        assert torch.equal(grad, want), f"{spec}: parameter {name}'s average is not sign(g) * the loss scale"
