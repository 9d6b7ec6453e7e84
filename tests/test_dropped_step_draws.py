"""A dropped step does not advance the step random compressors draw from: one process, a one-rank gloo group
(CHOCO's case: one spawn of 2 gloo workers), about 25 s.

A step ``nonfinite='skip'`` drops (a NaN in the gradient), or one ``propagate`` hands to the loss scaler as NaN
while one is attached (``StepGuard.keep_on_propagate``, what the DDP hook sets), leaves no trace, as the
optimizer's own step count does not advance in plain AMP: the next step draws what a run without the dropped
step draws at its place. Checked against references computed here:

* every encode's ``Context.step`` is the caller's step less the steps dropped before it, and its
  ``shared_seed`` is BLAKE2b-64 of ``"shared", seed, counted step, key`` joined by ``\\x1f`` (the documented
  derivation, written out here with ``hashlib``, not gradpress's ``derive_seed``), masked to 63 bits;
* ``randomk`` with error feedback, every step's average against a float64 reference: ``p = g + e``, the
  indices drawn from that seed by ``random_indices``' documented draw (``k + k // 8 + 64`` draws with
  replacement, the distinct ones, a random ``k`` of them), ``avg = p`` there, ``e = p - avg``; a dropped
  step changes nothing (``skip``: its average is zero; ``propagate``: NaN);
* resume through ``torch.load(weights_only=True)`` after the dropped step continues bit-identically (the
  count is in the state dict, ``dropped_steps``).

Every Context the engine or an algorithm builds comes from one helper (``Synchronizer.context``, its step
``StepGuard.counted``), checked against the same formula: a call encoded ahead (``prepare``, Comprex's
staleness >= 1) while an earlier call may still be dropped draws at the step counted at its sync (prepare
declines while ``StepGuard.may_drop``; a count that moved between prepare and sync is refused); Comprex
(staleness 0 and 1, ``skip``) end to end; CHOCO's codec (gossip's own messages) resumed from a state that
counted dropped steps.

A step ``propagate`` hands on with no scaler attached drops nothing: it counts.

Planted: the Context step left at the caller's (the old behaviour, ``engine._ctx``): the seed and the
average after the dropped step fail in both modes, Comprex's fails at its first exchange after a dropped one
(step 3 where 2 is counted); ``dropped_steps`` not loaded: the resume fails. ``prepare`` declining on
``nonfinite == 'skip'`` only and no check in ``sync`` (the code before): the encoded-ahead call drew at
step 2 where 1 is counted (``[0, 2, 1] == [0, 1, 1]``); that check removed: ``DID NOT RAISE``. The codec
building its own Context with the caller's step (the code before): CHOCO's steps 3 and 4 drew at 3 and 4.
``StepGuard.end_step`` counting every propagated NaN step, scaler or not: the no-scaler case fails (the
other tests passed).
"""

from __future__ import annotations

import hashlib
import io
import math
import struct
from typing import Any

import pytest
import torch
from distributed import one_rank_module

from gradpress.compress import registry
from gradpress.compress.randomk import RandomK
from gradpress.compress.registry import _REGISTRY
from gradpress.exchange.engine import Synchronizer

group = one_rank_module  # the module's one-process gloo group

SHAPE = (16, 32)
RATIO = 0.05
SEED = 11
STEPS = 7
BAD = {2, 4}  # the dropped steps
PROBE = "test-step-probe"
SEEN: list[tuple[int, int]] = []  # (Context.step, shared_seed) of every encode
KEYS: list[str] = []  # the Context key of every encode


class _Probe(RandomK):
    """randomk recording each encode's Context."""

    name = PROBE

    def _encode(self, x: torch.Tensor, ctx: Any) -> Any:
        SEEN.append((ctx.step, ctx.shared_seed))
        KEYS.append(ctx.key)
        return super()._encode(x, ctx)


@pytest.fixture(scope="module")
def probe():  # noqa: ANN201
    registry.register(_Probe)
    try:
        yield PROBE
    finally:
        _REGISTRY.classes.pop(PROBE, None)


def _shared_seed(seed: int, step: int, key: str) -> int:
    text = "\x1f".join(str(p) for p in ("shared", seed, step, key)).encode()
    return struct.unpack("<Q", hashlib.blake2b(text, digest_size=8).digest())[0] & ((1 << 63) - 1)


def _indices(d: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if 0 < 4 * k <= d:
        distinct = torch.unique(torch.randint(0, d, (k + k // 8 + 64,), generator=gen))
        if distinct.numel() >= k:
            return distinct[torch.randperm(distinct.numel(), generator=gen)[:k]]
    return torch.randperm(d, generator=gen)[:k]


def _grad(step: int) -> torch.Tensor:
    g = torch.randn(SHAPE, generator=torch.Generator().manual_seed(500 + step), dtype=torch.float64)
    if step in BAD:
        g[1, 2] = math.nan
    return g


def _engine(spec: str, mode: str) -> Synchronizer:
    engine = Synchronizer(spec, params=[("w", SHAPE, torch.float64)], min_numel=1, seed=SEED, nonfinite=mode,
                          error_feedback=True)
    engine.guard.keep_on_propagate = mode == "propagate"  # what the DDP hook sets while a scaler is attached
    return engine


def _step(engine: Synchronizer, step: int) -> torch.Tensor:
    g = _grad(step)
    engine.sync(["w"], [g], step=step)
    return g


def _reference(mode: str) -> list[torch.Tensor | None]:
    """Each step's average by the definition (None: dropped; its average is checked apart)."""
    d = math.prod(SHAPE)
    k = max(1, min(d, math.ceil(RATIO * d)))
    e = torch.zeros(d, dtype=torch.float64)
    out: list[torch.Tensor | None] = []
    counted = 0
    for step in range(STEPS):
        if step in BAD:
            out.append(None)
            continue
        p = _grad(step).reshape(-1) + e
        idx = _indices(d, k, _shared_seed(SEED, counted, "w"))
        avg = torch.zeros_like(p)
        avg[idx] = p[idx]
        e = p - avg
        out.append(avg.reshape(SHAPE))
        counted += 1
    return out


@pytest.mark.parametrize("mode", ["skip", "propagate"])
def test_a_dropped_step_does_not_advance_the_drawn_step(group, probe: str, mode: str) -> None:  # noqa: ANN001
    SEEN.clear()
    engine = _engine(f"{probe}:ratio={RATIO}", mode)
    got = [_step(engine, s) for s in range(STEPS)]
    counted = [s - sum(b < s for b in BAD) for s in range(STEPS)]
    assert [c for c, _ in SEEN] == counted, (mode, SEEN)
    assert [sd for _, sd in SEEN] == [_shared_seed(SEED, c, "w") for c in counted], mode
    for step, (avg, ref) in enumerate(zip(got, _reference(mode))):
        if ref is None:
            assert (avg == 0).all() if mode == "skip" else avg.isnan().any(), (mode, step)
        else:
            assert torch.equal(avg, ref), (mode, step, (avg - ref).abs().max().item())
    assert engine.state_dict()["dropped_steps"] == len(BAD)


def test_a_step_propagated_without_a_scaler_counts(group, probe: str) -> None:  # noqa: ANN001
    """``propagate`` with no loss scaler attached hands the NaN on and drops nothing (the optimizer takes the
    step): every step counts, the drawn step is the caller's, and the state dict says 0 dropped."""
    SEEN.clear()
    engine = _engine(f"{probe}:ratio={RATIO}", "propagate")
    engine.guard.keep_on_propagate = False  # no scaler: what the DDP hook leaves without one
    got = [_step(engine, s) for s in range(STEPS)]
    assert all(got[b].isnan().any() for b in BAD)
    assert [c for c, _ in SEEN] == list(range(STEPS)), SEEN
    assert [sd for _, sd in SEEN] == [_shared_seed(SEED, s, "w") for s in range(STEPS)]
    assert engine.state_dict()["dropped_steps"] == 0


@pytest.mark.parametrize("mode", ["skip", "propagate"])
def test_resume_after_a_dropped_step_is_bit_identical(group, mode: str) -> None:  # noqa: ANN001
    spec = f"randomk:ratio={RATIO}"
    engine = _engine(spec, mode)
    for s in range(3):  # step 2 dropped
        _step(engine, s)
    blob = io.BytesIO()
    torch.save(engine.state_dict(), blob)
    blob.seek(0)
    resumed = _engine(spec, mode)
    resumed.load_state_dict(torch.load(blob, weights_only=True))
    for s in range(3, STEPS):
        a, b = _step(engine, s), _step(resumed, s)
        assert torch.equal(a, b) or (s in BAD and a.isnan().any() and b.isnan().any()), (mode, s)
        assert torch.equal(engine.feedback.residuals["w"], resumed.feedback.residuals["w"]), (mode, s)


# ------------------------------------------------------------- every Context the engine or an algorithm builds
def test_a_call_encoded_ahead_draws_from_the_step_counted_at_its_sync(group, probe: str) -> None:  # noqa: ANN001
    """Comprex's prepare-ahead, by the engine's calls: step 2 is encoded ahead (``prepare``) while step 1, whose
    gradient holds a NaN, is still to sync; step 1 is then dropped (``propagate`` under a loss scaler) before
    step 2 syncs. Step 2 counts as 1: its Context step and seed are those of counted step 1 (the reference),
    so ``prepare`` declines while a step may be dropped and the call is encoded at its sync; without a scaler
    (nothing can be dropped) it is encoded ahead, at the counted step, which ``sync`` checks."""
    SEEN.clear()
    engine = _engine(f"{probe}:ratio={RATIO}", "propagate")  # keep_on_propagate: a scaler's hook
    engine.sync(["w"], [_grad(0)], step=0)
    ahead = engine.prepare(["w"], [_grad(3)], step=2)
    engine.sync(["w"], [_grad(2)], step=1)  # BAD: dropped
    assert engine.guard.dropped == 1
    engine.sync(["w"], [_grad(3)], step=2, prepared=ahead)
    assert [c for c, _ in SEEN] == [0, 1, 1], SEEN  # step 1 drew at 1 (then dropped); step 2 counts as 1
    assert [sd for _, sd in SEEN] == [_shared_seed(SEED, c, "w") for c in (0, 1, 1)]
    assert ahead is None

    plain = _engine(f"{probe}:ratio={RATIO}", "propagate")
    plain.guard.keep_on_propagate = False  # no scaler: no step is ever dropped, the call is encoded ahead
    plain.guard.dropped = 2  # as loaded from a state that counted 2 dropped steps
    SEEN.clear()
    ahead = plain.prepare(["w"], [_grad(5)], step=5)
    assert ahead is not None and ahead.counted == 3 and SEEN == [(3, _shared_seed(SEED, 3, "w"))], (ahead, SEEN)
    plain.guard.dropped = 3  # the count moved between prepare and sync: refused, not synced with a stale draw
    with pytest.raises(RuntimeError, match="encoded at counted step 3, but step 5 now counts as 2"):
        plain.sync(["w"], [_grad(5)], step=5, prepared=ahead)


def _choco_worker(rank: int, world: int) -> list[tuple[str, int, int]]:
    """CHOCO on 2 workers with the probe: 3 steps, its state saved with 2 dropped steps counted (as a run
    whose engine dropped 2 would hold) and loaded into a fresh one, which takes 2 steps: its encodes."""
    import gradpress.algorithms as algorithms

    registry.register(_Probe)

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)).to(torch.float64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, opt, algorithms.create("choco", model, opt, compressor=f"{PROBE}:ratio=0.25", min_numel=1,
                                             seed=SEED)

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer, algo: Any, t: int) -> None:
        opt.zero_grad()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * t + rank), dtype=torch.float64)
        model(x).square().mean().backward()
        algo.step()

    model, opt, algo = make()
    for t in range(3):
        step(model, opt, algo, t)
    state = algo.state_dict()
    state["exchange"]["dropped_steps"] = 2
    algo.close()
    model, opt, algo = make()
    algo.load_state_dict(state)
    SEEN.clear()
    KEYS.clear()
    for t in range(3, 5):
        step(model, opt, algo, t)
    algo.close()
    return [(k, c, sd) for k, (c, sd) in zip(KEYS, SEEN)]


def test_gossip_contexts_draw_from_the_counted_step() -> None:
    """CHOCO's codec (gossip's own messages) builds its Contexts through the engine's ``context``: resumed
    from a state that counted 2 dropped steps, its steps 3 and 4 draw at counted steps 1 and 2, every
    compressed parameter's message (Context step, and seed by the documented formula of that step and key)."""
    from distributed import run_workers

    for rank, seen in enumerate(run_workers(_choco_worker, 2)):
        names = ["0.weight", "1.weight"]  # the biases (1-D) are sent plain
        assert [(k, c) for k, c, _ in seen] == [(k, c) for c in (1, 2) for k in names], (rank, seen)
        assert all(sd == _shared_seed(SEED, c, k) for k, c, sd in seen), (rank, seen)


@pytest.mark.parametrize("staleness", [0, 1])
def test_comprex_draws_from_the_counted_step(group, probe: str, staleness: int) -> None:  # noqa: ANN001
    """Comprex (``update=optimizer``, ``nonfinite='skip'``; staleness 1: each exchange on the background thread
    while the next step computes and is launched): the exchange of a step whose gradient holds a NaN is
    dropped, and each later exchange e draws at e less the exchanges dropped before it (Context step and seed
    by the documented formula: the reference here)."""
    import gradpress.algorithms as algorithms

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8, bias=False).to(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    algo = algorithms.create(f"comprex:staleness={staleness},update=optimizer,clip=0", model, opt,
                             compressor=f"{probe}:ratio=0.25", min_numel=1, seed=SEED, nonfinite="skip")
    SEEN.clear()
    for t in range(STEPS):
        model.weight.grad = _grad(t)[:8, :16].clone()
        algo.step()
    algo.close()
    counted = [t - sum(b < t for b in BAD) for t in range(STEPS)]
    assert SEEN == [(c, _shared_seed(SEED, c, "weight")) for c in counted], (staleness, SEEN, counted)
    assert algo.engine.guard.dropped == len(BAD)
