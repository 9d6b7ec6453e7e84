"""``sidco``: statistical threshold estimation (Abdelmoniem et al., MLSys 2021,
"An Efficient Statistical-based Gradient Compression Technique for
Distributed Training Systems").

The threshold that keeps a fraction delta of the entries is read off a
sparsity-inducing distribution fitted to the magnitudes ``|x|`` in closed form
(mu = mean, sigma^2 = variance of the fitted sample):

* ``exp`` (exponential): eta = -mu ln(delta).
* ``gpareto`` (generalized Pareto, method of moments):
  xi = (1 - mu^2/sigma^2)/2, alpha = mu (mu^2/sigma^2 + 1)/2,
  eta = (alpha/xi)(delta^(-xi) - 1) (-> -alpha ln(delta) as xi -> 0).
* ``gamma``: s = ln(mu) - mean(ln x), shape a = (3 - s + sqrt((s-3)^2 + 24 s))
  / (12 s), scale b = mu/a, eta = b * P^-1(a, 1 - delta) (inverse regularized
  lower incomplete gamma, :func:`gamma_upper_inv`, computed in torch: Newton
  steps on ln Q(a, x) in ln x from a Wilson-Hilferty start; no scipy).
  Later stages fit the generalized Pareto, as the paper does (exceedances
  over a threshold are GP by Pickands-Balkema-de Haan).

Multi-stage (M stages): stage 1 keeps delta_1 = 0.25; stage i > 1 fits only
the exceedances over the previous threshold t, shifted by t, and sets
t <- t + eta_i with delta_i = (delta/delta_1)^(1/(M-1)). ``stages=0`` adapts
M per tensor (state keyed by ``ctx.key``): every 5 calls the mean
achieved/target density of those calls is compared with the target: > 1.2
-> one stage less, < 0.8 -> one more, M within [1, ceil(log_0.5 delta)]
(M = 1 when delta >= delta_1). Adaptive M starts at
ceil(ln delta / ln delta_1), clamped to that range, so that every stage fits
a tail of about delta_1 (our choice: the paper does not fix the start; with
M = 1 the rule can get stuck on light-tailed data where a single GP fit
over-selects and only more stages would help).

Choices where the paper leaves room (recorded here):
* Stage-1 statistics are taken over the *nonzero* magnitudes and delta is
  rescaled to delta*d/nnz (exact zeros, e.g. dead ReLU rows, would otherwise
  drag the fit; identical to the paper when there are no zeros). Scale
  normalization (|x|/||x||) is not needed: all three fits are scale
  equivariant.
* The fits use a strided sample of |x| of at least max(2^18, 256/delta)
  entries (all of x when smaller; about 256 delta_{M-1}/delta exceedances
  at the last stage); ``gamma`` fits stage 1 on all of |x| (it needs mean
  ln|x|). Reductions over all of x and compacting its 25% exceedances cost
  more than an exact top-k on one CPU thread; the sample's moments differ
  from the full ones by well under 1%. Each later stage gathers its exceedances (one
  host sync). Sums run in the work dtype, converted to fp64; where one
  overflows (finite data near the dtype's max) the moments are taken of
  the data times a power of two and the fitted threshold scaled back
  (every fit is scale equivariant). The fitted parameters are
  fp64 0-d tensors. The selection itself is exact (``|x| >= threshold``
  over all entries, :class:`~gradpress.compress._threshold_select.BlockMax`).

``correction=none`` is the paper's form above: the fitted threshold alone.
Where the fitted law does not match the data it misses the density by a
factor that more data does not shrink (over 10 draws of 1M elements: ``exp``
with adaptive stages keeps 0.47 and 0.38 of the target on Student-t(3) at
0.01 and 0.001; a single ``exp`` stage keeps nothing of N(0, 1) at 0.001, a
single ``gpareto`` stage 6.9x; on real LSTM gradients ``exp`` keeps 0.18 to
0.37 of it).

``correction=adaptive`` (default) keeps every estimate above (distribution,
stages, the adaptive stage rule) and adds the density correction of
:mod:`gradpress.compress._density`: the threshold tried first is the fitted
one times a per-tensor scale learned from the previous calls (state keyed by
``ctx.key``, checkpointed with the stage counts), and only when its count
misses ``[0.8 k, 1.25 k]`` a few counting passes (safeguarded secant on ln
count vs ln threshold) search again before the selection is redone. The fits
are scale equivariant, so the scale learns the fitted law's shape error;
after the first call on a tensor a search is rare. Because the achieved
quality then stays within [0.8, 1.25], the stage rule seldom moves M; it
sets the estimate the scale starts from.

Quality: ``quality`` is the running mean of achieved/target density over all
calls (also in ``state_dict``); ``last_quality`` the last call's;
``last_passes`` the counting passes the correction spent on the last call.
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
from gradpress.compress.base import Context, Packet, Param
from gradpress.compress.numerics import host_reads, scale_pow2
from gradpress.compress.params import ratio_param
from gradpress.compress.registry import register

FIRST_RATIO = 0.25
ADAPT_EVERY = 5
ADAPT_HIGH = 1.2
ADAPT_LOW = 0.8
NEWTON_STEPS = 40
DISTS = ("exp", "gpareto", "gamma")
SAMPLE_MIN = 1 << 18
SAMPLE_PER_K = 256


def gamma_upper_inv(a: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """x with Q(a, x) = q (Q the regularized upper incomplete gamma), i.e.
    ``P^-1(a, 1 - q)``. Elementwise on fp64 tensors, a > 0, 0 < q < 1.

    Newton iterations on h(t) = ln Q(a, e^t) - ln q in t = ln x (h is monotone
    decreasing; steps are capped at |dt| <= 2), started from the
    Wilson-Hilferty approximation (or from ln(1/q) / small-x expansions where
    that approximation is not positive).
    """
    a = a.to(torch.float64)
    q = q.to(torch.float64).clamp(1e-300, 1 - 1e-16)
    z = torch.special.ndtri(1.0 - q)
    c = 1.0 / (9.0 * a)
    base = 1.0 - c + z * torch.sqrt(c)
    wh = a * base.clamp(min=0) ** 3
    # small-x start: P(a, x) ~ x^a / Gamma(a + 1)  =>  x ~ ((1-q) Gamma(a+1))^(1/a)
    small = torch.exp((torch.log1p(-q) + torch.lgamma(a + 1.0)) / a)
    x0 = torch.where(wh > 0, wh, torch.minimum(small, -torch.log(q) + 1.0))
    t = torch.log(x0.clamp(min=1e-300))
    log_q = torch.log(q)
    lg = torch.lgamma(a)
    for _ in range(NEWTON_STEPS):
        x = torch.exp(t)
        qx = torch.special.gammaincc(a, x).clamp(min=1e-300)
        h = torch.log(qx) - log_q
        # d/dt ln Q(a, e^t) = -x^a e^-x / (Gamma(a) Q)
        dh = -torch.exp(a * t - x - lg - torch.log(qx))
        step = (h / dh.clamp(max=-1e-300)).clamp(-2.0, 2.0)
        t = t - torch.nan_to_num(step)
    return torch.exp(t)


def _sums(y: torch.Tensor, need_log: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum, sum of squares, sum of ln over the nonzero entries) of ``y >= 0``, fp64 0-d."""
    s1 = y.sum().to(torch.float64)
    s2 = torch.dot(y, y).to(torch.float64)
    if need_log:
        tiny = torch.finfo(y.dtype).tiny
        # zeros are clamped to `tiny`; their log is taken back out of the sum
        n_zero = y.numel() - torch.count_nonzero(y).to(torch.float64)
        slog = torch.log(y.clamp(min=tiny)).sum().to(torch.float64) - n_zero * math.log(tiny)
    else:
        slog = torch.zeros((), dtype=torch.float64, device=y.device)
    return s1, s2, slog


def _moments(y: torch.Tensor, need_log: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:
    """(n, mean, variance, mean of ln, c) of the nonzero entries of ``y * c``
    for ``y >= 0`` (exact zeros are not counted). ``c`` is 1, or, where a
    sum over ``y`` overflows its dtype (finite data near the dtype's max; on
    accelerators always, with no host read), the power of two that brings
    max y to [0.5, 1): the fits are scale equivariant, so a threshold fitted
    to these moments is ``c`` times y's. Reductions run in the work dtype
    (pairwise summation), the results are fp64 0-d tensors."""
    n = torch.count_nonzero(y).to(torch.float64)
    n_safe = n.clamp(min=1.0)
    c = torch.ones((), dtype=torch.float64, device=y.device)
    s1, s2, slog = None, None, None
    if host_reads(y):
        s1, s2, slog = _sums(y, need_log)
        if not bool(torch.isfinite(s1) & torch.isfinite(s2)):
            s1 = None
    if s1 is None:  # scaled: exact (a power of two), no square overflows
        cy = scale_pow2(y.amax(), y.dtype) if y.numel() else torch.ones((), dtype=y.dtype, device=y.device)
        s1, s2, slog = _sums(y * cy, need_log)
        c = cy.to(torch.float64)
    mu = s1 / n_safe
    var = (s2 / n_safe - mu * mu).clamp(min=0.0)
    return n, mu, var, slog / n_safe, c


def fit_threshold(dist: str, mu: torch.Tensor, var: torch.Tensor, mlog: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """eta with P(Y > eta) = ratio under ``dist`` fitted by (mu, var, mean ln)."""
    ln_r = torch.log(ratio)
    exp_eta = -mu * ln_r
    if dist == "exp":
        return exp_eta
    if dist == "gpareto":
        r = mu * mu / var
        xi = 0.5 * (1.0 - r)
        alpha = 0.5 * mu * (r + 1.0)
        safe_xi = torch.where(xi.abs() < 1e-8, torch.ones_like(xi), xi)
        eta = torch.where(xi.abs() < 1e-8, -alpha * ln_r, alpha * torch.expm1(-xi * ln_r) / safe_xi)
        return torch.where(torch.isfinite(eta) & (var > 0), eta, exp_eta)
    if dist == "gamma":
        s = torch.log(mu) - mlog
        s = s.clamp(min=1e-12)
        shape = (3.0 - s + torch.sqrt((s - 3.0) ** 2 + 24.0 * s)) / (12.0 * s)
        scale = mu / shape
        eta = scale * gamma_upper_inv(shape, ratio)
        return torch.where(torch.isfinite(eta), eta, exp_eta)
    raise ValueError(f"unknown distribution {dist!r}; allowed: {', '.join(DISTS)}")


def max_stages(ratio: float) -> int:
    """ceil(log_0.5 delta), and 1 when delta >= delta_1."""
    if ratio >= FIRST_RATIO:
        return 1
    return max(1, math.ceil(math.log(ratio) / math.log(0.5)))


def initial_stages(ratio: float) -> int:
    """Start of adaptive M: ceil(ln delta / ln delta_1) within [1, max]."""
    if ratio >= FIRST_RATIO:
        return 1
    return min(max_stages(ratio), max(1, math.ceil(math.log(ratio) / math.log(FIRST_RATIO) - 1e-9)))


def tail_sample(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """|x| at a regular stride: at least ``max(SAMPLE_MIN, SAMPLE_PER_K / ratio)``
    entries (all of x when it is smaller). Later stages fit the exceedances
    in it: at the last stage about SAMPLE_PER_K * (delta_{M-1} / delta) of them."""
    target = max(SAMPLE_MIN, math.ceil(SAMPLE_PER_K / ratio))
    stride = max(1, x.numel() // target)
    return x[::stride].abs() if stride > 1 else x.abs()


def sidco_threshold(a: torch.Tensor | None, ratio: float, dist: str, stages: int,
                    x: torch.Tensor | None = None) -> torch.Tensor:
    """Multi-stage threshold on ``a = |x|`` (0-d tensor, work dtype).

    Stage 1 fits all nonzero magnitudes of ``a`` or, when ``a`` is None, those
    of the strided sample of ``x`` (the gamma fit needs ``a``). Each later
    stage fits the exceedances over the running threshold within a strided
    sample of |x| (:func:`tail_sample`), which are gathered into a smaller
    tensor (one host sync per later stage; the full tensor is never
    compacted, which would cost more than an exact top-k).
    """
    src = a if a is not None else x
    assert src is not None
    d = src.numel()
    stages = min(stages, max_stages(ratio))
    per_stage = (ratio / FIRST_RATIO) ** (1.0 / (stages - 1)) if stages > 1 else ratio
    thr = torch.zeros((), dtype=torch.float64, device=src.device)
    sample = a is None or stages > 1
    rest = tail_sample(x if x is not None else src, ratio) if sample else src
    for i in range(stages):
        stage_dist = dist if (i == 0 or dist != "gamma") else "gpareto"
        if i == 0:
            if a is None:  # fit on the sample; rescale to its nonzero count
                n, mu, var, mlog, c = _moments(rest, False)
                d = rest.numel()
            else:
                n, mu, var, mlog, c = _moments(a, stage_dist == "gamma")
            target = FIRST_RATIO if stages > 1 else ratio
            r = (target * d / n.clamp(min=1.0)).clamp(max=1.0)  # rescale to the nonzero count
        else:
            rest = rest[rest > thr.to(src.dtype)]
            n, mu, var, mlog, c = _moments(rest - thr.to(src.dtype), stage_dist == "gamma")
            r = torch.full((), per_stage, dtype=torch.float64, device=src.device)
        eta = fit_threshold(stage_dist, mu, var, mlog, r)
        eta = torch.where((n > 0) & torch.isfinite(eta), eta.clamp(min=0.0), torch.zeros_like(eta))
        # back to y's scale: inf only where the threshold exceeds fp64, above every |x| (selects nothing)
        thr = thr + eta / c
    return thr.to(src.dtype)


@register
class SIDCo(ThresholdSparsifier):
    name = "sidco"
    PARAMS = (
        ratio_param(0.001, "target density"),
        Param("dist", str, "exp", "one of exp, gpareto, gamma", lambda v: v in DISTS, "fitted distribution"),
        Param("stages", int, 0, "0 (adaptive) or an integer >= 1", lambda v: v >= 0, "number of fitting stages"),
        correction_param("adaptive: per-tensor scale + in-call guard (default); none: the paper's estimate alone"),
    )
    stateful = True
    state_dict_copies = True  # stage counts and windows in fresh containers, besides the base's numbers
    guarded = True
    summary = "SIDCo: threshold from a fitted exponential / generalized Pareto / gamma law (Abdelmoniem et al. 2021)"

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.stage_counts: dict[str, int] = {}
        self._windows: dict[str, list[float]] = {}

    def current_stages(self, key: str) -> int:
        """Stages used for tensor ``key`` on its next call."""
        if self.stages > 0:
            return min(self.stages, max_stages(self.ratio))
        return self.stage_counts.get(key, initial_stages(self.ratio))

    @property
    def needs_abs(self) -> bool:  # type: ignore[override]
        return self.dist == "gamma"  # mean of ln|x| over all entries

    def _threshold(self, xw: torch.Tensor, a: torch.Tensor | None, k: int, ctx: Context) -> torch.Tensor:
        return sidco_threshold(a, self.ratio, self.dist, self.current_stages(ctx.key), xw)

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        before = self._meter.count
        packet = super()._encode(x, ctx)
        if self.stages == 0 and self._meter.count > before:
            self._adapt(ctx.key, self._meter.last)
        return packet

    def _adapt(self, key: str, q: float) -> None:
        window = self._windows.setdefault(key, [])
        window.append(q)
        if len(window) < ADAPT_EVERY:
            return
        mean = sum(window) / len(window)
        window.clear()
        m = self.stage_counts.get(key, initial_stages(self.ratio))
        if mean > ADAPT_HIGH:
            m -= 1
        elif mean < ADAPT_LOW:
            m += 1
        self.stage_counts[key] = min(max(m, 1), max_stages(self.ratio))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["stages"] = dict(self.stage_counts)
        state["windows"] = {k: list(v) for k, v in self._windows.items()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.stage_counts = {k: int(v) for k, v in state.get("stages", {}).items()}
        self._windows = {k: [float(q) for q in v] for k, v in state.get("windows", {}).items()}
