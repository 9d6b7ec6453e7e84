"""Parameter declarations shared by several compressors."""

from __future__ import annotations

from gradpress.compress.base import Param

__all__ = ["ratio_param"]


def _valid_ratio(value: float) -> bool:
    return 0 < value <= 1


def ratio_param(default: float, doc: str = "kept fraction (density)") -> Param:
    """The float ``ratio`` in (0, 1] of the sparsifiers (kept or target density)."""
    return Param("ratio", float, default, "0 < ratio <= 1", _valid_ratio, doc)
