"""Shared code of the threshold sparsifiers (``sidco``, ``dgc_threshold``,
``redsync``, ``gaussiank``, and the selection step of ``dgc``).

Every threshold method only differs in how it *estimates* the threshold; the
selection, the packet and the quality bookkeeping are the same, so that the
methods can be compared on equal terms (as in Abdelmoniem et al. 2021, SIDCo,
section 5, which compares estimators by the achieved/target density ratio).

* :func:`select_above`: keep ``|x| >= thr`` (and never exact zeros; NaN is
  always kept so a bad gradient stays visible to the caller); returns
  ``values`` (input dtype) and ``int32`` flat indices.
* :class:`QualityMeter`: per-call achieved/target density and its running mean.
* :class:`ThresholdSparsifier`: base class; a subclass implements
  ``_threshold(a, k, ctx)`` returning a 0-d tensor threshold on ``a = |x|``.
  A subclass that sets ``guarded = True`` and has a ``correction`` parameter
  gets the density correction of :mod:`gradpress.compress._density` around
  its estimate when ``correction=adaptive``: a per-key scale learned from
  the previous calls and an in-call search when the count misses
  ``[0.8 k, 1.25 k]`` (``last_passes`` counts its extra counting passes).
  An estimate that overflows the work dtype (a threshold above its max, on
  data near the max) is computed again on the data times 2^-16 (exact), so
  the correction starts from a finite estimate, as at any other scale.

Packet: ``[values (input dtype), indices (int32)]``, variable size
(``variable_size=True``), ``values_index=0`` so a quantizer can follow
(``sidco:ratio=0.001>natural``). Biased, so error feedback is on by default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from gradpress.compress._density import ThresholdScale, in_band, refine
from gradpress.compress.base import Compressor, Context, Packet
from gradpress.compress.sparse import kept_count, scatter_sparse

__all__ = ["BlockMax", "QualityMeter", "ThresholdSparsifier", "select_above", "empty_sparse_packet", "use_blocks", "work_dtype"]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def select_mask(a: torch.Tensor, thr: torch.Tensor | float) -> torch.Tensor:
    """Boolean mask of the selected entries of ``a = |x|``: ``a >= thr`` and
    ``a > 0``, plus every NaN."""
    # not (a < max(thr, smallest positive)): a >= thr, a > 0, and NaN (NaN < t is False)
    tiny = torch.finfo(a.dtype).smallest_normal * torch.finfo(a.dtype).eps  # smallest subnormal
    t = torch.clamp(thr, min=tiny) if isinstance(thr, torch.Tensor) else max(thr, tiny)
    return torch.lt(a, t).logical_not_()


def select_above(flat: torch.Tensor, a: torch.Tensor | None, thr: torch.Tensor | float,
                 blocks: BlockMax | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, int32 indices)`` of the entries of ``flat`` with ``|flat| >= thr``
    (``a`` is ``|flat|`` in the work dtype, or None when ``blocks`` is given)."""
    if blocks is not None:
        idx = blocks.select(thr)
    else:
        idx = torch.nonzero(select_mask(a, thr), as_tuple=False).reshape(-1)
    return flat[idx], idx.to(torch.int32)


#: factor on data whose threshold estimate overflowed (a power of two: exact; room for a threshold 2^16 times
#: the data's max, far above any estimator's |mu| + z sigma or fitted tail at densities >= 2^-31)
RESCUE = 2.0 ** -16


class BlockMax:
    """Selection at small densities without a full-size mask.

    ``x`` (flat, work dtype) is viewed as rows of ``BLOCK`` entries and the
    per-row max of |x| is taken once (two fused reductions, no full-size
    temporary). A selection at threshold t then only touches the rows whose
    max reaches t (about ``BLOCK * density`` of them): it gathers them and
    builds the mask there. Same entries, same (increasing) order as
    ``nonzero(select_mask(|x|, t))``; NaN rows always qualify (NaN
    propagates into the row max).
    """

    BLOCK = 64

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        d = x.numel()
        self.full = d // self.BLOCK * self.BLOCK
        self.rows = x[: self.full].view(-1, self.BLOCK)
        self.row_max = torch.maximum(self.rows.amax(dim=1), self.rows.amin(dim=1).neg_())
        self.tail = x[self.full :]

    def select(self, thr: torch.Tensor | float) -> torch.Tensor:
        """int64 flat indices of the entries with |x| >= thr, |x| > 0, or NaN."""
        cand = torch.nonzero(select_mask(self.row_max, thr)).reshape(-1)
        rows = self.rows.index_select(0, cand).abs_()
        hit = torch.nonzero(select_mask(rows, thr))
        idx = cand[hit[:, 0]] * self.BLOCK + hit[:, 1]
        if self.tail.numel():
            idx = torch.cat([idx, self.full + torch.nonzero(select_mask(self.tail.abs(), thr)).reshape(-1)])
        return idx

    def abs_max(self) -> torch.Tensor:
        """max |x| (NaN if any entry is NaN), from the row maxima."""
        parts = [self.row_max.amax()] if self.row_max.numel() else []
        if self.tail.numel():
            parts.append(self.tail.abs().amax())
        return torch.stack(parts).amax()

    def count(self, thr: torch.Tensor | float) -> int:
        """Number of entries :meth:`select` would return (one host read)."""
        cand = torch.nonzero(select_mask(self.row_max, thr)).reshape(-1)
        n = torch.count_nonzero(select_mask(self.rows.index_select(0, cand).abs_(), thr))
        if self.tail.numel():
            n = n + torch.count_nonzero(select_mask(self.tail.abs(), thr))
        return int(n)


def use_blocks(ratio: float) -> bool:
    """Block selection pays off when few rows hold a selected entry."""
    return ratio * BlockMax.BLOCK <= 0.25


def empty_sparse_packet(x: torch.Tensor) -> Packet:
    """Packet of an empty input: no values, no indices."""
    return Packet(
        [torch.empty(0, dtype=x.dtype, device=x.device), torch.empty(0, dtype=torch.int32, device=x.device)],
        x.shape,
        x.dtype,
    )


class QualityMeter:
    """Achieved density / target density per call and its running mean
    (SIDCo's estimation-quality metric; 1.0 is perfect)."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = 1.0
        self.last = 1.0

    def update(self, achieved: int, target: int) -> float:
        q = achieved / target if target > 0 else 1.0
        self.count += 1
        self.mean += (q - self.mean) / self.count
        self.last = q
        return q

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean, "last": self.last}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.count = int(state.get("count", 0))
        self.mean = float(state.get("mean", 1.0))
        self.last = float(state.get("last", 1.0))


class QualityMixin:
    """``quality`` (running mean), ``last_quality`` and the meter in state."""

    _meter: QualityMeter

    @property
    def quality(self) -> float:
        """Running mean of achieved/target density over all calls."""
        return self._meter.mean

    @property
    def last_quality(self) -> float:
        """Achieved/target density of the last call."""
        return self._meter.last

    @property
    def quality_calls(self) -> int:
        return self._meter.count


class ThresholdSparsifier(QualityMixin, Compressor):
    """Keep ``|x| >= threshold``; subclasses estimate the threshold."""

    variable_size = True
    values_index = 0
    exact_values = True
    int32_indices = True
    unbiased = False
    state_dict_copies = True  # numbers in fresh containers (a subclass with its own state_dict declares its own)
    #: whether ``_threshold`` reads ``a = |x|`` (else it gets None and no
    #: full-size |x| is made)
    needs_abs = True
    #: whether ``correction=adaptive`` wraps ``_threshold`` in the density
    #: correction of :mod:`gradpress.compress._density` (the subclass
    #: declares the ``correction`` parameter)
    guarded = False

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._meter = QualityMeter()
        self._scale = ThresholdScale()
        #: counting passes the density correction spent on the last call
        self.last_passes = 0

    #: the :class:`BlockMax` of the current call (None without blocks), for
    #: counting passes in ``_threshold`` without a full-size mask
    _blocks: BlockMax | None = None

    @property
    def corrected(self) -> bool:
        """Whether the density correction runs (``correction=adaptive``)."""
        return self.guarded and getattr(self, "correction", "none") == "adaptive"

    def _count(self, a: torch.Tensor | None, thr: torch.Tensor | float) -> int:
        """Entries the selection at ``thr`` keeps (one host read)."""
        if a is None or self._blocks is not None:
            assert self._blocks is not None
            return self._blocks.count(thr)
        return int(torch.count_nonzero(select_mask(a, thr)))  # bool .sum() would widen to int64

    def _threshold(self, xw: torch.Tensor, a: torch.Tensor | None, k: int, ctx: Context) -> torch.Tensor:
        """Threshold (0-d tensor) on ``a = |xw|``; ``xw`` is the flat input in
        the work dtype, ``k`` the target count; ``a`` is None when the class
        sets ``needs_abs = False`` and the selection runs on blocks."""
        raise NotImplementedError

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        flat = x.reshape(-1)
        d = flat.numel()
        if d == 0:
            return empty_sparse_packet(x)
        xw = flat.to(work_dtype(x.dtype))
        k = kept_count(d, self.ratio)
        blocks = BlockMax(xw) if use_blocks(self.ratio) and k < d else None
        a = xw.abs() if blocks is None or self.needs_abs else None
        self.last_passes = 0
        if k >= d:  # keep everything (tiny tensors)
            thr = torch.zeros((), dtype=xw.dtype, device=xw.device)
            values, idx = select_above(flat, a, thr, blocks)
        else:
            self._blocks = blocks
            try:
                estimate = self._threshold(xw, a, k, ctx)
                if self.corrected:
                    values, idx = self._corrected_select(flat, xw, a, blocks, estimate, k, ctx)
                else:
                    values, idx = select_above(flat, a, estimate, blocks)
            finally:
                self._blocks = None
        self._meter.update(idx.numel(), k)
        return Packet([values, idx], x.shape, x.dtype)

    def _rescaled(self, xw: torch.Tensor, a: torch.Tensor | None, blocks: BlockMax | None, k: int,
                  ctx: Context) -> tuple[torch.Tensor, torch.Tensor | None, BlockMax | None, torch.Tensor] | None:
        """The work tensors and the estimate for the data times ``RESCUE``,
        for an estimate that overflowed the work dtype (a threshold above its
        max: data near the max, e.g. ``gaussiank``'s ``|mu| + z sigma``).
        The estimators are scale equivariant and the scale is a power of two
        (exact), so the density correction then starts from a finite
        estimate, and its per-key scale learns as on the data at any other
        scale, instead of searching again from max |x| on every call.
        Selection indices come from the scaled copy, values from the input.
        None when the scaled estimate is still not finite (non-finite data):
        the correction's restart from max |x| handles that."""
        xs = xw * RESCUE
        blocks_s = BlockMax(xs) if blocks is not None else None
        a_s = xs.abs() if a is not None else None
        self._blocks = blocks_s
        estimate_s = self._threshold(xs, a_s, k, ctx)
        if math.isfinite(float(estimate_s)):
            return xs, a_s, blocks_s, estimate_s
        self._blocks = blocks
        return None

    def _corrected_select(self, flat: torch.Tensor, xw: torch.Tensor, a: torch.Tensor | None,
                          blocks: BlockMax | None, estimate: torch.Tensor, k: int,
                          ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        """Selection at ``scale[key] * estimate``, searched again when its
        count misses the band; the scale learns from the threshold kept.
        An estimate that overflowed (:meth:`_rescaled`) is caught only off
        the band (an infinite threshold keeps nothing but NaN), so the
        normal path reads nothing before its selection."""
        key = ctx.key
        thr = estimate * self._scale.get(key)
        values, idx = select_above(flat, a, thr, blocks)
        slope = None
        if not in_band(idx.numel(), k) and not math.isfinite(float(estimate)):  # rare: data near the dtype's max
            rescued = self._rescaled(xw, a, blocks, k, ctx)
            if rescued is not None:
                xw, a, blocks, estimate = rescued
                thr = estimate * self._scale.get(key)
                values, idx = select_above(flat, a, thr, blocks)
        if not in_band(idx.numel(), k):

            def top() -> torch.Tensor:
                if blocks is not None:
                    return blocks.abs_max()
                return a.max() if a is not None else xw.abs().max()

            found, _, spent, slope = refine(lambda t: self._count(a, t), thr, idx.numel(), k, top)
            self.last_passes = spent
            if found is not thr:
                thr = found
                values, idx = select_above(flat, a, thr, blocks)
        self._scale.learn(key, estimate, thr, idx.numel(), k, slope)
        return values, idx

    def decode(self, packet: Packet) -> torch.Tensor:
        values, indices = packet.tensors[0], packet.tensors[1]
        return scatter_sparse(values, indices, packet.shape, packet.dtype)

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Expected payload: k values and k int32 indices."""
        k = kept_count(numel, self.ratio)
        return k * (torch.empty(0, dtype=dtype).element_size() + 4)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"quality": self._meter.state_dict()}
        if self.guarded:
            state["correction"] = self._scale.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._meter.load_state_dict(state.get("quality", {}))
        self._scale.load_state_dict(state.get("correction", {}))
