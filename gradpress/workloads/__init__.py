"""Built-in training workloads for ``gradpress train`` and ``compare``.

``names()`` lists them; ``build(name, **options)`` returns a
:class:`Workload` (model + in-memory data + loss + metric); ``defaults(name)``
gives the training settings (epochs, lr, batch size per worker, optimizer)
that suit it (epochs, lr, batch_size, optimizer, schedule). Options: ``hidden`` (width), ``samples`` (cap on training
samples; tests use tiny runs), ``params`` (wide-mlp size, ``"10M"``),
``data`` (data-mlp's ``.npz``), ``text_bytes`` (charlm-lstm corpus size).
"""

from __future__ import annotations

from typing import Any

from gradpress.compress.spec import spelled_as
from gradpress.workloads import charlm, charlm_transformer, digits, mnist1d, userdata, wide
from gradpress.workloads.base import METRIC_RANGES, Workload, WorkloadSpec, metric_range

__all__ = ["Workload", "WorkloadSpec", "METRIC_RANGES", "metric_range", "names", "get", "build", "defaults", "budget_note", "DEFAULT"]

DEFAULT = "mnist1d-cnn"

_SPECS: dict[str, WorkloadSpec] = {
    s.name: s
    for s in (
        WorkloadSpec("mnist1d-cnn", mnist1d.build_cnn,
                     {"epochs": 20, "lr": 0.1, "batch_size": 16, "optimizer": "momentum", "schedule": "cosine"},
                     "MNIST-1D, the paper's small CNN (metric: test accuracy; ~94% published)",
                     tuned_steps=1240),  # 20 epochs x 62 steps: 4 workers x batch 16 (docs/train.md)
        WorkloadSpec("mnist1d-mlp", mnist1d.build_mlp,
                     {"epochs": 12, "lr": 0.003, "batch_size": 32, "optimizer": "adam", "schedule": "cosine"},
                     "MNIST-1D, MLP 40-100-100-10 (~68% published)"),
        WorkloadSpec("digits-mlp", digits.build,
                     {"epochs": 10, "lr": 0.003, "batch_size": 32, "optimizer": "adam", "schedule": "cosine"},
                     "scikit-learn digits 8x8, MLP 64-128-10"),
        WorkloadSpec("charlm-lstm", charlm.build,
                     {"epochs": 3, "lr": 0.003, "batch_size": 32, "optimizer": "adam", "schedule": "cosine"},
                     "character LSTM on standard-library sources (metric: bits per character)", metric="bits_per_char",
                     labels=False),
        WorkloadSpec("charlm-transformer", charlm_transformer.build,
                     {"epochs": 5, "lr": 0.002, "batch_size": 16, "optimizer": "adam", "schedule": "cosine"},
                     "character transformer (2 blocks, 0.47M parameters) on standard-library sources, "
                     "where Adam matters (metric: bits per character)", metric="bits_per_char", labels=False),
        WorkloadSpec("wide-mlp", wide.build,
                     {"epochs": 1, "lr": 0.05, "batch_size": 64, "optimizer": "momentum", "schedule": "constant"},
                     "synthetic wide MLP, size set by --params (communication-heavy)"),
        WorkloadSpec("data-mlp", userdata.build,
                     {"epochs": 10, "lr": 0.003, "batch_size": 32, "optimizer": "adam", "schedule": "cosine"},
                     "MLP classifier on your own --data PATH.npz (x, y)"),
    )
}


def names() -> list[str]:
    """Names of the built-in workloads."""
    return list(_SPECS)


def get(name: str) -> WorkloadSpec:
    if name not in _SPECS:
        raise ValueError(f"unknown workload {name!r}{spelled_as(name, _SPECS)}; allowed: {', '.join(_SPECS)}")
    return _SPECS[name]


def defaults(name: str) -> dict[str, Any]:
    """Training defaults for ``name`` (epochs, lr, batch_size, optimizer)."""
    return dict(get(name).defaults)


def budget_note(name: str, epochs: int, steps_per_epoch: int) -> str | None:
    """A note when the schedule (``epochs`` x ``steps_per_epoch``) is shorter
    than the one ``name``'s defaults were tuned at, with the epochs that reach
    it; None otherwise (or when the workload states no tuned length)."""
    tuned = get(name).tuned_steps
    horizon = epochs * steps_per_epoch
    if tuned is None or horizon >= tuned or steps_per_epoch < 1:
        return None
    need = -(-tuned // steps_per_epoch)
    return (f"note: the schedule is {horizon} steps ({epochs} epochs x {steps_per_epoch} steps); {name}'s defaults "
            f"were tuned at {tuned} steps (docs/train.md): --epochs {need} gives {need * steps_per_epoch}")


def build(name: str, **options: Any) -> Workload:
    """Build workload ``name``; unknown names raise ValueError listing the allowed ones."""
    return get(name).build(**options)
