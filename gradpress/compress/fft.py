"""``fft``: FFT-based gradient sparsification ("FFT-based Gradient
Sparsification for the Distributed Training of Deep Neural Networks", HPDC
2020).

Per tensor: ``c = rfft(flatten(x))`` (orthonormal scaling, d//2 + 1
coefficients), drop the ``theta`` fraction of coefficients of smallest
magnitude (keep n_c - floor(theta_t * n_c), at least 1), send the kept
coefficients, and decode with ``irfft(n=d)``. With theta = 0 nothing is
dropped and the round trip is exact up to float rounding. The kept sets are
nested in theta, so the retained energy ||decode||^2 falls monotonically as
theta grows.

Schedule (the paper lowers theta during training, which its convergence
argument needs and which also recovers lost accuracy): ``constant`` keeps
``theta``; ``linear`` moves from ``theta`` to ``theta_end`` (<= theta) over
``decay_steps`` steps of ``ctx.step`` and stays there. Every rank computes
the same kept count at a step, so packets are fixed-size at a given step.

Wire format, chosen so that ``fft>rangefloat`` (the paper's pipeline) works
through ``compose.py``, which needs one index per value: the kept
coefficients' real and imaginary parts are interleaved into ``values``
``[re_0, im_0, re_1, im_1, ...]`` (input dtype, but fp32 for fp16 inputs:
the orthonormal transform can grow a magnitude by up to sqrt(d), the DC
term of a constant tensor is sqrt(d) times its value, beyond fp16's 65504
for modest tensors) and ``indices`` (int32) address the
real view of the spectrum (length 2*(d//2+1)): 2j for re_j, 2j+1 for im_j.
That costs 2*(elem + 4) bytes per kept coefficient (8 bytes more than the
minimum of one shared index). Computation in fp32 (fp64 for fp64 inputs).
Biased: error feedback on by default.

Extreme inputs: both transforms run on data scaled by a power of two to unit
maximum (exact), so no intermediate sum overflows and subnormal inputs keep
their precision. A coefficient beyond the value dtype (fp32/bf16/fp64
inputs within sqrt(d) of their maximum) and a decoded value beyond the
output dtype saturate at its maximum.
"""

from __future__ import annotations

import math

import torch

from gradpress.compress._threshold_select import work_dtype
from gradpress.compress.base import Compressor, Context, Packet, Param
from gradpress.compress.numerics import scale_pow2
from gradpress.compress.registry import register

SCHEDULES = ("constant", "linear")


def value_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the coefficients on the wire: the input's, fp32 for fp16."""
    return torch.float32 if dtype == torch.float16 else dtype


def kept_coefficients(n_coef: int, theta: float) -> int:
    """n_c - floor(theta * n_c), at least 1 (0 for an empty spectrum)."""
    if n_coef == 0:
        return 0
    return max(1, n_coef - math.floor(theta * n_coef))


@register
class FFT(Compressor):
    name = "fft"
    contractive = True  # drops the smallest orthonormal coefficients: a projection
    int32_indices = True  # into the real view of the d // 2 + 1 coefficients: < d + 2 entries
    PARAMS = (
        Param("theta", float, 0.9, "0 <= theta < 1", lambda v: 0 <= v < 1, "fraction of coefficients dropped"),
        Param("schedule", str, "constant", "constant or linear", lambda v: v in SCHEDULES, "how theta changes"),
        Param("theta_end", float, 0.5, "0 <= theta_end < 1 (<= theta for linear)", lambda v: 0 <= v < 1,
              "final theta of the linear schedule"),
        Param("decay_steps", int, 10000, "decay_steps >= 1", lambda v: v >= 1, "steps of the linear schedule"),
    )
    values_index = 0
    summary = "FFT sparsification: keep the largest rfft coefficients, inverse FFT on decode (HPDC 2020)"

    def _validate(self) -> None:
        if self.schedule == "linear" and self.theta_end > self.theta:
            raise ValueError(
                f"compressor 'fft': parameter 'theta_end' got {self.theta_end!r}; "
                f"allowed: 0 <= theta_end <= theta ({self.theta}) for the linear schedule (theta diminishes)"
            )

    def values_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return value_dtype(dtype)

    def theta_at(self, step: int) -> float:
        """theta_t of the schedule."""
        if self.schedule == "constant":
            return self.theta
        frac = min(max(step, 0) / self.decay_steps, 1.0)
        return self.theta + (self.theta_end - self.theta) * frac

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        flat = x.reshape(-1)
        d = flat.numel()
        if d == 0:
            return Packet(
                [torch.empty(0, dtype=value_dtype(x.dtype), device=x.device), torch.empty(0, dtype=torch.int32, device=x.device)],
                x.shape, x.dtype,
            )
        wd = work_dtype(x.dtype)
        lo, hi = torch.aminmax(flat)
        c = scale_pow2(torch.maximum(-lo, hi).to(wd), wd)  # unit maximum, exactly
        coef = torch.fft.rfft(flat.to(wd) * c, norm="ortho")
        kept = kept_coefficients(coef.numel(), self.theta_at(ctx.step))
        idx = torch.topk(coef.abs(), kept, sorted=False).indices
        values = torch.view_as_real(coef)[idx].reshape(-1).div_(c)
        vdt = value_dtype(x.dtype)
        big = torch.finfo(vdt).max
        values = values.clamp_(-big, big).to(vdt)
        real_idx = torch.stack([2 * idx, 2 * idx + 1], dim=1).reshape(-1)
        return Packet([values, real_idx.to(torch.int32)], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        values, idx = packet.tensors[0], packet.tensors[1]
        d = math.prod(packet.shape)
        if d == 0:
            return torch.empty(packet.shape, dtype=packet.dtype, device=values.device)
        wd = work_dtype(packet.dtype)
        spec = torch.zeros(2 * (d // 2 + 1), dtype=wd, device=values.device)
        v = values.to(wd)
        c = scale_pow2(v.abs().amax() if v.numel() else torch.zeros((), dtype=wd, device=v.device), wd)
        spec.index_put_((idx.long(),), v * c)
        out = torch.fft.irfft(torch.view_as_complex(spec.view(-1, 2)), n=d, norm="ortho").div_(c)
        big = torch.finfo(packet.dtype).max
        return out.clamp_(-big, big).to(packet.dtype).reshape(packet.shape)
