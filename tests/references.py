"""Shared float64 references the tests compute themselves, by the
definitions, with no gradpress code: the dense top-k (``topk`` and every
method that keeps "the k entries of largest magnitude").

The rule, everywhere: rank the entries of the flattened tensor by their
magnitude in float64 (exact for every float dtype), largest first, NaN above
every number; ties go to the lower index (gradpress's own rule,
:func:`gradpress.compress.sparse.topk_magnitude`). A test whose data has no
tie at the k-th magnitude (continuous random data) does not depend on the
tie rule; the tests that need it (ties, NaN) say so where they call these.

Statistics over seeds (``gradpress compare --seeds``, ``gradpress bench e2e
--seeds``): :func:`t_ref`, Student's t quantile by Newton's method on the
CDF (itself Simpson's rule on the density), and :func:`ci_ref`, the 95%
interval of a mean, mean ± t(0.975, n-1) s / sqrt(n).

The selection is two stable sorts of the float64 magnitudes (not
``torch.topk``, whose tie order and unsorted output depend on its kernel).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["kept", "topk", "topk_dense", "topk_indices", "topk_support", "t_ref", "ci_ref", "mean_sd"]


def kept(d: int, ratio: float) -> int:
    """k = ceil(ratio * d), at least 1 and at most d for a non-empty tensor; 0 for an empty one."""
    return 0 if d == 0 else min(d, max(1, math.ceil(ratio * d)))


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Flat indices (int64, ascending) of the ``k`` entries of ``x`` of largest
    magnitude: NaN first, then |x| descending in float64, ties to the lower index."""
    mag = x.detach().reshape(-1).double().abs().cpu()
    nan = torch.isnan(mag)
    order = torch.sort(torch.where(nan, 0.0, -mag), stable=True).indices  # largest first, ties by index
    order = order[torch.sort((~nan[order]).to(torch.int8), stable=True).indices]  # NaN ahead, order kept
    return order[:max(0, k)].sort().values.to(x.device)


def topk_support(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """What ``topk:ratio=...`` keeps of ``x``: :func:`topk_indices` with k = :func:`kept`."""
    return topk_indices(x, kept(x.numel(), ratio))


def topk_dense(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` where :func:`topk_indices` keeps it, 0 elsewhere (``x``'s shape, dtype and device)."""
    flat = x.detach().reshape(-1)
    out = torch.zeros_like(flat)
    idx = topk_indices(flat, k)
    out[idx] = flat[idx]
    return out.reshape(x.shape)


def topk(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """The ``topk:ratio=...`` compressor's decode(encode(x)): :func:`topk_dense` with k = :func:`kept`."""
    return topk_dense(x, kept(x.numel(), ratio))


def error_feedback_topk_mean(residuals: list[dict[str, torch.Tensor]], grads: list[torch.Tensor], name: str,
                             ratio: float) -> torch.Tensor:
    """One step of top-k with error feedback averaged over the ranks, in
    float64 (Stich et al. 2018; Karimireddy et al. 2019): per rank ``p =
    fp32(e + g)`` (the hook adds in float32), ``e <- p - topk(p)``, and the
    mean of the ranks' ``topk(p)``. ``residuals[r][name]`` is updated in
    place; ``grads[r]`` is rank r's gradient (zeros where it had none)."""
    ps = [(e[name] + g).float().double() for e, g in zip(residuals, grads)]
    sent = [topk(p, ratio) for p in ps]
    for e, p, s in zip(residuals, ps, sent):
        e[name] = p - s
    return sum(sent) / len(sent)



def error_feedback_topk_run(grad: Callable[[int, int], torch.Tensor], world: int, steps: int,
                            ratio: float) -> list[torch.Tensor | None]:
    """Top-k with error feedback by its definition, in float64, over ``steps`` steps of ``world`` ranks
    (``grad(rank, step)``): per step the mean over ranks of what each sends (``p = e + g``, send
    ``topk(p)``, ``e <- p - topk(p)``); None at a step where some rank's gradient is not finite, which
    leaves every residual as it was (a NaN/Inf step skipped, as by a loss scaler)."""
    residuals: list[torch.Tensor | None] = [None] * world
    out: list[torch.Tensor | None] = []
    for step in range(steps):
        gs = [grad(r, step).double() for r in range(world)]
        if not all(bool(torch.isfinite(g).all()) for g in gs):
            out.append(None)
            continue
        sent = []
        for r in range(world):
            p = gs[r] if residuals[r] is None else residuals[r] + gs[r]
            s = topk(p, ratio)
            residuals[r] = p - s
            sent.append(s)
        out.append(sum(sent) / world)
    return out

# ----------------------------------------------------------------------------- statistics over seeds


def _density(x: float, df: float) -> float:
    c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(c - (df + 1) / 2 * math.log1p(x * x / df))


def _cdf(x: float, df: float, n: int = 4000) -> float:
    """P(T <= x), x >= 0: 1/2 + the density's integral from 0 to x (composite Simpson, n intervals)."""
    h = x / n
    inner = math.fsum((4 if i % 2 else 2) * _density(i * h, df) for i in range(1, n))
    return 0.5 + h / 3 * (_density(0.0, df) + inner + _density(x, df))


def t_ref(p: float, df: float) -> float:
    """The p quantile (p > 1/2) of Student's t with df degrees of freedom, by Newton's method on the CDF."""
    x = 2.0
    for _ in range(60):
        step = (_cdf(x, df) - p) / _density(x, df)
        x = max(x - step, x / 4)
        if abs(step) < 1e-13 * x:
            break
    return x


def mean_sd(v: list[float]) -> tuple[float, float]:
    m = math.fsum(v) / len(v)
    return m, math.sqrt(math.fsum((x - m) ** 2 for x in v) / (len(v) - 1))


def ci_ref(v: list[float]) -> tuple[float, float]:
    """The 95% interval of the mean of ``v``: mean ± t(0.975, n-1) s / sqrt(n)."""
    m, s = mean_sd(v)
    half = t_ref(0.975, len(v) - 1) * s / math.sqrt(len(v))
    return m - half, m + half
