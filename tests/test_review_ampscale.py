"""Error feedback follows ``GradScaler``'s loss scale (fp16 AMP with the DDP hook; 2 gloo workers, about 20 s).

With fp16 autocast and ``torch.amp.GradScaler`` the hook compresses the *scaled* gradient, so a residual
(and a compressor buffer in gradient units: DGC's momentum and velocity, AdaComp's residue, Signum's
momentum) is kept in the scale of its step. When the scaler changes the scale (x2 growth every
``growth_interval`` steps, x0.5 after an overflow) that state was fed back off by that factor once.
``register(..., scaler=scaler)`` (or ``hook.attach_scaler`` before the hook binds) reads the scale once per step and multiplies
that state by new/old first.

Every gradient here is a fixed tensor G (the loss is ``sum(w * G)``, so ``w.grad`` is G times the loss
scale, exactly: the scales are powers of two), rank 1's holding an Inf at one step, where the scaler skips
the optimizer step and halves the scale. The scales of the run: growth (x2) twice and one back-off (x0.5).

* top-k with error feedback: the unscaled averages of the scaled run equal the float64 reference computed
  here by the definition (``p = e + G``, send top-k of ``p``, ``e = p - sent``; the overflow step leaves
  every residual as it was), up to float32 rounding;
* every other state in gradient units (DGC, AdaComp, Signum), PowerSGD (its Q is scale-free, its residual
  is not) and the ring's and PS root's own residuals: the scaled run's unscaled averages equal the same
  run without loss scaling (Signum's majority vote, +-1 times the scale of its step, unscaled: the same
  votes bit for bit);
* the scale the residuals are kept in is in the hook's ``state_dict`` (``weights_only=True``): a run
  interrupted right before a back-off resumes bit-identically;
* one scale read per step, not per bucket; a scaler with ``nonfinite='skip'`` or ``'raise'`` (which hide
  an overflow from the scaler, or fail on it) and an object without ``get_scale`` are refused by name
  (these two with a scripted scaler: they run on a torch without a CPU ``GradScaler``, such as 2.2.2).
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from amp_helpers import (
    Probe,
    check_unscaled_averages,
    close,
    cpu_scaler,
    grown_and_backed_off,
    run_scaler_workers,
    scaled_steps,
)
from distributed import run_workers
from references import error_feedback_topk_run
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress

SHAPE = (16, 32)  # 512 entries: compressed (min_numel below)
MIN_NUMEL = 64
STEPS = 8
OVERFLOW = 4  # rank 1's gradient holds an Inf at this step
RATIO = 0.05
TOPK = f"topk:ratio={RATIO}"
INIT_SCALE = 2.0**10
#: (spec, strategy, what to compare): "unscaled" compares w.grad / scale, "votes" too but bit for bit (+-1)
EQUIVARIANT = (
    ("dgc:ratio=0.05", "collective", "unscaled"),
    ("adacomp", "collective", "unscaled"),
    ("signum", "collective", "votes"),
    ("powersgd:rank=2,start_iter=0", "collective", "unscaled"),
    (TOPK, "ring", "unscaled"),
    (TOPK, "ps", "unscaled"),
)


def _grad(rank: int, step: int) -> torch.Tensor:
    g = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1000 * step + rank))
    if rank == 1 and step == OVERFLOW:
        g[3, 5] = math.inf
    return g


def _train(rank: int, spec: str, strategy: str, scaled: bool, start: int = 0, stop: int = STEPS,
           saved: bytes | None = None) -> dict:
    """Steps ``start..stop-1``; per step the averaged ``w.grad`` in float64 and the scale of its backward.
    ``saved``: the hook's and the scaler's states (torch.save) to resume from."""
    model = Probe(SHAPE)
    ddp = DDP(model)
    scaler = cpu_scaler(INIT_SCALE) if scaled else None
    # without a scaler the overflowed step is dropped with nonfinite='skip' (what a scaler's skip is to
    # 'propagate' with one attached: every state of the step put back)
    hook = gradpress.ddp.register(ddp, spec, strategy=strategy, min_numel=MIN_NUMEL, scaler=scaler,
                                  nonfinite="propagate" if scaled else "skip")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # w stays 0: the gradients are the fixed G times the scale
    if saved is not None:
        state = torch.load(io.BytesIO(saved), weights_only=True)
        hook.load_state_dict(state["hook"])
        scaler.load_state_dict(state["scaler"])
    out = scaled_steps(model, ddp, opt, scaler, lambda step: _grad(rank, step), range(start, stop))
    buf = io.BytesIO()
    torch.save({"hook": hook.state_dict(), "scaler": scaler.state_dict() if scaler is not None else {}}, buf)
    hook.close()
    return {**out, "state": buf.getvalue()}


def _workers(rank: int, world: int) -> dict:
    out: dict = {"topk": _train(rank, TOPK, "collective", True)}
    for spec, strategy, _ in EQUIVARIANT:
        out[(spec, strategy)] = (_train(rank, spec, strategy, True), _train(rank, spec, strategy, False))
    first = _train(rank, TOPK, "collective", True, stop=OVERFLOW + 1)
    out["resumed"] = _train(rank, TOPK, "collective", True, start=OVERFLOW + 1, saved=first["state"])
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_scaler_workers(_workers, 2)


def _scripted_workers(rank: int, world: int) -> dict:
    return {"reads": _count_reads(rank), "refusals": _refusals()}


@pytest.fixture(scope="module")
def scripted_results() -> list[dict]:
    return run_workers(_scripted_workers, 2)


def _reference(world: int) -> list[torch.Tensor | None]:
    """Error-feedback top-k by the definition, in float64, without any loss scale: per step the average
    over ranks of what each sends (None at the overflow step, which leaves every residual as it was)."""
    return error_feedback_topk_run(_grad, world, STEPS, RATIO)


def test_the_scale_sequence_grows_and_backs_off(results: list[dict]) -> None:
    want = grown_and_backed_off(INIT_SCALE)  # x2 every 2 good steps, x0.5 after the overflow
    for res in results:
        assert res["topk"]["scales"] == want, res["topk"]["scales"]


def test_error_feedback_topk_under_a_changing_loss_scale_matches_the_unscaled_definition(
        results: list[dict]) -> None:
    ref = _reference(2)
    for rank, res in enumerate(results):
        check_unscaled_averages(res["topk"], ref, f"rank {rank}")


@pytest.mark.parametrize(("spec", "strategy", "compare"), EQUIVARIANT)
def test_state_in_gradient_units_follows_the_scale(results: list[dict], spec: str, strategy: str,
                                                     compare: str) -> None:
    for rank, res in enumerate(results):
        scaled, plain = res[(spec, strategy)]
        for step in range(STEPS):
            if step == OVERFLOW:
                continue
            got, want = scaled["grads"][step], plain["grads"][step]
            if compare == "unscaled":
                got = got / scaled["scales"][step]
                assert close(got, want), (f"{spec} {strategy} rank {rank} step {step}: differs from the run "
                                           f"without loss scaling by {float((got - want).abs().max()):.3g}")
            else:
                got = got / scaled["scales"][step]
                assert torch.equal(got, want), f"{spec} rank {rank} step {step}: votes differ from the unscaled run"


def test_resume_right_before_a_back_off_is_bit_identical(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        straight, resumed = res["topk"], res["resumed"]
        assert resumed["scales"] == straight["scales"][OVERFLOW + 1:]
        for i, g in enumerate(resumed["grads"]):
            assert torch.equal(g, straight["grads"][OVERFLOW + 1 + i]), f"rank {rank} step {OVERFLOW + 1 + i}"
        state = torch.load(io.BytesIO(straight["state"]), weights_only=True)["hook"]
        assert state["loss_scale"] == straight["scales"][-1], state.get("loss_scale")


class _Scripted:
    """A scaler's reading side: ``get_scale`` returns the scale of the current step and counts its calls."""

    def __init__(self, scales: list[float]) -> None:
        self.scales, self.step, self.calls = scales, 0, 0

    def get_scale(self) -> float:
        self.calls += 1
        return self.scales[self.step]


def _count_reads(rank: int) -> dict:
    """Three parameters in several buckets; the scale is read once per step."""
    model = Probe(SHAPE, extra=2)
    ddp = DDP(model, bucket_cap_mb=SHAPE[0] * SHAPE[1] * 4 / 2**20)
    scripted = _Scripted([1.0, 2.0, 2.0, 0.5])
    hook = gradpress.ddp.register(ddp, TOPK, min_numel=MIN_NUMEL, scaler=scripted)
    submitted = []
    submit = hook.submit
    hook.submit = lambda bucket: submitted.append(bucket.index()) or submit(bucket)  # counts DDP's buckets
    for step in range(4):
        scripted.step = step
        ddp(_grad(rank, step) * scripted.scales[step]).backward()
    out = {"calls": scripted.calls, "loss_scale": hook.loss_scale, "buckets": len(submitted)}
    hook.close()
    return out


def test_the_scale_is_read_once_per_step(scripted_results: list[dict]) -> None:
    for res in scripted_results:
        assert res["reads"]["buckets"] > 4, res["reads"]  # several buckets per step
        assert res["reads"]["calls"] == 4, res["reads"]
        assert res["reads"]["loss_scale"] == 0.5


def _refusals() -> dict:
    out = {}
    for label, kwargs in (("skip", {"nonfinite": "skip", "scaler": _Scripted([1.0])}),
                          ("raise", {"nonfinite": "raise", "scaler": _Scripted([1.0])}),
                          ("object", {"scaler": object()})):
        try:
            gradpress.ddp.register(DDP(Probe(SHAPE)), TOPK, min_numel=MIN_NUMEL, **kwargs).close()
            out[label] = "accepted"
        except ValueError as exc:
            out[label] = str(exc)
    hook = gradpress.ddp.register(DDP(Probe(SHAPE)), TOPK, min_numel=MIN_NUMEL, nonfinite="skip")
    try:
        hook.attach_scaler(_Scripted([1.0]))
        out["attach"] = "accepted"
    except ValueError as exc:
        out["attach"] = str(exc)
    hook.close()
    try:
        gradpress.ddp.make_hook(TOPK, nonfinite="skip", scaler=_Scripted([1.0]))
        out["unbound"] = "accepted"
    except ValueError as exc:
        out["unbound"] = str(exc)
    return out


def test_a_scaler_is_refused_with_skip_or_raise_and_without_get_scale(scripted_results: list[dict]) -> None:
    for res in scripted_results:
        r = res["refusals"]
        for label in ("skip", "raise", "attach", "unbound"):
            assert "nonfinite" in r[label] and "scaler" in r[label] and "propagate" in r[label], (label, r[label])
        assert "scaler" in r["object"] and "get_scale" in r["object"] and "object" in r["object"], r["object"]


@pytest.mark.parametrize("bad", [0.0, -2.0, math.inf, -math.inf, math.nan, True, "1024", [1024.0]])
def test_a_saved_loss_scale_that_is_not_a_finite_positive_number_is_refused(bad: object) -> None:
    """A hook state's ``loss_scale`` is None or a finite number > 0: each
    other value is refused naming the field (a mutant that refused only
    values both non-finite *and* <= 0 let 0, -2 and +inf through)."""
    from gradpress.ddp.loss_scale import check_kept

    with pytest.raises(ValueError, match=r"'loss_scale' must be None or a finite number > 0, got "):
        check_kept(bad)


def test_a_saved_loss_scale_is_kept_as_a_float() -> None:
    from gradpress.ddp.loss_scale import check_kept

    assert check_kept(None) is None
    assert check_kept(65536) == 65536.0 and isinstance(check_kept(65536), float)
    assert check_kept(2.0 ** -24) == 2.0 ** -24
