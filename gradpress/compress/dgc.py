"""``dgc``: Deep Gradient Compression (Lin et al., ICLR 2018, "Deep Gradient
Compression: Reducing the Communication Bandwidth for Distributed Training").

Per tensor (state keyed by ``ctx.key``), with ``g`` the incoming gradient:

1. Local gradient clipping (``clip > 0``): ``g`` is rescaled so that
   ``||g||_2 <= clip * sqrt(U)``, with U = ``ctx.world_size`` the
   compressing units whose packets are averaged (each ``g`` is a unit's
   gradient, the mean of its ``ctx.unit_workers`` workers, not divided by
   U). The paper (sec. 3.2) clips "the current gradient" of Algorithm 1,
   whose line 6 accumulates G^k += (1/(N b)) grad f, i.e. the local
   gradient already divided by N (eq. 3: nabla_{k,t} = (1/(N b)) sum
   grad f), to clip * N^(-1/2), "the current node's fraction of the global
   threshold", the global clip being the conventional one on the
   aggregated update, the mean sum_k nabla_{k,t}. For g_k / N clipped to
   clip / sqrt(N), ||g_k|| <= clip sqrt(N), and for independent g_k of
   equal variance ||(1/N) sum_k g_k||^2 ~ (1/N^2) sum_k ||g_k||^2
   <= clip^2: the MEAN gradient is bounded by ``clip``. The same placement
   in an independent implementation: PaddlePaddle's DGCMomentumOptimizer
   (python/paddle/distributed/fleet/meta_optimizers/dgc_optimizer.py)
   clips at clip_norm * num_trainers**-0.5 a gradient whose loss "has
   divided by nranks" (its dgc kernel then multiplies by nranks). The
   authors' code (github synxlin/deep-gradient-compression, dgc/memory.py)
   only has an optional, unset ``gradient_clipping`` hook on the local
   gradient. Until this was checked gradpress clipped g_k itself to
   clip / sqrt(N), which bounds the mean at clip / N.
   Under ``hierarchical`` a host leader encodes its host's mean m_h
   (H = U hosts of L workers); the update is (1/H) sum_h m_h, and for
   independent host means its norm^2 ~ (1/H^2) sum_h ||m_h||^2 <= t^2 / H:
   t = clip sqrt(H) bounds the mean by clip again (the paper's rule with
   the H hosts as its nodes; the sum-bound of the earlier rule,
   clip / (L sqrt(H)), times N = H L). Hence the one rule clip sqrt(U).
   The norm is computed without overflow or underflow of its squares
   (:func:`gradpress.compress.numerics.row_norms`). ``clip`` (and the 1e-6
   guard of the norm) are in gradient units: multiplied by
   ``ctx.loss_scale`` (the DDP hook's loss scale under fp16 AMP, else 1),
   so a scaled gradient is clipped as the unscaled one would be. Scope:
   one exchanged tensor (``ctx.key``: a parameter or one partition
   ``name#k``), as PaddlePaddle clips per parameter; the whole model's norm
   is unknown while the DDP hook sends its first bucket.
2. Momentum correction: ``u <- m*u + g``; ``v <- v + u``.
3. Select about k = ceil(delta_e * d) entries of ``|v|`` (sampled threshold
   below), send ``v`` there.
4. Momentum factor masking: ``v`` and ``u`` are zeroed at the sent indices.

The optimizer must then apply no momentum of its own: use
:func:`optimizer_for` (plain SGD, momentum 0). Because the compressor keeps
its own memory (``v`` is the residual), ``default_error_feedback`` is False.

Sampled threshold (:func:`sampled_threshold`, as in the authors' code):
a strided sample of ``max(ceil(sample_ratio*d), ceil(2/delta), 4096)``
elements of ``|v|`` (odd stride coprime with the last dimension, start
offset from the per-rank seed), threshold =
the ceil(delta*n_s)-th largest sample. If the selection has fewer than 0.8k
entries the threshold is lowered (x0.8, at most 10 passes); more than 1.3k
entries -> exact top-k among the selected; still fewer than 0.8k after the
passes -> exact top-k of the whole tensor (the fallback). ``last_info``
exposes the count before any exact step (``pre_fallback_count``) and the
path taken; ``quality`` is the running mean of achieved/target density.

Ratio warm-up (paper sec. 3.4, "exponentially increase the sparsity"):
delta_e = max(delta^((e+1)/(W+1)), delta) for epoch e = ctx.step //
steps_per_epoch < W, else delta; for W = 4, delta = 0.001: 25.1%, 6.3%,
1.58%, 0.40%, 0.1%.

State is kept in fp32 (fp64 for fp64 inputs). A non-finite gradient leaves
``u``/``v`` unchanged (and is selected, so the caller sees it).

Packet: ``[values (input dtype), indices (int32)]``, variable size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from gradpress.compress._threshold_select import (
    BlockMax,
    QualityMeter,
    QualityMixin,
    empty_sparse_packet,
    select_mask,
    use_blocks,
    work_dtype,
)
from gradpress.compress.base import Compressor, Context, Packet, Param, tensor_bytes
from gradpress.compress.numerics import row_norms, scale_pow2
from gradpress.compress.params import ratio_param
from gradpress.compress.registry import register
from gradpress.compress.sampling import sampled_threshold
from gradpress.compress.sparse import kept_count, scatter_sparse

UPPER = 1.3
LOWER = 0.8
MAX_PASSES = 10


def warmup_ratio(ratio: float, warmup_epochs: int, epoch: int) -> float:
    """delta_e = max(delta^((e+1)/(W+1)), delta) during the W warm-up epochs."""
    if warmup_epochs <= 0 or epoch >= warmup_epochs:
        return ratio
    return max(ratio ** ((epoch + 1) / (warmup_epochs + 1)), ratio)


def dgc_select(
    a: torch.Tensor, k: int, ratio: float, sample_ratio: float, seed: int, period: int = 1
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Indices (int64) DGC sends for ``a = |x|`` (``x`` itself may be given:
    only magnitudes matter) and what happened.

    ``info``: ``pre_fallback_count`` (entries the sampled threshold selected,
    after the x0.8 passes, before any exact top-k), ``passes``, ``path``
    ("sampled", "exact_among_selected" or "fallback"). At small densities the
    counts and the selection run on :class:`BlockMax` rows, not a full mask.
    """
    thr = sampled_threshold(a, ratio, sample_ratio, seed, period)
    if use_blocks(ratio):
        blocks = BlockMax(a)
        count_at, select_at = blocks.count, blocks.select
    else:
        mag = a.abs()

        def count_at(t: torch.Tensor) -> int:
            return int(torch.count_nonzero(select_mask(mag, t)))  # .sum() would widen the mask to int64

        def select_at(t: torch.Tensor) -> torch.Tensor:
            return torch.nonzero(select_mask(mag, t), as_tuple=False).reshape(-1)
    count = count_at(thr)
    passes = 0
    while count < LOWER * k and passes < MAX_PASSES:
        thr = thr * LOWER
        count = count_at(thr)
        passes += 1
    info: dict[str, Any] = {"pre_fallback_count": count, "passes": passes, "k": k}
    if count > UPPER * k:
        idx = select_at(thr)
        idx = idx[torch.topk(a[idx].abs(), k, sorted=False).indices]
        info["path"] = "exact_among_selected"
    elif count < LOWER * k:
        idx = torch.topk(a.abs(), k, sorted=False).indices
        info["path"] = "fallback"
    else:
        idx = select_at(thr)
        info["path"] = "sampled"
    return idx, info


def optimizer_for(params: Iterable[Any], lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """The optimizer to pair with ``dgc``: plain SGD without momentum (the
    compressor applies momentum correction itself). Weight decay, if any, is
    added by SGD after the exchange."""
    return torch.optim.SGD(params, lr=lr, momentum=0.0, weight_decay=weight_decay)


@register
class DGC(QualityMixin, Compressor):
    name = "dgc"
    PARAMS = (
        ratio_param(0.001, "kept fraction (density) after warm-up"),
        Param("sample_ratio", float, 0.01, "0 < sample_ratio <= 1", lambda v: 0 < v <= 1, "fraction of |x| sampled for the threshold"),
        Param("momentum", float, 0.9, "0 <= momentum < 1", lambda v: 0 <= v < 1, "momentum m of the correction u <- m*u + g"),
        Param("clip", float, 0.0, "clip >= 0 (0 = off)", lambda v: v >= 0, "local gradient-norm clip: bounds the mean update; each unit's gradient to clip*sqrt(N) (Lin et al. Alg. 1)"),
        Param("warmup_epochs", int, 0, "warmup_epochs >= 0", lambda v: v >= 0, "epochs W of exponential ratio warm-up"),
        Param("steps_per_epoch", int, 0, "steps_per_epoch >= 0 (>= 1 when warmup_epochs > 0)", lambda v: v >= 0, "steps per epoch, for the warm-up"),
    )
    variable_size = True
    stateful = True
    state_dict_copies = True  # state_dict clones the buffers
    element_state = ("momentums", "velocities")
    values_index = 0
    summary = "Deep Gradient Compression (Lin et al. 2018): momentum correction, masking, sampled top-k, warm-up"
    own_error_memory = True
    int32_indices = True

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._meter = QualityMeter()
        self.momentums: dict[str, torch.Tensor] = {}
        self.velocities: dict[str, torch.Tensor] = {}
        self.last_info: dict[str, Any] = {}

    def _validate(self) -> None:
        if self.warmup_epochs > 0 and self.steps_per_epoch < 1:
            raise ValueError(
                f"compressor 'dgc': parameter 'steps_per_epoch' got {self.steps_per_epoch!r}; "
                "allowed: an integer >= 1 when warmup_epochs > 0"
            )

    def current_ratio(self, step: int) -> float:
        """Density at ``step`` (warm-up schedule)."""
        epoch = step // self.steps_per_epoch if self.steps_per_epoch > 0 else 0
        return warmup_ratio(self.ratio, self.warmup_epochs, epoch)

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        flat = x.reshape(-1)
        d = flat.numel()
        if d == 0:
            return empty_sparse_packet(x)
        wd = work_dtype(x.dtype)
        g = flat.to(wd)
        lo, hi = torch.aminmax(g)  # one read; NaN and +-inf propagate into the extremes
        finite = bool(torch.isfinite(lo) & torch.isfinite(hi))
        if self.clip > 0:
            # clip sqrt(U) per compressing unit: bounds the mean of the U packets (module docstring)
            max_norm = self.clip * ctx.loss_scale * math.sqrt(max(1, ctx.world_size))
            norm = row_norms(g.view(1, -1)).reshape(())  # no overflow/underflow of the squares
            if finite and bool(torch.isinf(norm)):  # the norm itself exceeds the dtype (so > max_norm):
                g = g * scale_pow2(torch.maximum(-lo, hi), wd)  # clip g / max|g| (exact power of two)
                coef = max_norm / row_norms(g.view(1, -1)).reshape(())
            else:
                coef = (max_norm / (norm + 1e-6 * ctx.loss_scale)).clamp(max=1.0)
            g = g * coef
        u = self.momentums.get(ctx.key)
        v = self.velocities.get(ctx.key)
        if u is None or v is None or u.shape != g.shape or u.device != g.device or u.dtype != g.dtype:
            u = self.momentums[ctx.key] = torch.zeros_like(g)
            v = self.velocities[ctx.key] = torch.zeros_like(g)
        if finite:  # the stored buffers are updated in place: no full-size temporaries
            acc = v.add_(u.mul_(self.momentum).add_(g))  # same rounding as m*u + g
        else:  # a non-finite gradient is sent as is and leaves u, v unchanged
            acc = g
        ratio = self.current_ratio(ctx.step)
        k = kept_count(d, ratio)
        period = x.shape[-1] if x.dim() >= 2 else 1
        idx, info = dgc_select(acc, k, ratio, self.sample_ratio, ctx.private_seed, period)
        values = acc[idx].to(x.dtype)
        if finite:  # momentum factor masking
            u.index_fill_(0, idx, 0.0)
            v.index_fill_(0, idx, 0.0)
        info["ratio"] = ratio
        info["quality"] = self._meter.update(idx.numel(), k)
        self.last_info = info
        return Packet([values, idx.to(torch.int32)], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        return scatter_sparse(packet.tensors[0], packet.tensors[1], packet.shape, packet.dtype)

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Expected payload at the final ratio: k values and k int32 indices."""
        return kept_count(numel, self.ratio) * (torch.empty(0, dtype=dtype).element_size() + 4)

    def gradient_state(self) -> list[torch.Tensor]:
        return [*self.momentums.values(), *self.velocities.values()]

    def state_nbytes(self) -> int:
        return tensor_bytes([self.momentums, self.velocities])  # the quality meter holds numbers

    def state_dict(self) -> dict[str, Any]:
        return {
            "momentums": {k: v.clone() for k, v in self.momentums.items()},
            "velocities": {k: v.clone() for k, v in self.velocities.items()},
            "quality": self._meter.state_dict(),
        }

    def live_state(self) -> dict[str, Any]:
        return {"momentums": dict(self.momentums), "velocities": dict(self.velocities),
                "quality": self._meter.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.momentums = {k: v.clone() for k, v in state.get("momentums", {}).items()}
        self.velocities = {k: v.clone() for k, v in state.get("velocities", {}).items()}
        self._meter.load_state_dict(state.get("quality", {}))
