"""Density correction shared by the threshold estimators (``sidco``,
``dgc_threshold``, ``gaussiank``; issue 14).

A threshold estimator reads a threshold off a model of |x| (an exponential,
a generalized Pareto, a Gaussian, a sample). Where the model does not fit
the data (heavy tails: Student-t, real gradients) the kept count misses the
target k by a factor that does not shrink with more data: the SIDCo paper's
exponential fit keeps 0.4 k on Student-t(3) at 0.1%, Gaussian-k 1.7 k on
Laplace at 1%. ``correction=adaptive`` (the default of those compressors)
adds what a careful user would, around the method's own estimate ``t_e``:

1. **Per-tensor scale, learned from the previous calls.** The threshold
   tried first is ``s_key * t_e``; ``s_key`` (1 at first, state keyed by
   ``ctx.key``, checkpointed) moves after every call toward the threshold
   that would have kept exactly k on it, relative to that call's estimate:
   ``ln s <- (1-b) ln s + b (ln t* - ln t_e)``, b = 1/2, where
   ``ln t* = ln t + ln(count/k) / e`` is one Newton step from the threshold
   ``t`` used and its count, with ``e`` = -d ln(count)/d ln(t), the tail
   slope measured by the last search on this tensor (also kept per key;
   ``SLOPE_GUESS_STEADY`` before any). The estimators are scale
   equivariant, so ``s`` measures the model's shape error, which changes
   slowly from step to step.
2. **In-call guard.** The selection at ``s_key * t_e`` is counted (its
   length: no extra pass). Only when the count is outside ``[0.8 k, 1.25 k]``
   (first call on heavy tails, a jump in the data) does it search: a
   safeguarded secant on ln(count) against ln(threshold), one count per
   step (on :class:`~gradpress.compress._threshold_select.BlockMax` rows at
   small densities), at most ``MAX_PASSES`` counts, then selects again.
   The threshold kept is the last one in the band, else the one whose
   count was closest to k in ratio; a zero count is never preferred to a
   nonzero one, so a tensor with a nonzero entry never sends nothing.

Invariants: deterministic (no randomness; every number comes from the
input and the state), finite (a non-finite or non-positive estimate
restarts from max |x|; a non-finite threshold is never learned), and the
scale of one tensor never depends on another. The state is two plain
``{key: float}`` maps (``torch.load(weights_only=True)`` safe).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from gradpress.compress.base import Param

__all__ = ["CORRECTIONS", "BAND", "MAX_PASSES", "ThresholdScale", "correction_param", "in_band", "refine"]

CORRECTIONS = ("none", "adaptive")
#: achieved/target density accepted without a search
BAND = (0.8, 1.25)
#: counts the in-call search may spend
MAX_PASSES = 8
#: first guess of -d ln(count) / d ln(threshold) (3 for a Student-t(3)
#: tail, ln(1/delta) for an exponential one, about z^2 for a Gaussian one)
SLOPE_GUESS = 4.0
#: slope assumed by the scale's Newton step before a search measured one
#: (large: a small, stable step; with b = 1/2 stable for true slopes < 2x this)
SLOPE_GUESS_STEADY = 8.0
SLOPE_RANGE = (0.25, 64.0)
#: weight of the newest observation in the scale's geometric smoothing
SMOOTHING = 0.5
#: |ln s| is kept below this (a scale of e^40 means the estimate is useless)
LOG_SCALE_LIMIT = 40.0


def correction_param(doc: str = "density correction") -> Param:
    """``correction``: ``none`` (the paper's form) or ``adaptive`` (default)."""
    return Param("correction", str, "adaptive", "none (the paper's form) or adaptive",
                 lambda v: v in CORRECTIONS, doc)


def in_band(count: int, k: int, band: tuple[float, float] = BAND) -> bool:
    """``band[0] * k <= count <= band[1] * k``."""
    return band[0] * k <= count <= band[1] * k


def _log_ratio(count: int, k: int) -> float:
    return math.log(count / k) if count > 0 else -math.inf


def refine(count_at: Callable[[torch.Tensor], int], thr: torch.Tensor, count: int, k: int,
           top: Callable[[], torch.Tensor], band: tuple[float, float] = BAND,
           passes: int = MAX_PASSES) -> tuple[torch.Tensor, int, int, float | None]:
    """Search a threshold whose count is within ``band`` of ``k``.

    ``count_at(t)`` counts the entries a selection at ``t`` keeps (t a 0-d
    tensor of the work dtype, like ``thr``); ``count`` is the count at
    ``thr``; ``top()`` gives max |x| (used only when ``thr`` is not a finite
    positive number or a count is zero). Returns ``(threshold, its count, counts spent, tail
    slope measured on the last two finite counts or None)``.

    In u = ln t, f(u) = ln(count/k) decreases. Outside a bracket the step is
    Newton's with the slope measured on the last two points (``SLOPE_GUESS``
    before there are two; after a zero count it goes to max |x|, which keeps
    at least one entry, or lower by a doubling factor);
    once one point with too many and one with too few are known, the step is
    the secant between them, kept inside the middle 80% of the bracket
    (bisection in u when the too-few side counted zero). A step beyond the
    dtype's max keeps nothing, which is known without a count: it counts as
    a zero (no pass spent: ``spent`` is the counts made), so data near the
    max is searched as the same data at any other scale.
    """
    dtype = thr.dtype
    spent = 0
    t = float(thr)
    if not (math.isfinite(t) and t > 0):
        m = float(top())
        if not (math.isfinite(m) and m > 0):
            return thr, count, spent, None  # all zero (or not finite): nothing a threshold can fix
        thr = torch.tensor(m, dtype=dtype, device=thr.device)
        count = count_at(thr)
        spent += 1
        t = float(thr)
    best = (thr, count)

    def better(c: int, old: int) -> bool:
        if (c > 0) != (old > 0):
            return c > 0
        return abs(_log_ratio(c, k)) < abs(_log_ratio(old, k))

    many: tuple[float, float] | None = None  # (u, f) with f > 0
    few: tuple[float, float] | None = None  # (u, f) with f < 0 (f = -inf: zero count)
    prev: tuple[float, float] | None = None
    measured: float | None = None
    down = math.log(2.0)
    beyond = 0  # steps beyond the dtype's max (no count made)
    u = math.log(t)
    while True:
        f = _log_ratio(count, k)
        if prev is not None and math.isfinite(f) and math.isfinite(prev[1]) and u != prev[0]:
            m = -(f - prev[1]) / (u - prev[0])
            if m > 0:
                measured = min(max(m, SLOPE_RANGE[0]), SLOPE_RANGE[1])
        if in_band(count, k, band) or spent >= passes:
            break
        if f > 0 and (many is None or u > many[0]):
            many = (u, f)
        if f < 0 and (few is None or u < few[0]):
            few = (u, f)
        slope = measured if measured is not None else SLOPE_GUESS
        if many is not None and few is not None:
            (ua, fa), (ub, fb) = many, few
            if math.isfinite(fb):
                w = fa / (fa - fb)  # secant root between the bracket ends
                u_new = ua + min(max(w, 0.1), 0.9) * (ub - ua)
            else:
                u_new = 0.5 * (ua + ub)
        elif math.isfinite(f):
            u_new = u + f / slope  # f > 0: raise the threshold; f < 0: lower it
        else:  # nothing selected: the threshold is above max |x|; start again from there
            m = float(top())
            if not (math.isfinite(m) and m > 0):
                break  # all zero (or not finite): nothing a threshold can fix
            u_new = min(math.log(m), u - down)
            down *= 2.0
        prev = (u, f)
        u = u_new
        try:
            nxt = torch.tensor(math.exp(u), dtype=torch.float64).to(dtype=dtype, device=thr.device)
        except OverflowError:  # e^u beyond every float (fp64 data near its maximum)
            nxt = torch.tensor(math.inf, dtype=dtype, device=thr.device)
        if not bool(torch.isfinite(nxt)):
            # above the dtype's max, so above every finite |x|: it keeps nothing, known without a count
            # (stopping here left data near the max with the count it had, not the one at any other scale);
            # not a pass: the next step bisects toward the finite side, so this ends (capped all the same)
            count = 0
            beyond += 1
            if beyond > 64:
                break
            continue
        if float(nxt) <= 0:
            break
        thr = nxt
        count = count_at(thr)
        spent += 1
        if in_band(count, k, band) or better(count, best[1]):
            best = (thr, count)
    if in_band(count, k, band):
        return thr, count, spent, measured
    return best[0], best[1], spent, measured


class ThresholdScale:
    """Per-key multiplicative scale on an estimated threshold (item 1 above)
    and the tail slope last measured on that key.

    ``scales[key]`` and ``slopes[key]`` are Python floats (a new key has
    scale 1 and no slope)."""

    def __init__(self) -> None:
        self.scales: dict[str, float] = {}
        self.slopes: dict[str, float] = {}

    def get(self, key: str) -> float:
        return self.scales.get(key, 1.0)

    def learn(self, key: str, estimate: torch.Tensor, final: torch.Tensor, count: int, k: int,
              slope: float | None = None) -> None:
        """Move ``scales[key]`` toward ``t* / estimate``, t* the Newton
        estimate of the threshold keeping exactly ``k`` from ``final`` and
        its ``count``; ``slope`` (if measured) replaces the stored one.
        Ignored unless ``estimate`` and ``final`` are finite and positive and
        ``count > 0``."""
        if slope is not None and math.isfinite(slope) and slope > 0:
            self.slopes[key] = min(max(slope, SLOPE_RANGE[0]), SLOPE_RANGE[1])
        e, f = float(estimate), float(final)
        if not (math.isfinite(e) and math.isfinite(f) and e > 0 and f > 0 and count > 0 and k > 0):
            return
        step = math.log(count / k) / self.slopes.get(key, SLOPE_GUESS_STEADY)
        step = min(max(step, -math.log(2.0)), math.log(2.0))  # one call never moves it more than 2x
        old = math.log(self.get(key))
        new = (1.0 - SMOOTHING) * old + SMOOTHING * (math.log(f) + step - math.log(e))
        self.scales[key] = math.exp(min(max(new, -LOG_SCALE_LIMIT), LOG_SCALE_LIMIT))

    def state_dict(self) -> dict[str, dict[str, float]]:
        return {"scales": dict(self.scales), "slopes": dict(self.slopes)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scales, self.slopes = {}, {}
        for name, target in (("scales", self.scales), ("slopes", self.slopes)):
            for key, value in state.get(name, {}).items():
                v = float(value)
                if not (math.isfinite(v) and v > 0):
                    raise ValueError(f"threshold {name[:-1]} for {key!r} got {value!r}; allowed: a finite number > 0")
                target[str(key)] = v
