"""``redsync``: RedSync's threshold binary search (Fang et al. 2019,
"RedSync: Reducing Synchronization Bandwidth for Distributed Deep Learning
Training System"), a SIDCo baseline.

With ``mean`` and ``max`` of |x|, search r in [0, 1] for the threshold
``thr = mean + r * (max - mean)`` by bisection until ``k <= nnz < upper*k``
(at most 30 halvings, then the last threshold with nnz >= k is used, or the
lowest one tried). Its guarantee is therefore achieved/target density in
[1, upper) (ties aside: a constant tensor keeps everything). A threshold is
never above max |x| (the fp32 mean of a constant tensor can round above its
value, which used to select nothing).

``correction=none`` (the paper: k < nnz < 2k, so ``upper`` defaults to 2):
every call bisects from [0, 1]. The window is the method's whole accuracy:
over 10 draws of 1M elements the mean achieved/target density is 1.3 to 1.8
on Gaussian, Laplace and Student-t(3) data (1.3 to 1.5 on real gradients),
single calls up to 1.99.

``correction=adaptive`` (default): ``upper`` defaults to 1.25 (mean near 1.1),
and the search starts where it ended on this tensor's previous call: the
accepted threshold is kept per ``ctx.key`` (checkpointed) relative to that
call's mean |x| (the mean is steady from call to call, the max of a
heavy-tailed tensor is not, so a stored r would not carry over); the first
probe is the r of that relative threshold on the new tensor, then the
search steps away from it by ``0.05 r`` doubling each time until the window
is bracketed, then bisects the bracket as the paper does. The acceptance
rule (and so the [1, upper) guarantee) is the paper's.

``upper=0`` means that default (2 or 1.25); any ``upper > 1`` is used as
given. ``mean`` is summed on |x| times a power of two (exact) that brings
max |x| to [0.5, 1), so finite data up to the dtype's max never overflows
it. Each count is one pass over |x| (on BlockMax rows at small densities:
no full-size |x| buffer) and one host read.
Packet: ``[values (input dtype), indices (int32)]``, variable size; biased,
error feedback on by default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from gradpress.compress._density import correction_param
from gradpress.compress._threshold_select import ThresholdSparsifier
from gradpress.compress.base import Context, Param
from gradpress.compress.numerics import scale_pow2
from gradpress.compress.params import ratio_param
from gradpress.compress.registry import register
from gradpress.compress.spans import chunk_spans

MAX_STEPS = 30
PAPER_UPPER = 2.0
ADAPTIVE_UPPER = 1.25
#: first step away from the previous call's r, relative to it
WARM_STEP = 0.05


@register
class RedSync(ThresholdSparsifier):
    name = "redsync"
    PARAMS = (
        ratio_param(0.001, "target density"),
        Param("upper", float, 0.0, "0 (2 with correction=none, 1.25 with adaptive) or upper > 1",
              lambda v: v == 0 or v > 1, "accept k <= nnz < upper*k"),
        correction_param("adaptive: window [k, 1.25k), warm start per tensor (default); none: the paper's search"),
    )
    needs_abs = False  # mean and max of |x| and the counts come from BlockMax rows
    stateful = True  # the per-tensor warm start of correction=adaptive
    state_dict_copies = True  # its positions in a fresh dict, besides the base's numbers
    summary = "RedSync threshold binary search between mean and max of |x| (Fang et al. 2019)"

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        #: threshold / mean |x| accepted on each tensor's last call (adaptive)
        self.positions: dict[str, float] = {}
        #: counts the last call's search spent
        self.last_steps = 0

    @property
    def window(self) -> float:
        """The upper end of the acceptance window, in units of k."""
        if self.upper > 0:
            return self.upper
        return ADAPTIVE_UPPER if self.correction == "adaptive" else PAPER_UPPER

    def _threshold(self, xw: torch.Tensor, a: torch.Tensor, k: int, ctx: Context) -> torch.Tensor:
        if a is None:  # selection on BlockMax rows: no |x| buffer
            assert self._blocks is not None
            top = self._blocks.abs_max()
        else:
            top = a.max()
        # sum of |x| span by span (vector_norm(x, 1) drifts ~1% at 25M in fp32), of |x| times the power
        # of two c that brings max |x| to [0.5, 1): exact, and no sum overflows (it did near the dtype's
        # max: an infinite mean, a NaN threshold, every entry selected)
        c = scale_pow2(top, xw.dtype)
        src = xw if a is None else a
        sums = [(src[i:j].abs() * c).sum() for i, j in chunk_spans(xw.numel(), xw.device)]
        mean = torch.stack(sums).sum() / xw.numel() / c
        upper = self.window
        lo, hi = 0.0, 1.0
        best: tuple[torch.Tensor, float] | None = None
        self.last_steps = 0

        def probe(r: float) -> str:
            """Count at r; narrow [lo, hi]; 'many', 'few' or 'ok'."""
            nonlocal lo, hi, best
            # never above max |x| (on a constant tensor the fp32 mean may round above it)
            thr = torch.minimum(mean + r * (top - mean), top)
            nnz = self._count(a, thr)
            self.last_steps += 1
            if nnz >= upper * k:
                lo = r  # too many: raise the threshold
                best = (thr, r)
                return "many"
            if nnz < k:
                hi = r  # too few: lower it
                return "few"
            best = (thr, r)
            return "ok"

        warm = None
        rel = self.positions.get(ctx.key) if self.correction == "adaptive" else None
        if rel is not None:
            span = float(top - mean)
            if span > 0 and math.isfinite(span):
                warm = (rel - 1.0) * float(mean) / span
        found = False
        if warm is not None and 0.0 < warm < 1.0:
            side = probe(warm)
            found = side == "ok"
            step = WARM_STEP * warm
            r = warm
            while not found and self.last_steps < MAX_STEPS and lo < hi:
                r = r + step if side == "many" else r - step
                if not lo < r < hi:
                    break  # bracketed (or at an end): bisect [lo, hi]
                new = probe(r)
                found = new == "ok"
                if new != side:
                    break
                step *= 2.0
        while not found and self.last_steps < MAX_STEPS:
            found = probe(0.5 * (lo + hi)) == "ok"
        if found:
            assert best is not None
            m = float(mean)
            rel = float(best[0]) / m if m > 0 else math.nan
            if self.correction == "adaptive" and math.isfinite(rel) and rel > 1.0:
                self.positions[ctx.key] = rel
            return best[0]
        if best is not None:
            return best[0]
        return torch.minimum(mean + lo * (top - mean), top)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["positions"] = dict(self.positions)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        positions = {str(k): float(v) for k, v in state.get("positions", {}).items()}
        bad = [k for k, v in positions.items() if not (math.isfinite(v) and v > 0)]
        if bad:
            raise ValueError(f"redsync: position for {bad[0]!r} got {positions[bad[0]]!r}; allowed: a finite number > 0")
        self.positions = positions
