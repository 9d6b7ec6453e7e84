"""Range-safe arithmetic for the codecs that carry a scale (a norm, a mean, a
maximum): finite inputs anywhere in their dtype's range, subnormals
included, give finite, non-degenerate scales.

* Norms (:func:`row_norms`, :func:`flat_norm`): the plain norm is kept where
  it is safe (finite, and large enough that no power in it lost precision to
  underflow); other rows are recomputed as ``m * ||v / m||`` with
  ``m = max|v|``, so no power overflows or underflows.
* Centered deviation (:func:`centered_std`): two passes (mean, then the
  deviations) on the tensor scaled by a power of two, so it neither cancels
  (a one-pass ``E[x^2] - E[x]^2`` does) nor overflows.
* Side means (:func:`side_means`, 1-bit SGD): each side summed directly
  (never ``(sum +- L1) / 2``, which cancels), and rescaled by 2^-64 where a
  sum overflows.
* Scales on the wire (:func:`pack_scale` / :func:`unpack_scale`): 4 bytes.
  fp32 for fp32/fp16/bf16 inputs; fp64 inputs send the upper 32 bits of the
  fp64 value (sign, the full 11-bit exponent, 20 fraction bits, rounded),
  which keeps fp64's range in the 4 bytes the wire formats pin.
* Outputs (:func:`saturate_`): a decoded value that its (narrower) dtype
  cannot hold saturates at the dtype's largest finite value.
* Sums on the wire (:func:`summand_limit`): the largest magnitude each of N
  summands may have so that their sum, added in a narrow dtype in any order
  (an allreduce, a ring's hops, a PS root), cannot round to inf.

Data-dependent fallbacks read one flag on the host on CPU (a cheap read); on
other devices they are computed always and chosen with ``torch.where``, so
the hot path has no host sync. ``SYNC_FREE`` forces the latter path (tests).
"""

from __future__ import annotations

import functools
import math

import torch

from gradpress.compress.spans import chunk_spans

__all__ = [
    "SYNC_FREE",
    "centered_std",
    "compute_dtype",
    "summand_limit",
    "exponent_of",
    "flat_norm",
    "host_reads",
    "mean_abs",
    "pack_scale",
    "pow2",
    "round_up_to",
    "row_norms",
    "saturate_",
    "scale_pow2",
    "side_means",
    "unpack_scale",
]

#: take the sync-free path on every device (tests exercise it on CPU)
SYNC_FREE = False

_MANT = {torch.float32: 23, torch.float64: 52}
_BIAS = {torch.float32: 127, torch.float64: 1023}
_INT = {torch.float32: torch.int32, torch.float64: torch.int64}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; everything narrower is computed in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def summand_limit(dtype: torch.dtype, summands: int) -> float:
    """Largest ``|term|`` such that ``summands`` terms, each rounded to
    ``dtype`` and added in ``dtype`` in any order, stay finite.

    With ``M`` the dtype's maximum and ``h`` half the spacing of its top
    binade (fp16: 16, bf16: 2^119): rounding a term of about ``M / N`` to
    the dtype adds at most ``2h / N`` to it, and each of the ``N - 1``
    additions at most ``h``, so terms of at most ``(M - (N + 1) h) / N``
    sum to at most ``M`` (rounding to nearest never passes ``M``: overflow
    needs ``M + h``). The total is floored at ``M / 2``, where it is no
    longer a guarantee (fp16 beyond 2,046 summands, bf16 beyond 255): the
    engine's non-finite check still catches an overflow there.
    """
    finfo = torch.finfo(dtype)
    half_spacing = finfo.max / (2.0 - finfo.eps) * finfo.eps / 2.0  # 2^emax * eps / 2
    return max(finfo.max - (summands + 1) * half_spacing, finfo.max / 2.0) / summands


def host_reads(t: torch.Tensor) -> bool:
    """A data-dependent branch may read a flag of ``t`` on the host: on CPU
    (cheap), not on accelerators (a host sync) nor when ``SYNC_FREE``."""
    return t.device.type == "cpu" and not SYNC_FREE


def pow2(k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exactly 2^k (``dtype`` fp32 or fp64), built from its bits; ``k`` is
    clamped to the normal exponent range."""
    bias, mant = _BIAS[dtype], _MANT[dtype]
    biased = (k.to(torch.int64).clamp(1 - bias, bias) + bias).to(_INT[dtype])
    return biased.bitwise_left_shift(mant).view(dtype)


def exponent_of(m: torch.Tensor) -> torch.Tensor:
    """e (int32) with m = f * 2^e, 0.5 <= |f| < 1; 0 for zero or non-finite m."""
    return torch.frexp(m)[1]


def scale_pow2(m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A power of two c (``dtype``) with ``m * c`` near 1 (exactly in [0.5, 1)
    unless 2^-e leaves the normal range, then the nearest normal power): a
    multiplication by c is exact and brings data whose maximum is ``m`` to
    unit scale, where no square overflows or underflows. 1 for zero or
    non-finite ``m``."""
    return pow2(-exponent_of(m).to(torch.int64), dtype)


def _floor(dtype: torch.dtype, ord: float) -> float:
    """Smallest norm whose ord-th power keeps 46 bits above the underflow
    threshold: powers that underflowed then change it by < d * 2^-69 (fp32).
    0 for ord <= 1 (sums of magnitudes lose nothing to underflow)."""
    if ord <= 1:
        return 0.0
    tiny_exp = math.log2(torch.finfo(dtype).tiny)
    return 2.0 ** ((tiny_exp + 46) / ord)


def _scaled_row_norms(rows: torch.Tensor, ord: float) -> torch.Tensor:
    m = rows.abs().amax(dim=1)
    safe = torch.where(m > 0, m, torch.ones_like(m))
    return m * torch.linalg.vector_norm(rows / safe[:, None], ord, dim=1)


def chunks(flat: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """``flat`` as 2-D views: ``(d // chunk, chunk)`` whole chunks, then the
    short last chunk as ``(1, d % chunk)`` (each only when non-empty)."""
    d = flat.numel()
    full = d // chunk * chunk
    parts = [flat[:full].view(-1, chunk)] if full else []
    if full < d:
        parts.append(flat[full:].view(1, -1))
    return parts


def row_norms(rows: torch.Tensor, ord: float = 2.0) -> torch.Tensor:
    """||row||_ord of every row of the 2-D ``rows`` (floating, computed in its
    dtype), without the overflow or underflow of the powers inside: rows whose
    plain norm is not safe are recomputed as ``m * ||row / m||``, m = max|row|.
    The result is inf only where the true norm exceeds the dtype; a row
    holding NaN/Inf gives a non-finite norm."""
    n = torch.linalg.vector_norm(rows, ord, dim=1)
    if math.isinf(ord) or rows.numel() == 0:
        return n
    ok = (n >= _floor(rows.dtype, ord)) & (n < math.inf)
    if host_reads(rows):
        if bool(ok.all()):
            return n
        idx = torch.nonzero(~ok).reshape(-1)
        return n.index_put_((idx,), _scaled_row_norms(rows.index_select(0, idx), ord))
    return torch.where(ok, n, _scaled_row_norms(rows, ord))


def flat_norm(flat: torch.Tensor, ord: float, dtype: torch.dtype) -> torch.Tensor:
    """0-d ||flat||_ord computed in ``dtype`` as :func:`row_norms` does; the
    rescaled recomputation works span by span (temporaries of one span)."""
    d = flat.numel()
    if d == 0:
        return torch.zeros((), dtype=dtype, device=flat.device)
    n = torch.linalg.vector_norm(flat.to(dtype), ord)
    if math.isinf(ord):
        return n
    ok = (n >= _floor(dtype, ord)) & (n < math.inf)
    if host_reads(flat) and bool(ok):
        return n
    spans = chunk_spans(d, flat.device)
    m = torch.stack([flat[a:b].abs().amax() for a, b in spans]).amax().to(dtype)
    safe = torch.where(m > 0, m, torch.ones_like(m))
    parts = torch.stack([torch.linalg.vector_norm(flat[a:b].to(dtype) / safe, ord) for a, b in spans])
    return torch.where(ok, n, m * torch.linalg.vector_norm(parts, ord))


def mean_abs(v: torch.Tensor) -> torch.Tensor:
    """0-d mean of |v| over the flat floating ``v`` (0 when empty), in its
    dtype; where the sum overflows, ``m * mean(|v| / m)``, m = max|v|."""
    d = v.numel()
    if d == 0:
        return torch.zeros((), dtype=v.dtype, device=v.device)
    mean = torch.linalg.vector_norm(v, 1) / d  # fused |v| sum, no temporary
    if host_reads(v) and bool(torch.isfinite(mean)):
        return mean
    m = v.abs().amax()
    safe = torch.where(m > 0, m, torch.ones_like(m))
    return torch.where(torch.isinf(mean), m * (torch.linalg.vector_norm(v / safe, 1) / d), mean)


def centered_std(g: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scaled: bool = False) -> torch.Tensor:
    """Population standard deviation sqrt(mean((g - mean g)^2)) of the flat
    floating ``g`` whose minimum and maximum are ``lo`` and ``hi``.

    Corrected two-pass algorithm (Chan, Golub and LeVeque 1983) on ``g * c``
    (:func:`scale_pow2` of max|g|, so |g c| < 1): the mean, then
    mean(dev^2) - mean(dev)^2 over the deviations, which removes the rounding
    of the mean to first order. It neither cancels (a one-pass E[g^2] -
    E[g]^2 does) nor overflows nor loses to underflow. Exactly 0 when
    ``lo == hi`` (a sum of equal values is not exact, so the deviations of a
    constant would not be 0). 0-d, dtype of ``g``; non-finite ``g`` gives a
    non-finite result. ``scaled``: the deviation of ``g * c`` itself (not
    divided by c), for a caller that works on the scaled data (no
    rounding where the deviation is subnormal, no overflow of what it
    computes from it)."""
    d = g.numel()
    if d == 0:
        return torch.zeros((), dtype=g.dtype, device=g.device)
    c = scale_pow2(torch.maximum(-lo, hi), g.dtype)
    dev = g * c
    dev.sub_(dev.mean())
    var = (torch.linalg.vector_norm(dev) ** 2 / d - (dev.sum() / d) ** 2).clamp(min=0)
    std = var.sqrt() if scaled else var.sqrt() / c
    return torch.where(lo == hi, torch.zeros_like(std), std)


def side_means(v: torch.Tensor, n_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean of the entries >= 0, mean of the entries < 0) of the flat
    floating ``v``, 0 for an empty side; ``n_pos`` counts the entries >= 0.
    Each side is summed on its own (never ``(sum +- L1) / 2``, which cancels
    when one side dominates); a side whose sum overflows is summed again on
    ``v * 2^-64`` (what that flushes is below 2^-60 of the side's sum)."""
    n_pos = n_pos.to(v.dtype)
    counts = torch.stack([n_pos, v.numel() - n_pos]).clamp(min=1)
    means = _side_sums(v) / counts
    overflow = torch.isinf(means)  # an overflowed sum, or an infinite entry (which stays infinite)
    if not host_reads(v) or bool(overflow.any()):
        c = pow2(torch.tensor(-64, device=v.device), v.dtype)
        again = _side_sums(v * c) / counts / c
        means = torch.where(overflow, again, means)
    return means[0], -means[1]


def _side_sums(v: torch.Tensor) -> torch.Tensor:
    """[sum of max(v, 0), sum of -min(v, 0)], one temporary."""
    buf = v.clamp(min=0)
    s_pos = buf.sum()
    return torch.stack([s_pos, buf.sub_(v).sum()])  # max(v, 0) - v = -min(v, 0), exactly


# ----- scales on the wire ---------------------------------------------------------------------
_HI_MAX = 0x7FEFFFFF  # upper word of the largest finite fp64 magnitude (rounded down)
_EXP_ALL = 0x7FF00000  # upper word of inf


def pack_scale(t: torch.Tensor, dtype: torch.dtype, away: bool = False, saturate: bool = False) -> torch.Tensor:
    """Scales ``t`` (computed in :func:`compute_dtype` of ``dtype``) as the
    4-byte wire payload for an input of ``dtype``.

    fp32/fp16/bf16 inputs: fp32, unchanged (``saturate``: a value beyond fp32
    clamps to +-max; NaN stays NaN). fp64 inputs: int32, the upper word of
    the fp64 value rounded to nearest (``away``: away from zero, so the
    decoded magnitude is never below ``t``); a finite value never rounds to
    inf (``saturate``: nor does an infinite one, the overflowed norm of a
    finite bucket near fp64's maximum: it clamps to the largest finite
    upper word; NaN stays NaN). Relative precision 2^-21 (nearest) or 2^-20
    (away)."""
    t = t.reshape(-1)
    if dtype != torch.float64:
        out = t.to(torch.float32)
        if saturate:
            big = torch.finfo(torch.float32).max
            out = out.clamp(-big, big)
        return out.contiguous()
    bits = t.to(torch.float64).contiguous().view(torch.int64)
    mag = bits & 0x7FFFFFFFFFFFFFFF
    word = (mag + ((1 << 32) - 1 if away else 1 << 31)) >> 32
    finite = mag < (_EXP_ALL << 32)
    capped = finite | (mag == (_EXP_ALL << 32)) if saturate else finite  # saturate: +-inf too, never NaN
    word = torch.where(capped & (word > _HI_MAX), torch.full_like(word, _HI_MAX), word)
    word = word + (bits < 0).to(torch.int64) * (1 << 31)
    word = torch.where(word >= 1 << 31, word - (1 << 32), word)  # two's complement of the 32-bit word
    return word.to(torch.int32)


def unpack_scale(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`pack_scale`: the scales in :func:`compute_dtype` of ``dtype``."""
    if dtype != torch.float64:
        return p.to(torch.float32)
    return p.to(torch.int64).bitwise_left_shift(32).view(torch.float64)


def round_up_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Non-negative ``t`` rounded up onto the grid of ``dtype`` when that is
    fp16 or bf16 (so a decoded magnitude is exactly representable and not
    below ``t``), clamped to its largest finite value; unchanged otherwise."""
    if dtype not in (torch.float16, torch.bfloat16):
        return t
    near = t.to(dtype)
    up = torch.where(near.to(t.dtype) < t, torch.nextafter(near, torch.full_like(near, math.inf)), near)
    big = torch.finfo(dtype).max
    return up.to(t.dtype).clamp(max=big)


def saturate_(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clamp ``t`` in place to +-(largest finite value of ``dtype``) when
    ``dtype`` cannot hold ``t.dtype``'s range (NaN stays NaN; +-inf become
    +-max); then the cast to ``dtype`` cannot overflow. The bound is taken
    in ``t``'s grid rounded toward zero (bf16 has no 65504, fp16's maximum:
    it clamps at 65280, not at 65536)."""
    if torch.finfo(dtype).max < torch.finfo(t.dtype).max:
        lim = _saturation_bound(t.dtype, dtype)
        t.clamp_(-lim, lim)
    return t


@functools.cache
def _saturation_bound(grid: torch.dtype, dtype: torch.dtype) -> float:
    """The largest value of ``grid`` not above ``dtype``'s maximum (computed
    once per pair: :func:`saturate_` runs on every scale a codec packs)."""
    big = torch.finfo(dtype).max
    lim = torch.tensor(big, dtype=torch.float64).to(grid)
    if float(lim) > big:
        lim = torch.nextafter(lim, torch.zeros_like(lim))
    return float(lim)
