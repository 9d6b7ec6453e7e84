"""Shared float64 references the tests compute themselves, by the
definitions, with no gradpress code: the dense top-k (``topk`` and every
method that keeps "the k entries of largest magnitude"), and the stateful
compressors' averages step by step (DGC, Signum, PowerSGD: :func:`dgc_run`,
:func:`signum_run`, :func:`powersgd_run`), a step left out as after a
skipped one.

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

__all__ = ["kept", "topk", "topk_dense", "topk_indices", "topk_support", "t_ref", "ci_ref", "mean_sd",
           "dgc_run", "signum_run", "gram_schmidt", "powersgd_run"]


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



def error_feedback_run(grad: Callable[[int, int], torch.Tensor], world: int, steps: int,
                       send: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor | None]:
    """A compressor with error feedback by its definition, in float64, over ``steps`` steps of ``world`` ranks
    (``grad(rank, step)``): per step the mean over ranks of what each sends (``p = e + g``, send ``send(p)``,
    ``e <- p - send(p)``); None at a step where some rank's gradient is not finite, which leaves every
    residual as it was (a NaN/Inf step skipped, as by a loss scaler)."""
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
            s = send(p)
            residuals[r] = p - s
            sent.append(s)
        out.append(sum(sent) / world)
    return out


def error_feedback_topk_run(grad: Callable[[int, int], torch.Tensor], world: int, steps: int,
                            ratio: float) -> list[torch.Tensor | None]:
    """:func:`error_feedback_run` of top-k (``topk:ratio=...``)."""
    return error_feedback_run(grad, world, steps, lambda p: topk(p, ratio))


# ----------------------------------------------------------------------------- stateful compressors

#: ``grads(step)``: every rank's float64 gradient of that step; ``keep(step)``: False for a step left out (its
#: entry is None and every buffer stays as it was, as after a skipped step)
Grads = Callable[[int], list[torch.Tensor]]


def kept_steps_run(grads: Grads, steps: int, keep: Callable[[int], bool],
                   average: Callable[[list[torch.Tensor]], torch.Tensor]) -> list[torch.Tensor | None]:
    """Per step ``average(grads(step))``, the step's average by a method's definition (which updates the
    method's buffers it closes over); None for a step left out, where ``average`` is not called, so every
    buffer stays as it was."""
    return [average(grads(step)) if keep(step) else None for step in range(steps)]


def dgc_run(grads: Grads, steps: int, keep: Callable[[int], bool], ratio: float,
            beta: float) -> list[torch.Tensor | None]:
    """DGC by the definition (no clipping, no warm-up): u = beta u + g, v = v + u, send v at the top-k of |v|
    (k = ceil(ratio d)), zero u and v there; per step the average of the ranks' sends."""
    u: list[torch.Tensor] = []
    v: list[torch.Tensor] = []

    def average(gs: list[torch.Tensor]) -> torch.Tensor:
        d = gs[0].numel()
        k = math.ceil(ratio * d)
        if not u:
            u.extend(torch.zeros(d, dtype=torch.float64) for _ in gs)
            v.extend(torch.zeros(d, dtype=torch.float64) for _ in gs)
        total = torch.zeros(d, dtype=torch.float64)
        for r, g in enumerate(gs):
            u[r] = beta * u[r] + g.reshape(-1)
            v[r] = v[r] + u[r]
            idx = torch.topk(v[r].abs(), k).indices
            total[idx] += v[r][idx]
            u[r][idx] = 0.0
            v[r][idx] = 0.0
        return (total / len(gs)).reshape(gs[0].shape)

    return kept_steps_run(grads, steps, keep, average)


def signum_run(grads: Grads, steps: int, keep: Callable[[int], bool], beta: float) -> list[torch.Tensor | None]:
    """Signum's average: the majority vote of the ranks' momentum signs, m = beta m + (1 - beta) g (sign(0) =
    +1 locally, a tie gives 0)."""
    m: list[torch.Tensor] = []

    def average(gs: list[torch.Tensor]) -> torch.Tensor:
        if not m:
            m.extend(torch.zeros_like(g, dtype=torch.float64) for g in gs)
        m[:] = [beta * m[r] + (1 - beta) * g for r, g in enumerate(gs)]
        return torch.sign(sum(torch.where(x >= 0, 1.0, -1.0).double() for x in m))

    return kept_steps_run(grads, steps, keep, average)


def gram_schmidt(p: torch.Tensor) -> torch.Tensor:
    """The columns of ``p`` orthonormalized in order (classical Gram-Schmidt, as PowerSGD's)."""
    p = p.clone()
    for i in range(p.shape[1]):
        p[:, i] /= p[:, i].norm()
        for j in range(i + 1, p.shape[1]):
            p[:, j] -= p[:, i] * (p[:, i] @ p[:, j])
    return p


def powersgd_run(grads: Grads, steps: int, keep: Callable[[int], bool],
                 q: torch.Tensor) -> list[torch.Tensor | None]:
    """PowerSGD with error feedback by the definition: M_r = g_r + e_r, P = orth(sum M_r Q), Q = sum M_r^T P / N,
    average P Q^T, e_r = M_r - P Q^T; Q warm-started from the last step it was computed in, the first ``q``
    (float64, columns x rank: the caller draws it as the compressor does)."""
    e: list[torch.Tensor] = []

    def average(gs: list[torch.Tensor]) -> torch.Tensor:
        nonlocal q
        if not e:
            e.extend(torch.zeros_like(g, dtype=torch.float64) for g in gs)
        ms = [g + e[r] for r, g in enumerate(gs)]
        p = gram_schmidt(sum(x @ q for x in ms))
        q = sum(x.t() @ p for x in ms) / len(gs)
        avg = p @ q.t()
        e[:] = [x - avg for x in ms]
        return avg

    return kept_steps_run(grads, steps, keep, average)


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
