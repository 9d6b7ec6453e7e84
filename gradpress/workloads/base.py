"""What a training workload is: a model, a train and a test split held in
memory, a loss and a metric.

Invariant: building a workload is deterministic. The data depend only on the
workload's options (never on the rank), and the model's initial weights only
on the torch seed set by the caller, so every rank builds the same thing.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["Workload", "WorkloadSpec", "mlp", "classification_score", "cache_dir", "cached_arrays", "split_cap",
           "METRIC_RANGES", "metric_range"]

#: the values each workload metric can take, by its definition: ``accuracy`` is a fraction of the test samples
#: (correct / count, in [0, 1]); ``bits_per_char`` a mean cross-entropy in bits (>= 0, unbounded above)
METRIC_RANGES: dict[str, tuple[float, float]] = {"accuracy": (0.0, 1.0), "bits_per_char": (0.0, math.inf)}


def metric_range(metric: str) -> tuple[float, float]:
    """``(low, high)``: the range of the workload metric ``metric`` (:data:`METRIC_RANGES`); ValueError naming an
    unknown one."""
    if metric not in METRIC_RANGES:
        raise ValueError(f"metric {metric!r}: no known range; allowed: {', '.join(METRIC_RANGES)}")
    return METRIC_RANGES[metric]


def classification_score(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(number of correct predictions as a float64 tensor, number of samples)."""
    return (output.argmax(dim=-1) == target).sum().to(torch.float64), int(target.numel())


@dataclass
class Workload:
    """A ready-to-train workload.

    ``train`` and ``test`` are ``(inputs, targets)`` tensors on the CPU whose
    first dimension indexes samples. ``score(output, target)`` returns a
    (sum, count) pair; the metric is ``sum / count`` (all-reducible).
    """

    name: str
    model: nn.Module
    train: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]
    metric: str = "accuracy"
    higher_is_better: bool = True
    classifier: bool = True
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy
    score: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, int]] = classification_score
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkloadSpec:
    """Registry entry: a builder and the training defaults that suit it.
    ``tuned_steps``: the schedule length (steps) at which the defaults were
    tuned (docs/train.md); a run whose schedule is shorter is told how many
    epochs would reach it (more workers or a larger batch mean fewer steps per
    epoch)."""

    name: str
    build: Callable[..., Workload]
    defaults: dict[str, Any]
    doc: str
    tuned_steps: int | None = None
    #: the metric its :class:`Workload` reports (``accuracy``: a fraction in [0, 1])
    metric: str = "accuracy"
    #: whether its targets are one class label per sample (``--split`` by label needs them)
    labels: bool = True


def mlp(sizes: list[int]) -> nn.Sequential:
    """Fully connected ReLU network with the given layer widths."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def split_cap(train: tuple, test: tuple, samples: int | None) -> tuple[tuple, tuple]:
    """Keep the first ``samples`` training and ``max(samples // 4, 1)`` test
    samples (tiny runs for tests and smoke checks); no-op for None."""
    if samples is None:
        return train, test
    n_test = max(samples // 4, 1)
    return (train[0][:samples], train[1][:samples]), (test[0][:n_test], test[1][:n_test])


def cache_dir() -> Path:
    """Where generated data sets are cached: ``$GRADPRESS_CACHE`` or
    ``~/.cache/gradpress``."""
    root = os.environ.get("GRADPRESS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gradpress")
    return Path(root)


def cached_arrays(tag: str, key: dict[str, Any], make: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Return ``make()``, cached on disk under a hash of ``key``.

    The cache only saves time: a missing, truncated or otherwise unreadable
    cache file (any error while reading it, ``BadZipFile`` included) is
    removed and regenerated, and
    a failed write is ignored. Writes are atomic (temporary file + rename), so
    concurrent workers never read a half-written file.
    """
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = cache_dir() / f"{tag}-{digest}.npz"
    try:
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except FileNotFoundError:
        pass
    except Exception:  # noqa: BLE001 - truncated / damaged (BadZipFile, EOFError, CRC...): regenerate
        try:
            path.unlink()
        except OSError:
            pass
    arrays = make()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except OSError:
        pass
    return arrays


def positive_int(name: str, value: Any, allowed: str = "an integer >= 1") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return int(value)
