"""TensorBoard scalars of a gradpress run, one vocabulary for ``gradpress
train --tensorboard DIR`` and the framework integrations.

:func:`stats_scalars` turns a hook's or algorithm's ``stats`` into tagged
scalars (pure Python: no TensorBoard needed); :class:`EventWriter` writes
them with the training loss and metric into TensorBoard event files (needs
the ``tensorboard`` extra: ``pip install gradpress[tensorboard]``; imported
only when a writer is made, never at ``import gradpress``).

Tags (invariant: the same names everywhere, all under ``gradpress/``):
``gradpress/loss``, ``gradpress/metric``, and those of :data:`STATS_TAGS`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["STATS_TAGS", "LOSS_TAG", "METRIC_TAG", "stats_scalars", "EventWriter", "require_tensorboard"]

LOSS_TAG = "gradpress/loss"
METRIC_TAG = "gradpress/metric"
#: tag -> what it is; consensus distance only for decentralized algorithms (gossip), once measured
STATS_TAGS: dict[str, str] = {
    "gradpress/bytes_per_step": "bytes this rank handed to collectives in the last step",
    "gradpress/dense_bytes_per_step": "bytes plain DDP would have sent in the last step",
    "gradpress/compression_ratio": "dense bytes / bytes sent, all steps so far",
    "gradpress/compress_s": "seconds in error feedback, encoding and decoding, all steps so far",
    "gradpress/comm_s": "seconds inside collectives, all steps so far",
    "gradpress/consensus_distance": "mean_i ||x_i - x_bar|| / ||x_bar|| (gossip algorithms, at the last evaluation)",
}


def stats_scalars(stats: Mapping[str, Any], bytes_per_step: float | None = None) -> dict[str, float]:
    """The scalars of ``stats`` (``STATS_KEYS`` vocabulary) by tag.
    ``bytes_per_step``: use this figure (e.g. a window's mean) instead of the
    last step's. Missing or non-finite values are left out."""
    values = {
        "gradpress/bytes_per_step": stats.get("last_step_bytes") if bytes_per_step is None else bytes_per_step,
        "gradpress/dense_bytes_per_step": stats.get("last_step_dense_bytes"),
        "gradpress/compression_ratio": stats.get("ratio"),
        "gradpress/compress_s": stats.get("compress_s"),
        "gradpress/comm_s": stats.get("comm_s"),
        "gradpress/consensus_distance": stats.get("consensus_distance"),
    }
    out = {}
    for tag, value in values.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[tag] = float(value)
    return out


def require_tensorboard(what: str = "--tensorboard") -> None:
    """Raise ``ValueError`` naming the extra when TensorBoard is not installed."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ValueError(f"{what} needs TensorBoard: pip install 'gradpress[tensorboard]'") from None


class EventWriter:
    """TensorBoard event files in ``logdir`` (created). Write on one rank only.
    ``purge_step``: a resumed run's first step; TensorBoard drops the events
    at and after it that the interrupted run wrote past its checkpoint."""

    def __init__(self, logdir: str | Path, purge_step: int | None = None) -> None:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(logdir), purge_step=purge_step)

    def write(self, step: int, *, stats: Mapping[str, Any], loss: float | None = None, metric: float | None = None,
              bytes_per_step: float | None = None) -> None:
        scalars = stats_scalars(stats, bytes_per_step)
        if loss is not None and math.isfinite(loss):
            scalars[LOSS_TAG] = loss
        if metric is not None and math.isfinite(metric):
            scalars[METRIC_TAG] = metric
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
