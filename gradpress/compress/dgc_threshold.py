"""``dgc_threshold``: the sampling threshold estimator of Deep Gradient
Compression (Lin et al. 2018) on its own, as SIDCo (Abdelmoniem et al. 2021)
uses it as a baseline: no momentum correction, no adaptation passes, no exact
top-k.

The threshold is the ceil(delta*n_s)-th largest of a strided sample of |x|
(:func:`gradpress.compress.dgc.sampled_threshold`); entries with
``|x| >= threshold`` are sent. The count is random around k: its expectation
is k (order statistic of a uniform sample), its spread about k^(-1/2) of the
sample's top count, so single calls can miss by tens of percent at tiny
densities while the running ``quality`` (achieved/target density) stays near 1.

Packet: ``[values (input dtype), indices (int32)]``, variable size; biased,
error feedback on by default.
"""

from __future__ import annotations

import torch

from gradpress.compress._threshold_select import ThresholdSparsifier
from gradpress.compress.base import Context, Packet, Param
from gradpress.compress.dgc import sampled_threshold
from gradpress.compress.params import ratio_param
from gradpress.compress.registry import register


@register
class DGCThreshold(ThresholdSparsifier):
    name = "dgc_threshold"
    PARAMS = (
        ratio_param(0.001, "target density"),
        Param("sample_ratio", float, 0.01, "0 < sample_ratio <= 1", lambda v: 0 < v <= 1, "fraction of |x| sampled"),
    )
    summary = "DGC sampled-threshold estimator alone (Lin et al. 2018), SIDCo baseline"
    _period = 1
    needs_abs = False  # the sample is taken from x; |.| of the sample only

    def _threshold(self, xw: torch.Tensor, a: torch.Tensor | None, k: int, ctx: Context) -> torch.Tensor:
        return sampled_threshold(xw, self.ratio, self.sample_ratio, ctx.private_seed, self._period)

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        self._period = x.shape[-1] if x.dim() >= 2 else 1
        return super()._encode(x, ctx)
