"""A dropped step does not advance the step random compressors draw from: one process, a one-rank gloo group,
about 5 s.

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

A step ``propagate`` hands on with no scaler attached drops nothing: it counts.

Planted: the Context step left at the caller's (the old behaviour, ``engine._ctx``): the seed and the
average after the dropped step fail in both modes; ``dropped_steps`` not loaded: the resume fails;
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


class _Probe(RandomK):
    """randomk recording each encode's Context."""

    name = PROBE

    def _encode(self, x: torch.Tensor, ctx: Any) -> Any:
        SEEN.append((ctx.step, ctx.shared_seed))
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
