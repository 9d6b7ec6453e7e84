"""fp16 loss scaling in the algorithms layer: ``gradpress.algorithms.create(..., scaler=GradScaler)``
(2 gloo workers, one launch, about 25 s; ``torch.amp.GradScaler("cpu")``, fp16 autocast over fp32 parameters).

Every gradient is a fixed tensor G (the loss is ``sum(w * G)``: ``w.grad`` is G times the loss scale,
exactly, the scales being powers of two), rank 1's holding an Inf at two chosen steps; the scaler has
``growth_interval=2``, so the scale grows and backs off during the run. Each run's parameters are
compared, step by step, with a float64 reference computed here by the algorithm's definition without any
loss scaling, the overflowed step left out:

* ``postlocalsgd`` (top-k with error feedback): an overflow in the synchronous phase skips the step on
  every rank (the gradients' exchange carries it; every scaler skips and backs off), the residuals stay in
  gradient units across the scale's changes; an overflow in the local phase skips that rank's own local
  step only (the other rank steps; the scales then differ by rank, each following plain AMP's rule);
* ``onebit_adam`` (its own Adam: exact warm-up, then the momentum exchanged): an overflow in either phase
  skips the step on every rank (moments, counts and freeze schedule as in a run without that step);
  ``zeroone_adam`` likewise in its variance phase (the engine's exchange), while an overflowed local step
  is, on that rank alone, counted and moves nothing;
* the scaler's state is in the algorithm's ``state_dict``: a run resumed right after a back-off, with a
  fresh scaler, continues bit-identically (parameters and scales);
* ``scaffold``: a local step the scaler skips adds nothing to the period's lr sum (its control variate is
  the estimate from the steps taken), against its float64 definition;
* local SGD, DiLoCo (with a synchronous start), Streaming DiLoCo, LSGD, D-PSGD, SGP and CHOCO step, bit for
  bit, as the same algorithm without a scaler whose overflowed steps are zero gradients (plain SGD: no move);
* a disabled scaler (``GradScaler(enabled=False)``) steps as no scaler, without failing, and its run's state
  (no scaler state in it) loads; a saved scaler state is checked before anything loads;
* an ``fp16`` wire beyond its range saturates as without a scaler (the exchanged gradient is unscaled);
* the ranks' differing scaler states fold into another world size (the smallest scale);
* a caller who unscales to clip before ``algo.step()`` is not unscaled twice (the same run bit for bit);
* ``scaler=`` is refused by name where it is not sound or not wired (Comprex, LGC), with
  ``nonfinite='skip'``, for an object that is not a scaler, and on every rank when only some ranks give one.
"""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
from amp_helpers import HAS_CPU_SCALER, Probe, close, cpu_scaler, run_scaler_workers
from references import topk

import gradpress.algorithms as algorithms
from gradpress.algorithms.loss_scale import AlgorithmScale

WORLD = 2
SHAPE = (16, 32)  # 512 entries: compressed (min_numel below)
MIN_NUMEL = 64
STEPS = 8
RATIO = 0.05
INIT_SCALE = 2.0 ** 10
SWITCH, PERIOD = 4, 2  # postlocalsgd: steps 0-3 synchronous, then local SGD averaging every 2 steps
OVERFLOWS = (1, 5)  # rank 1's gradient holds an Inf at these steps (1: synchronous phase / warm-up; 5: after)
RESUME_AT = 2  # the run is saved after steps 0-1 (step 1 overflowed: the scale just backed off)
SGD_LR = 0.1
ADAM_LR, BETAS, EPS, FREEZE = 0.01, (0.9, 0.999), 1e-8, 3
#: 0/1 Adam: variance steps at t = 1, 2, 4 (the interval doubles after each), t = 3 through the engine; frozen
#: from t = 4; local steps synchronized at t = 5, then every 2 steps (the interval doubles up to 2)
ZO_SPEC = "zeroone_adam:var_update_scaler=1,var_freeze_step=4,local_step_scaler=1,local_step_clipper=2"
ZO_OVERFLOWS = (2, 6)  # rank 1's Inf: at t = 3 (the engine's exchange; the step is retried), at a local step


def _grad(rank: int, step: int, overflows: tuple[int, ...] = OVERFLOWS) -> torch.Tensor:
    g = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1000 * step + rank))
    if rank == 1 and step in overflows:
        g[3, 5] = math.inf
    return g


def _build(kind: str, scaler: Any, **options: Any) -> tuple[Probe, algorithms.Algorithm]:
    model = Probe(SHAPE)
    if kind == "postlocalsgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
        algo = algorithms.create(f"postlocalsgd:switch={SWITCH},period={PERIOD}", model, opt,
                                 compressor=f"topk:ratio={RATIO}", min_numel=MIN_NUMEL, scaler=scaler, **options)
    elif kind == "scaffold":  # plain SGD: option II, the paper's
        opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
        algo = algorithms.create(f"scaffold:period={PERIOD}", model, opt, min_numel=MIN_NUMEL, scaler=scaler,
                                 **options)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=ADAM_LR, betas=BETAS, eps=EPS)
        spec = ZO_SPEC if kind == "zeroone_adam" else f"onebit_adam:freeze_step={FREEZE}"
        algo = algorithms.create(spec, model, opt, compressor="none", min_numel=MIN_NUMEL, scaler=scaler, **options)
    return model, algo


def _train(rank: int, kind: str, start: int = 0, stop: int = STEPS, saved: bytes | None = None,
           clip: bool = False, enabled: bool = True) -> dict:
    """Steps ``start..stop-1`` under fp16 autocast with a fresh ``GradScaler`` (``saved``: the model's and
    the algorithm's states to resume from; the algorithm's carries the scaler's); per step ``w`` after ``algo.step()`` (float64) and
    the scale of the step's backward. ``clip``: the caller unscales and clips before ``algo.step()``
    (a norm bound no finite gradient here reaches), as plain AMP's loop with clipping does."""
    overflows = ZO_OVERFLOWS if kind == "zeroone_adam" else OVERFLOWS
    scaler = cpu_scaler(INIT_SCALE)
    if not enabled:  # GradScaler(enabled=False), as a script with enabled=use_fp16 builds it
        scaler = torch.amp.GradScaler("cpu", enabled=False)
    model, algo = _build(kind, scaler)
    if saved is not None:  # the model is the caller's to save (SGD without momentum: no optimizer state)
        state = torch.load(io.BytesIO(saved), weights_only=True)
        model.load_state_dict(state["model"])
        algo.load_state_dict(state["algorithm"])
    params, scales = [], []
    for step in range(start, stop):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(_grad(rank, step, overflows))
        scaler.scale(loss).backward()
        scales.append(scaler.get_scale())
        if clip:
            scaler.unscale_(algo.optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        algo.step()
        params.append(model.w.detach().double().clone())
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "algorithm": algo.state_dict()}, buf)
    algo.close()
    return {"params": params, "scales": scales, "state": buf.getvalue()}


#: (spec, its synchronous steps) of the algorithms whose local steps are each rank's own, run against the same
#: algorithm without a scaler (plain SGD, two parameters)
EQUIVALENT = (
    ("localsgd:period=2", 0),
    (f"diloco:period=2,switch={SWITCH}", SWITCH),
    ("streaming-diloco:period=4,fragments=2,overlap=1", 0),
    ("lsgd:tau=2", 0),
    ("dpsgd", 0),
    ("sgp", 0),
    ("choco", 0),
)


def _equivalent(rank: int, spec: str, switch: int) -> dict[str, list[torch.Tensor]]:
    """Per step the parameters (float64, concatenated) of ``spec`` under fp16 autocast with a ``GradScaler``
    (``scaled``), and of the same algorithm without loss scaling (``plain``) whose overflowed steps are
    zero gradients instead, which plain SGD does not move: a step skipped on every rank in the synchronous
    phase (``switch``), on rank 1 alone after it. LSGD is handed the same finite loss in both runs."""
    out: dict[str, list[torch.Tensor]] = {}
    for label in ("scaled", "plain"):
        scaler = cpu_scaler(INIT_SCALE) if label == "scaled" else None
        model = Probe(SHAPE, extra=1)
        opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
        algo = algorithms.create(spec, model, opt, min_numel=MIN_NUMEL, scaler=scaler)
        params = []
        for step in range(STEPS):
            model.zero_grad(set_to_none=True)
            g = _grad(rank, step)
            if scaler is None and step in OVERFLOWS and (step < switch or rank == 1):
                g = torch.zeros_like(g)
            with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
                loss = model(g)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if spec.startswith("lsgd"):
                algo.step(torch.tensor(1.0 + rank))  # type: ignore[call-arg]
            else:
                algo.step()
            params.append(torch.cat([p.detach().double().reshape(-1) for p in model.parameters()]))
        algo.close()
        out[label] = params
    return out


def _wide_gradient(rank: int) -> dict:
    """``postlocalsgd`` through the ``fp16`` codec in its synchronous phase, rank 1's gradient holding 2e5 at every
    step (finite in fp32; its summand, 1e5 once divided by the world size, is beyond fp16's 65504): the scales
    and ``w`` of 3 steps."""
    scaler = cpu_scaler(INIT_SCALE)
    model = Probe(SHAPE)
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    algo = algorithms.create(f"postlocalsgd:switch={SWITCH},period={PERIOD}", model, opt, compressor="fp16",
                             min_numel=MIN_NUMEL, scaler=scaler)
    scales, params = [], []
    for step in range(3):
        model.zero_grad(set_to_none=True)
        g = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1000 * step + rank))
        if rank == 1:
            g[0, 0] = 2e5
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(g)
        scaler.scale(loss).backward()
        scales.append(scaler.get_scale())
        algo.step()
        params.append(model.w.detach().double().clone())
    algo.close()
    return {"scales": scales, "params": params}


def _refusals(rank: int) -> dict[str, str]:
    out = {}
    cases: list[tuple[str, str, Any, dict]] = [
        (name, spec, cpu_scaler(INIT_SCALE), {}) for name, spec in (
            ("comprex", "comprex"),
            ("lgc", "lgc"))]
    cases += [("skip", "localsgd:period=2", cpu_scaler(INIT_SCALE), {"nonfinite": "skip"}),
              ("object", "localsgd:period=2", object(), {}),
              ("ranks", "localsgd:period=2", cpu_scaler(INIT_SCALE) if rank == 0 else None, {})]
    for label, spec, scaler, kwargs in cases:
        model = Probe(SHAPE)
        opt = torch.optim.Adam(model.parameters(), lr=ADAM_LR)
        try:
            algorithms.create(spec, model, opt, scaler=scaler, **kwargs).close()
            out[label] = "accepted"
        except ValueError as exc:
            out[label] = str(exc)
    return out


def _workers(rank: int, world: int) -> dict:
    out: dict = {kind: _train(rank, kind) for kind in ("postlocalsgd", "onebit_adam", "scaffold", "zeroone_adam")}
    out["equivalent"] = {spec: _equivalent(rank, spec, switch) for spec, switch in EQUIVALENT}
    first = _train(rank, "postlocalsgd", stop=RESUME_AT)
    out["resumed"] = _train(rank, "postlocalsgd", start=RESUME_AT, saved=first["state"])
    out["first_state"] = first["state"]
    out["clipped"] = _train(rank, "postlocalsgd", clip=True)
    out["disabled"] = {kind: _train(rank, kind, enabled=False) for kind in ("onebit_adam", "scaffold")}
    # its state (no scaler state in it: a disabled scaler holds none) loads into a run with a disabled scaler
    out["disabled_loaded"] = _train(rank, "scaffold", start=STEPS, saved=out["disabled"]["scaffold"]["state"],
                                    enabled=False)["state"]
    out["refusals"] = _refusals(rank)
    out["wide"] = _wide_gradient(rank)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_scaler_workers(_workers, WORLD)


# ----------------------------------------------------------------------------- float64 references

def _g(rank: int, step: int, overflows: tuple[int, ...] = OVERFLOWS) -> torch.Tensor:
    return _grad(rank, step, overflows).double()


def _overflowed(rank: int, step: int) -> bool:
    return rank == 1 and step in OVERFLOWS


def _amp_scales(skipped: list[bool]) -> list[float]:
    """Plain AMP's scale per step (the scale of the step's backward): x0.5 after a skipped step, x2 after 2
    good steps in a row (``growth_interval=2``), the count restarting after either."""
    scale, good, out = INIT_SCALE, 0, []
    for bad in skipped:
        out.append(scale)
        if bad:
            scale, good = scale / 2, 0
        else:
            good += 1
            if good == 2:
                scale, good = scale * 2, 0
    return out


def _postlocalsgd_reference() -> tuple[list[list[torch.Tensor]], list[list[float]]]:
    """Per rank, per step ``w`` and the scales, by the definition: synchronous steps average top-k with error
    feedback of the gradients (residuals ``e_g``; a step with an overflow on any rank is left out on every
    rank, every residual kept); local steps ``x -= lr G`` (a rank skips its own overflowed step); every
    ``PERIOD`` local steps the deltas from the anchor are averaged by top-k with their own residuals ``e_d``."""
    zeros = torch.zeros(SHAPE, dtype=torch.float64)
    x = [zeros.clone() for _ in range(WORLD)]
    e_g = [zeros.clone() for _ in range(WORLD)]
    e_d = [zeros.clone() for _ in range(WORLD)]
    anchor, since = zeros.clone(), 0
    params: list[list[torch.Tensor]] = [[] for _ in range(WORLD)]
    skipped: list[list[bool]] = [[] for _ in range(WORLD)]
    for step in range(STEPS):
        if step < SWITCH:
            bad = any(_overflowed(r, step) for r in range(WORLD))
            if not bad:
                sent = []
                for r in range(WORLD):
                    p = e_g[r] + _g(r, step)
                    sent.append(topk(p, RATIO))
                    e_g[r] = p - sent[-1]
                avg = sum(sent) / WORLD
                x = [xr - SGD_LR * avg for xr in x]
            for r in range(WORLD):
                skipped[r].append(bad)
            if step == SWITCH - 1:
                anchor = x[0].clone()
        else:
            for r in range(WORLD):
                bad = _overflowed(r, step)
                skipped[r].append(bad)
                if not bad:
                    x[r] = x[r] - SGD_LR * _g(r, step)
            since += 1
            if since == PERIOD:
                sent = []
                for r in range(WORLD):
                    p = e_d[r] + (x[r] - anchor)
                    sent.append(topk(p, RATIO))
                    e_d[r] = p - sent[-1]
                anchor = anchor + sum(sent) / WORLD
                x = [anchor.clone() for _ in range(WORLD)]
                since = 0
        for r in range(WORLD):
            params[r].append(x[r].clone())
    return params, [_amp_scales(s) for s in skipped]


def _onebit_reference() -> tuple[list[torch.Tensor], list[float]]:
    """1-bit Adam with an identity compressor by the definition: g the mean of the ranks' gradients;
    warm-up (the first ``FREEZE`` steps taken): ``m, v`` updated; then ``v`` frozen and ``m`` the mean of
    the ranks' ``b1 m + (1 - b1) G_r`` (= ``b1 m + (1 - b1) g``); the step ``lr m / bc1 / (sqrt(v / bc2) +
    eps)`` with ``bc1`` over the steps taken and ``bc2`` over the variance updates. A step with an overflow
    on any rank is left out on every rank (no count moves)."""
    b1, b2 = BETAS
    x = torch.zeros(SHAPE, dtype=torch.float64)
    m, v = torch.zeros_like(x), torch.zeros_like(x)
    taken = v_steps = 0
    params, skipped = [], []
    for step in range(STEPS):
        bad = any(_overflowed(r, step) for r in range(WORLD))
        skipped.append(bad)
        if not bad:
            g = sum(_g(r, step) for r in range(WORLD)) / WORLD
            m = b1 * m + (1 - b1) * g
            if taken < FREEZE:
                v = b2 * v + (1 - b2) * g * g
                v_steps += 1
            taken += 1
            denom = (v / (1 - b2 ** v_steps)).sqrt() + EPS
            x = x - ADAM_LR / (1 - b1 ** taken) * m / denom
        params.append(x.clone())
    return params, _amp_scales(skipped)


def _zeroone_reference() -> tuple[list[list[torch.Tensor]], list[list[float]]]:
    """0/1 Adam with an identity compressor by the definition (``ZO_SPEC``), per rank: a variance-phase step
    with an overflow on any rank is left out on every rank (no count moves); otherwise ``t += 1``, ``g`` the
    mean gradient, at ``t % I == 0`` ``m`` and ``v`` updated (``I`` doubling after each such step), else ``m``
    only; frozen from ``t = 4`` on. A local step: ``t += 1``, every rank counts the Adam step and the lr, a
    rank whose gradient overflowed moves nothing (no ``m``, no ``x``); at ``t % H == 0`` (``H`` 1, then 2)
    ``u = mean((x_r - anchor) * denom)``, ``m = -u bc1 / sum(lr)``, every ``x_r = anchor += u / denom``."""
    b1, b2 = BETAS
    zeros = torch.zeros(SHAPE, dtype=torch.float64)
    x = [zeros.clone() for _ in range(WORLD)]
    m = [zeros.clone() for _ in range(WORLD)]
    v, anchor = zeros.clone(), zeros.clone()
    t = taken = v_steps = 0
    var_interval, local_interval, lrs = 1, 1, 0.0
    params: list[list[torch.Tensor]] = [[] for _ in range(WORLD)]
    skipped: list[list[bool]] = [[] for _ in range(WORLD)]

    def denom() -> torch.Tensor:
        return (v / (1 - b2 ** v_steps)).sqrt() + EPS

    for step in range(STEPS):
        bad = [r == 1 and step in ZO_OVERFLOWS for r in range(WORLD)]
        if t < 4:  # the variance phase: every rank skips together
            for r in range(WORLD):
                skipped[r].append(any(bad))
            if not any(bad):
                t += 1
                g = sum(_g(r, step, ZO_OVERFLOWS) for r in range(WORLD)) / WORLD
                m = [b1 * m[0] + (1 - b1) * g] * WORLD
                if t % var_interval == 0:
                    v = b2 * v + (1 - b2) * g * g
                    v_steps += 1
                    var_interval *= 2
                taken += 1
                x = [x[0] - ADAM_LR / (1 - b1 ** taken) * m[0] / denom()] * WORLD
                if t >= 4:
                    anchor = x[0].clone()
        else:
            t += 1
            taken += 1
            for r in range(WORLD):
                skipped[r].append(bad[r])
                if not bad[r]:
                    m[r] = b1 * m[r] + (1 - b1) * _g(r, step, ZO_OVERFLOWS)
                    x[r] = x[r] - ADAM_LR / (1 - b1 ** taken) * m[r] / denom()
            lrs += ADAM_LR
            if t % local_interval == 0:
                u = sum((x[r] - anchor) * denom() for r in range(WORLD)) / WORLD
                m = [-u * (1 - b1 ** taken) / lrs] * WORLD
                anchor = anchor + u / denom()
                x = [anchor.clone() for _ in range(WORLD)]
                lrs = 0.0
            local_interval = min(2, local_interval * 2)
        for r in range(WORLD):
            params[r].append(x[r].clone())
    return params, [_amp_scales(s) for s in skipped]


def _scaffold_reference() -> list[list[torch.Tensor]]:
    """SCAFFOLD (option II, plain SGD, ``global_lr=1``, no compression) by the definition: from ``x`` each rank
    steps ``y_i -= lr (G_i - c_i + c)``, a step its scaler skips left out (no lr counted); every ``PERIOD``
    steps ``c_i+ = c_i - c + (x - y_i) / sum(lr)``, ``x += mean(y_i - x)``, ``c += mean(c_i+ - c_i)``."""
    zeros = torch.zeros(SHAPE, dtype=torch.float64)
    x, c = zeros.clone(), zeros.clone()
    c_i = [zeros.clone() for _ in range(WORLD)]
    y = [zeros.clone() for _ in range(WORLD)]
    lrs = [0.0] * WORLD
    params: list[list[torch.Tensor]] = [[] for _ in range(WORLD)]
    for step in range(STEPS):
        for r in range(WORLD):
            if not _overflowed(r, step):
                y[r] = y[r] - SGD_LR * (_g(r, step) - c_i[r] + c)
                lrs[r] += SGD_LR
        if (step + 1) % PERIOD == 0:
            new_c = [c_i[r] - c + (x - y[r]) / lrs[r] for r in range(WORLD)]
            x = x + sum(y[r] - x for r in range(WORLD)) / WORLD
            c = c + sum(new_c[r] - c_i[r] for r in range(WORLD)) / WORLD
            c_i, lrs = new_c, [0.0] * WORLD
            y = [x.clone() for _ in range(WORLD)]
        for r in range(WORLD):
            params[r].append(y[r].clone())
    return params


# ----------------------------------------------------------------------------- tests

def test_postlocalsgd_under_a_changing_loss_scale_matches_the_unscaled_definition(results: list[dict]) -> None:
    want, want_scales = _postlocalsgd_reference()
    for rank, res in enumerate(results):
        run = res["postlocalsgd"]
        assert run["scales"] == want_scales[rank], (rank, run["scales"], want_scales[rank])
        for step, (got, ref) in enumerate(zip(run["params"], want[rank])):
            assert bool(torch.isfinite(got).all()), f"rank {rank} step {step}: the overflow reached w"
            assert close(got, ref), (f"postlocalsgd rank {rank} step {step} (scale {run['scales'][step]}): w differs "
                                     f"from the float64 definition by {float((got - ref).abs().max()):.3g}")


def test_a_local_overflow_skips_only_that_ranks_step(results: list[dict]) -> None:
    """After the local-phase overflow the ranks' scales differ (each rank's own AMP rule): rank 0's grew
    after its second good step in a row, rank 1's backed off."""
    step = OVERFLOWS[1]
    assert step >= SWITCH
    scales = [res["postlocalsgd"]["scales"] for res in results]
    assert scales[0][step + 1] == 4 * scales[1][step + 1], scales


def test_onebit_adam_under_a_changing_loss_scale_matches_the_unscaled_definition(results: list[dict]) -> None:
    want, want_scales = _onebit_reference()
    for rank, res in enumerate(results):
        run = res["onebit_adam"]
        assert run["scales"] == want_scales, (rank, run["scales"], want_scales)
        for step, (got, ref) in enumerate(zip(run["params"], want)):
            assert bool(torch.isfinite(got).all()), f"rank {rank} step {step}: the overflow reached w"
            assert close(got, ref), (f"onebit_adam rank {rank} step {step}: w differs from the float64 "
                                     f"definition by {float((got - ref).abs().max()):.3g}")


def test_zeroone_adam_under_a_changing_loss_scale_matches_the_unscaled_definition(results: list[dict]) -> None:
    want, want_scales = _zeroone_reference()
    for rank, res in enumerate(results):
        run = res["zeroone_adam"]
        assert run["scales"] == want_scales[rank], (rank, run["scales"], want_scales[rank])
        for step, (got, ref) in enumerate(zip(run["params"], want[rank])):
            assert bool(torch.isfinite(got).all()), f"rank {rank} step {step}: the overflow reached w"
            assert close(got, ref), (f"zeroone_adam rank {rank} step {step}: w differs from the float64 "
                                     f"definition by {float((got - ref).abs().max()):.3g}")


def test_scaffold_skips_an_overflowed_local_step_in_its_control_variates(results: list[dict]) -> None:
    want = _scaffold_reference()
    for rank, res in enumerate(results):
        run = res["scaffold"]
        for step, (got, ref) in enumerate(zip(run["params"], want[rank])):
            assert bool(torch.isfinite(got).all()), f"rank {rank} step {step}: the overflow reached w"
            assert close(got, ref), (f"scaffold rank {rank} step {step}: w differs from the float64 definition by "
                                     f"{float((got - ref).abs().max()):.3g}")


@pytest.mark.parametrize(("spec", "switch"), EQUIVALENT)
def test_local_step_algorithms_under_a_scaler_step_as_without_one(results: list[dict], spec: str,
                                                                  switch: int) -> None:
    """Bit for bit: the scales are powers of two, so the unscaled gradient is exactly G."""
    for rank, res in enumerate(results):
        run = res["equivalent"][spec]
        for step, (got, want) in enumerate(zip(run["scaled"], run["plain"])):
            assert torch.equal(got, want), (f"{spec} rank {rank} step {step}: differs from the run without loss "
                                            f"scaling by {float((got - want).abs().max()):.3g}")


def test_resume_right_after_a_back_off_is_bit_identical(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        straight, resumed = res["postlocalsgd"], res["resumed"]
        assert resumed["scales"] == straight["scales"][RESUME_AT:], (rank, resumed["scales"], straight["scales"])
        for i, w in enumerate(resumed["params"]):
            assert torch.equal(w, straight["params"][RESUME_AT + i]), f"rank {rank} step {RESUME_AT + i}"
        saved = torch.load(io.BytesIO(res["first_state"]), weights_only=True)["algorithm"]["loss_scaler"]
        assert saved["scale"] == straight["scales"][RESUME_AT], (saved, straight["scales"])  # the backed-off scale


def test_a_caller_who_unscaled_to_clip_is_not_unscaled_twice(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        straight, clipped = res["postlocalsgd"], res["clipped"]
        assert clipped["scales"] == straight["scales"], rank
        for step, (got, want) in enumerate(zip(clipped["params"], straight["params"])):
            assert torch.equal(got, want), f"rank {rank} step {step}"


def test_a_resume_on_another_world_size_takes_the_smallest_scale(results: list[dict]) -> None:
    """The ranks' scales differ after rank 1's local overflow (and their growth counts: plain numbers with no
    mean): folded into one rank, the scale is the smallest saved, its growth count restarted."""
    from gradpress.exchange.reshard import fold

    saved = [torch.load(io.BytesIO(res["postlocalsgd"]["state"]), weights_only=True)["algorithm"]["loss_scaler"]
             for res in results]
    assert saved[0]["scale"] != saved[1]["scale"], saved
    states = [torch.load(io.BytesIO(res["postlocalsgd"]["state"]), weights_only=True)["algorithm"]
              for res in results]
    folded = fold(states, 0, 1)["loss_scaler"]
    assert folded["scale"] == min(s["scale"] for s in saved), (folded, saved)
    assert folded["_growth_tracker"] == 0, folded
    assert folded["growth_interval"] == 2 and folded["backoff_factor"] == 0.5, folded


def test_an_fp16_wire_beyond_its_range_is_no_loss_scale_overflow(results: list[dict]) -> None:
    """The exchanged gradient is unscaled: a value beyond the wire's range is not the loss scale's (lowering
    the scale would not bring it back), so the codec keeps its saturating bound and the step is taken, the
    scale growing as in a run without it (a scaler-attached wire's Inf made every step skip, the scale halve)."""
    for rank, res in enumerate(results):
        run = res["wide"]
        assert run["scales"] == [INIT_SCALE, INIT_SCALE, 2 * INIT_SCALE], (rank, run["scales"])
        for step, w in enumerate(run["params"]):
            assert bool(torch.isfinite(w).all()) and float(w.abs().max()) > 0, f"rank {rank} step {step}"


@pytest.mark.parametrize("kind", ["onebit_adam", "scaffold"])
def test_a_disabled_scaler_steps_as_no_scaler(results: list[dict], kind: str) -> None:
    """``GradScaler(enabled=False)`` records no found-inf flag: nothing to agree on, every step taken. No
    rank skips an overflowed step then (plain AMP with a disabled scaler does the same): the Inf reaches
    ``w`` at the first overflow, and every step before it equals the scaled run."""
    for rank, res in enumerate(results):
        run, scaled = res["disabled"][kind], res[kind]
        assert run["scales"] == [1.0] * STEPS, run["scales"]
        first = OVERFLOWS[0]
        for step in range(first):
            assert torch.equal(run["params"][step], scaled["params"][step]), f"{kind} rank {rank} step {step}"
        assert not bool(torch.isfinite(run["params"][-1]).all()), f"{kind} rank {rank}: the Inf was skipped"
        state = torch.load(io.BytesIO(run["state"]), weights_only=True)["algorithm"]
        assert "loss_scaler" not in state, state["loss_scaler"]
        loaded = torch.load(io.BytesIO(res["disabled_loaded"]), weights_only=True)["algorithm"]
        assert loaded["steps"] == STEPS, loaded["steps"]


@pytest.mark.parametrize(("bad", "why"), [
    ({"scale": 0.0}, "finite 'scale' > 0"), ({"scale": math.inf}, "finite 'scale' > 0"),
    ({"scale": True}, "finite 'scale' > 0"), ([1024.0], "finite 'scale' > 0"),
    ({"scale": 1024.0, "growth_factor": 2.0}, "lacks '_growth_tracker', 'backoff_factor', 'growth_interval'"),
])
def test_a_saved_scaler_state_is_checked_before_anything_loads(bad: object, why: str) -> None:
    """What ``scaler.load_state_dict`` would fail on part-way (a ``KeyError`` after the algorithm's own state
    had loaded) or take silently (a scale of 0 or Inf) is refused first, naming ``loss_scaler``."""
    if not HAS_CPU_SCALER:
        pytest.skip("this torch has no torch.amp.GradScaler for CPU")
    model = Probe(SHAPE)
    scale = AlgorithmScale(cpu_scaler(INIT_SCALE), torch.optim.SGD(model.parameters(), lr=SGD_LR))
    with pytest.raises(ValueError, match="'loss_scaler'") as exc:
        scale.check_state(bad)
    assert why in str(exc.value) and "nothing was loaded" in str(exc.value), str(exc.value)
    scale.check_state(scale.state_dict())  # its own state passes


@pytest.mark.parametrize("name", ["comprex", "lgc"])
def test_scaler_is_refused_where_not_supported_naming_the_reason(results: list[dict], name: str) -> None:
    cls = algorithms.get_class(name)
    assert cls.scaler_refusal
    for res in results:
        message = res["refusals"][name]
        assert f"algorithm {name!r}: scaler= is not supported: {cls.scaler_refusal}" in message, message


def test_ranks_that_disagree_on_a_scaler_fail_alike(results: list[dict]) -> None:
    for res in results:
        message = res["refusals"]["ranks"]
        assert ("configuration differs between ranks" in message and "scaler=False" in message
                and "every rank or on none" in message), message


def test_scaler_with_skip_or_a_non_scaler_is_refused(results: list[dict]) -> None:
    for res in results:
        skip, obj = res["refusals"]["skip"], res["refusals"]["object"]
        assert "scaler= needs nonfinite='propagate', got nonfinite='skip'" in skip, skip
        assert "scaler must be a torch.amp.GradScaler" in obj and "got object" in obj, obj
