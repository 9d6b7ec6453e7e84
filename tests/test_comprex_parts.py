"""The parts of Comprex (issue 19) in one process: the ratio schedule (DGC's
warm-up as an instance), clipping and momentum before compression against
float64 formulas, the background runner's order, errors and timing, and
parameter validation."""

from __future__ import annotations

import math
import time

import pytest
import torch

import gradpress.algorithms as algorithms
from gradpress.algorithms.comprex_optim import LocalMomentum, clip_by_total_norm
from gradpress.algorithms.comprex_schedule import RatioSchedule, ratio_holder
from gradpress.compress import create
from gradpress.exchange.background import Background, BackgroundError


# ------------------------------------------------------------------ schedule
def test_schedules_follow_their_formulas() -> None:
    start, target, n = 0.5, 0.01, 10
    lin = RatioSchedule("linear", start, target, n)
    exp = RatioSchedule("exponential", start, target, n)
    const = RatioSchedule("constant", start, target, n)
    for t in range(-1, 15):
        f = min(max(t, 0), n) / n
        assert lin(t) == pytest.approx(start + (target - start) * f, rel=1e-12)
        assert exp(t) == pytest.approx(math.exp((1 - f) * math.log(start) + f * math.log(target)), rel=1e-12)
        assert const(t) == target
    assert lin(n) == target and exp(n) == target and exp(10**9) == target
    assert RatioSchedule("exponential", start, target, 0)(0) == target  # no warm-up: the target at once


def test_dgc_warmup_is_an_instance() -> None:
    """DGC: delta_e = delta^((e + 1) / (W + 1)) for epoch e < W, then delta."""
    delta, w, per_epoch = 0.001, 4, 25
    sched = RatioSchedule("exponential", delta ** (1 / (w + 1)), delta, w * per_epoch, stages=w)
    for t in range(0, (w + 2) * per_epoch):
        e = t // per_epoch
        want = delta ** ((e + 1) / (w + 1)) if e < w else delta
        assert sched(t) == pytest.approx(want, rel=1e-12), (t, sched(t), want)
    assert [round(sched(e * per_epoch), 4) for e in range(5)] == [0.2512, 0.0631, 0.0158, 0.004, 0.001]


@pytest.mark.parametrize("kwargs, field", [
    ({"kind": "cosine"}, "schedule"), ({"start": 0.0}, "start_ratio"), ({"start": 1.5}, "start_ratio"),
    ({"warmup": -1}, "warmup"), ({"stages": 20}, "stages"), ({"target": 0.0}, "ratio"),
])
def test_schedule_errors_name_the_field(kwargs: dict, field: str) -> None:
    args = {"kind": "linear", "start": 0.5, "target": 0.01, "warmup": 10, "stages": 0, **kwargs}
    with pytest.raises(ValueError, match=f"parameter '{field}'.*allowed"):
        RatioSchedule(**args)


def test_ratio_holder_finds_the_density() -> None:
    assert ratio_holder(create("topk:ratio=0.05")).ratio == 0.05
    composed = create("topk:ratio=0.05>natural")
    assert ratio_holder(composed) is composed.first
    assert ratio_holder(create("qsgd")) is None


@pytest.mark.parametrize("spec, field", [("comprex:staleness=3", "staleness"), ("comprex:update=adam", "update"),
                                         ("comprex:clip=-1", "clip"), ("comprex:momentum=1", "momentum"),
                                         ("comprex:schedule=step", "schedule"), ("comprex:rebroadcast_every=-2",
                                                                                 "rebroadcast_every")])
def test_bad_parameters_are_refused_naming_them(spec: str, field: str) -> None:
    with pytest.raises(ValueError, match=f"parameter '{field}'.*allowed"):
        algorithms.parse(spec)


# ------------------------------------------------------------------ optimizer
def _grads(seed: int, scale: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 7, generator=g, dtype=torch.float64) * scale, torch.randn(7, generator=g,
                                                                                     dtype=torch.float64) * scale]


@pytest.mark.parametrize("scale", [0.01, 10.0])
def test_clipping_matches_the_total_norm_formula(scale: float) -> None:
    grads = _grads(0, scale)
    total = math.sqrt(sum(float((g * g).sum()) for g in grads))
    want = [g * min(1.0, 5.0 / (total + 1e-6)) for g in grads]
    got = [g.clone() for g in grads]
    norm = clip_by_total_norm(got, 5.0)
    assert float(norm) == pytest.approx(total, rel=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=0)
    clipped = math.sqrt(sum(float((g * g).sum()) for g in got))
    assert clipped <= 5.0 + 1e-9 and (scale < 1 or clipped == pytest.approx(5.0, rel=1e-6))
    untouched = [g.clone() for g in grads]
    clip_by_total_norm(untouched, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(untouched, grads))


def test_momentum_is_kept_before_compression() -> None:
    """m <- mu m + lr (g + wd x); the payload is a fresh copy of m."""
    params = [torch.randn(5, 7, dtype=torch.float64), torch.randn(7, dtype=torch.float64)]
    mom = LocalMomentum(params, 0.9)
    want = [torch.zeros_like(p) for p in params]
    for step in range(4):
        grads = _grads(step + 1, 1.0)
        lr, wd = 0.1 / (step + 1), 1e-3
        out = mom.update(grads, params, [lr, lr], [wd, 0.0])
        want = [0.9 * want[0] + lr * (grads[0] + wd * params[0]), 0.9 * want[1] + lr * grads[1]]
        for o, w, m in zip(out, want, mom.buffers):
            torch.testing.assert_close(o, w, rtol=1e-14, atol=1e-15)
            assert o.data_ptr() != m.data_ptr(), "the payload must not alias the buffer"
        out[0].zero_()  # the exchange overwrites the payload; the buffer stays
        assert not torch.equal(mom.buffers[0], torch.zeros_like(params[0]))


def test_nonfinite_gradient_leaves_momentum_as_it_was() -> None:
    params = [torch.ones(3, 3, dtype=torch.float64)]
    mom = LocalMomentum(params, 0.9)
    mom.update([torch.ones(3, 3, dtype=torch.float64)], params, [0.1], [0.0])
    before = mom.buffers[0].clone()
    bad = torch.ones(3, 3, dtype=torch.float64)
    bad[1, 1] = float("nan")
    out = mom.update([bad], params, [0.1], [0.0])
    assert torch.equal(mom.buffers[0], before)
    assert torch.isnan(out[0]).any(), "the NaN must still travel so that every rank sees the bad step"
    with pytest.raises(ValueError, match="momentum"):
        mom.load_state_dict([torch.zeros(2)])


# ----------------------------------------------------------------- background
def test_background_runs_jobs_in_order_and_reports_overlap() -> None:
    bg = Background("test")
    order: list[int] = []
    t0 = time.perf_counter()
    tickets = [bg.submit(f"job {i}", lambda i=i: (time.sleep(0.05), order.append(i), i)[2]) for i in range(3)]
    time.sleep(0.3)  # the "compute" the jobs hide behind
    assert [bg.wait(t) for t in tickets] == [0, 1, 2] and order == [0, 1, 2]
    wall = time.perf_counter() - t0
    timing = bg.timing()
    assert 0.15 <= timing["exchange_s"] <= wall and timing["overlap"] > 0.5, (timing, wall)
    assert all(0.05 <= t.busy_s <= wall for t in tickets), [t.busy_s for t in tickets]
    assert bg.run("inline", lambda: 7) == 7
    bg.close()
    assert bg.in_flight == 0


def test_background_error_names_the_job_and_later_jobs_fail_fast() -> None:
    bg = Background("comprex rank 0")

    def boom() -> None:
        raise RuntimeError("Connection reset by peer")

    bad = bg.submit("of step 4", boom)
    later = bg.submit("of step 5", lambda: 1)
    with pytest.raises(BackgroundError, match=r"comprex rank 0: the background exchange of step 4 failed.*reset"):
        bg.wait(bad)
    with pytest.raises(BackgroundError, match="of step 5 failed.*earlier background job failed"):
        bg.wait(later)
    with pytest.raises(BackgroundError, match="inline"):
        Background("x").run("inline", boom)
    bg.close()


def test_close_raises_a_failure_nobody_saw_but_not_one_already_raised() -> None:
    def boom() -> None:
        raise RuntimeError("Timed out waiting 5000ms for recv")

    unseen = Background("unseen")
    unseen.submit("of step 1", boom)
    with pytest.raises(BackgroundError, match="of step 1 failed.*Timed out"):
        unseen.close()
    seen = Background("seen")
    ticket = seen.submit("of step 1", boom)
    with pytest.raises(BackgroundError):
        seen.wait(ticket)
    seen.close()  # a `finally: algo.close()` does not mask the error the loop is raising


def test_saved_buffers_of_another_model_are_refused_naming_them() -> None:
    from gradpress.algorithms.comprex_lookahead import LookAhead

    params = [torch.zeros(3, 2), torch.zeros(4)]
    mom, look = LocalMomentum(params, 0.9), LookAhead(params)
    for obj, field in ((mom, "momentum"), (look, "shared_weights")):
        for bad in ([torch.zeros(3, 2)], [torch.zeros(3, 2), torch.zeros(5)], [torch.zeros(3, 2), "x"]):
            with pytest.raises(ValueError, match=f"'{field}'.*another model"):
                obj.load_state_dict(bad)
    saved = [torch.ones(3, 2, dtype=torch.float64), torch.full((4,), 2.0, dtype=torch.float64)]
    look.load_state_dict(saved)
    assert [x.dtype for x in look.shadow] == [torch.float32, torch.float32]
    assert torch.equal(look.shadow[1], torch.full((4,), 2.0))
    saved[1].zero_()  # copies, not views of the saved tensors
    assert torch.equal(look.shadow[1], torch.full((4,), 2.0))


def test_keep_now_keeps_a_finite_residual_and_refuses_a_nonfinite_one() -> None:
    """Compression ahead keeps residuals at once by the local rule."""
    from gradpress.exchange.feedback import Feedback

    fb = Feedback()
    fb.keep_now("w", torch.tensor([1.0, -2.0]))
    assert torch.equal(fb.residuals["w"], torch.tensor([1.0, -2.0]))
    fb.keep_now("w", torch.tensor([float("nan"), 3.0]))  # not finite: the previous residual stays
    assert torch.equal(fb.residuals["w"], torch.tensor([1.0, -2.0]))
    fb.keep_now("b", torch.tensor([float("inf")]))  # none before: zeros, never a non-finite residual
    assert torch.equal(fb.residuals["b"], torch.zeros(1))
    assert torch.equal(fb.compensate("w", torch.tensor([0.5, 0.5])), torch.tensor([1.5, -1.5]))
