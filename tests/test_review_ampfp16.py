"""fp16 wires under ``GradScaler`` let an overflow reach the scaler (fp16 AMP with the DDP hook; 2 gloo workers,
one launch, about 10 s).

Without a loss scaler, ``fp16``/``bf16`` saturate at the format's maximum (the cast clamps, and each summand is
bounded so that a 16-bit sum cannot overflow): an average beyond 65504 is finite. Under a loss scaler that hid
every overflow from it: the scaled gradient exceeds fp16's range at the start (init scale 65536), the codec
handed the optimizer a clipped value, the scaler never backed off, and the update was silently clipped at every
step. With a scaler attached the rule is plain fp16 AMP's (PyTorch's ``fp16_compress_hook``: divide by N, cast,
sum in fp16): an overflow of the cast or of the 16-bit sum is Inf, the scaler skips the step and halves the scale.

Every gradient is a fixed tensor G (the loss is ``sum(w * G)``: ``w.grad`` is G times the loss scale, exactly),
of distinct magnitudes k/64 (1/64 to 8): every value and sum here is exact in fp16 at every power-of-two scale,
so the float64 reference below is exact. SGD with lr=1 makes the optimizer's update -average / scale.

* ``fp16`` by allreduce, by ring and by PS (its root sums the payloads in fp16), ``topk:ratio=0.25>fp16`` (its values cast to fp16, allgathered): the
  sequence of scales and of unscaled updates equals the float64 reference of plain AMP with an fp16 wire (a
  step whose cast or 16-bit sum overflows is skipped, the scale halves; growth x2 every 2 good steps), and the
  run without a scaler hands the optimizer the same decoded values;
* in one process: ``Context.loss_scaler`` must be a bool; with it ``fp16``'s and ``bf16``'s casts overflow to
  Inf, without it they saturate (unchanged).
"""

from __future__ import annotations

import math

import pytest
import torch
from amp_helpers import Probe, cpu_scaler, run_scaler_workers, scaled_steps
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress

SHAPE = (16, 32)  # 512 entries: compressed (min_numel below)
MIN_NUMEL = 64
STEPS = 12
INIT_SCALE = 2.0**16
GROWTH_INTERVAL = 2
FP16_INF_AT = 65520.0  # fp16's max 65504 plus half its top spacing (32): round-to-nearest gives Inf from here
RATIO = 0.25
K = int(RATIO * SHAPE[0] * SHAPE[1])
TOPK_FP16 = f"topk:ratio={RATIO}>fp16"
#: (spec, strategy) under test
RUNS = (("fp16", "collective"), ("fp16", "ring"), ("fp16", "ps"), (TOPK_FP16, "collective"))


def _grad(rank: int, step: int) -> torch.Tensor:
    """Distinct magnitudes 1/64 .. 8 (a permutation), random signs."""
    gen = torch.Generator().manual_seed(1000 * step + rank + 29)
    mags = (torch.randperm(SHAPE[0] * SHAPE[1], generator=gen) + 1).double() / 64
    signs = torch.randint(0, 2, mags.shape, generator=gen).double() * 2 - 1
    return (mags * signs).reshape(SHAPE).float()


def _train(rank: int, spec: str, strategy: str, scaled: bool) -> dict:
    """Per step: the scale of the backward, the averaged ``w.grad`` and the optimizer's update, in float64."""
    model = Probe(SHAPE)
    ddp = DDP(model)
    scaler = cpu_scaler(INIT_SCALE, GROWTH_INTERVAL) if scaled else None
    hook = gradpress.ddp.register(ddp, spec, strategy=strategy, min_numel=MIN_NUMEL, scaler=scaler,
                                  error_feedback=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    out = scaled_steps(model, ddp, opt, scaler, lambda step: _grad(rank, step), range(STEPS), plain_step=True)
    hook.close()
    return out


def _workers(rank: int, world: int) -> dict:
    return {run: (_train(rank, *run, scaled=True), _train(rank, *run, scaled=False)) for run in RUNS}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_scaler_workers(_workers, 2)


def _fp16(v: torch.Tensor) -> torch.Tensor:
    """``v`` (float64) through an fp16 wire: Inf where round-to-nearest overflows; the test's values are exact
    in fp16 otherwise (checked)."""
    out = torch.where(v.abs() >= FP16_INF_AT, v.sign() * math.inf, v)
    finite = out[torch.isfinite(out)]
    assert torch.equal(finite, finite.to(torch.float16).double()), "test values must be exact in fp16"
    return out


def _sent(spec: str, g: torch.Tensor) -> torch.Tensor:
    """What a rank's codec keeps of ``g`` before the cast: all of it, or its top-K by magnitude."""
    if spec == "fp16":
        return g
    out = torch.zeros_like(g).reshape(-1)
    idx = g.reshape(-1).abs().topk(K).indices
    out[idx] = g.reshape(-1)[idx]
    return out.reshape(g.shape)


def _average(spec: str, gs: list[torch.Tensor], s: float) -> torch.Tensor:
    """The decoded scaled average of plain AMP with an fp16 wire: ``fp16`` is summable (each rank casts
    s * g / N, the payloads are summed in fp16); ``topk>fp16`` casts each rank's kept s * g, decodes, averages."""
    n = len(gs)
    if spec == "fp16":
        return _fp16(sum(_fp16(s * g / n) for g in gs))
    return sum(_fp16(s * _sent(spec, g)) for g in gs) / n


def _reference(spec: str, world: int) -> tuple[list[float], list[torch.Tensor | None], list[torch.Tensor]]:
    """Per step the scale, the unscaled average (None: overflowed, skipped) and the optimizer's update; the
    scale halves after an overflow and doubles after GROWTH_INTERVAL good steps in a row (GradScaler's rule)."""
    s, good = INIT_SCALE, 0
    scales, avgs, updates = [], [], []
    for step in range(STEPS):
        gs = [_grad(r, step).double() for r in range(world)]
        avg = _average(spec, gs, s)
        scales.append(s)
        if not bool(torch.isfinite(avg).all()):
            avgs.append(None)
            updates.append(torch.zeros(SHAPE, dtype=torch.float64))
            s, good = s * 0.5, 0
            continue
        avgs.append(avg / s)
        updates.append(-avg / s)
        good += 1
        if good == GROWTH_INTERVAL:
            s, good = s * 2.0, 0
    return scales, avgs, updates


@pytest.mark.parametrize(("spec", "strategy"), RUNS)
def test_an_fp16_overflow_reaches_the_scaler_as_in_plain_amp(results: list[dict], spec: str, strategy: str) -> None:
    scales, avgs, updates = _reference(spec, 2)
    skipped = [i for i, a in enumerate(avgs) if a is None]
    assert skipped[:1] == [0] and len(skipped) < STEPS - 2, f"the test's data must overflow at first: {scales}"
    for rank, res in enumerate(results):
        scaled, plain = res[(spec, strategy)]
        assert scaled["scales"] == scales, (f"{spec} {strategy} rank {rank}: the scaler's scales {scaled['scales']} "
                                            f"differ from plain AMP's with an fp16 wire {scales}")
        for step in range(STEPS):
            where = f"{spec} {strategy} rank {rank} step {step} (scale {scales[step]})"
            if avgs[step] is None:
                assert not bool(torch.isfinite(scaled["grads"][step]).all()), f"{where}: the overflow was hidden"
            else:
                assert torch.equal(scaled["grads"][step] / scales[step], avgs[step]), f"{where}: unscaled average"
                assert torch.equal(plain["grads"][step], avgs[step]), f"{where}: the run without a scaler"
            assert torch.equal(scaled["updates"][step], updates[step]), f"{where}: the optimizer's update"


def test_the_context_says_whether_a_loss_scaler_is_attached() -> None:
    from gradpress.compress import Context, create

    with pytest.raises(ValueError, match=r"Context: loss_scaler must be a bool \(True: a loss scaler is attached"):
        Context(key="t", loss_scaler=1)
    codec = create("fp16")
    x = torch.tensor([1.0, 70000.0, -1e6, 65519.0])
    saturated = codec.decode(codec.encode(x, Context(key="t")))
    assert saturated.tolist() == [1.0, 65504.0, -65504.0, 65504.0]
    overflowed = codec.decode(codec.encode(x, Context(key="t", loss_scale=2.0**16, loss_scaler=True)))
    assert overflowed.tolist() == [1.0, math.inf, -math.inf, 65504.0]
    bf16 = create("bf16")
    big = torch.tensor([3.4e38, -3.4e38, 2.0])  # fp32, beyond bf16's max 3.39e38
    assert bf16.decode(bf16.encode(big, Context(key="t"))).abs()[:2].tolist() == [torch.finfo(torch.bfloat16).max] * 2
    assert bf16.decode(bf16.encode(big, Context(key="t", loss_scaler=True))).tolist() == [math.inf, -math.inf, 2.0]
