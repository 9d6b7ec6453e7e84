"""``gaussiank``: Gaussian-k threshold (Shi et al. 2019, "Understanding Top-k
Sparsification in Distributed Deep Learning"), a SIDCo baseline.

Assume x ~ N(mu, sigma^2): the threshold keeping a fraction delta of |x| is
``thr = |mu| + sigma * Phi^-1(1 - delta/2)`` (``torch.special.ndtri``). Then
up to 3 corrections as in the reference implementations: fewer than 2k/3
selected -> thr *= 0.5; more than 4k/3 -> thr *= 1.5; otherwise stop. The
correction steps are coarse, so a call can end outside +-25% when the data is
far from Gaussian (the method's own band is [2k/3, 4k/3] before the last
step).

Packet: ``[values (input dtype), indices (int32)]``, variable size; biased,
error feedback on by default.
"""

from __future__ import annotations

from statistics import NormalDist

import torch

from gradpress.compress._threshold_select import ThresholdSparsifier
from gradpress.compress.base import Context
from gradpress.compress.params import ratio_param
from gradpress.compress.registry import register

MAX_ADJUST = 3


@register
class GaussianK(ThresholdSparsifier):
    name = "gaussiank"
    PARAMS = (ratio_param(0.001, "target density"),)
    summary = "Gaussian-k: threshold from the normal quantile of mean/std (Shi et al. 2019)"
    #: corrections (x0.5 / x1.5) spent on the last call
    last_adjustments = 0
    #: counting runs on BlockMax rows when the selection does (no |x| buffer)
    needs_abs = False

    def _threshold(self, xw: torch.Tensor, a: torch.Tensor, k: int, ctx: Context) -> torch.Tensor:
        mean = xw.mean()
        std = xw.std() if xw.numel() > 1 else torch.zeros_like(mean)
        z = NormalDist().inv_cdf(1.0 - self.ratio / 2.0) if self.ratio < 1 else 0.0
        thr = mean.abs() + z * torch.nan_to_num(std)
        self.last_adjustments = 0
        for _ in range(MAX_ADJUST):
            nnz = self._count(a, thr)
            if nnz < 2 * k / 3:
                thr = thr * 0.5
            elif nnz > 4 * k / 3:
                thr = thr * 1.5
            else:
                break
            self.last_adjustments += 1
        return thr
