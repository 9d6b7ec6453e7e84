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

from gradpress.workloads import charlm, charlm_transformer, digits, mnist1d, userdata, wide
from gradpress.workloads.base import Workload, WorkloadSpec

__all__ = ["Workload", "WorkloadSpec", "names", "get", "build", "defaults", "DEFAULT"]

DEFAULT = "mnist1d-cnn"

_SPECS: dict[str, WorkloadSpec] = {
    s.name: s
    for s in (
        WorkloadSpec("mnist1d-cnn", mnist1d.build_cnn,
                     {"epochs": 20, "lr": 0.1, "batch_size": 16, "optimizer": "momentum", "schedule": "cosine"},
                     "MNIST-1D, the paper's small CNN (metric: test accuracy; ~94% published)"),
        WorkloadSpec("mnist1d-mlp", mnist1d.build_mlp,
                     {"epochs": 12, "lr": 0.003, "batch_size": 32, "optimizer": "adam", "schedule": "cosine"},
                     "MNIST-1D, MLP 40-100-100-10 (~68% published)"),
        WorkloadSpec("digits-mlp", digits.build,
                     {"epochs": 10, "lr": 0.003, "batch_size": 32, "optimizer": "adam", "schedule": "cosine"},
                     "scikit-learn digits 8x8, MLP 64-128-10"),
        WorkloadSpec("charlm-lstm", charlm.build,
                     {"epochs": 3, "lr": 0.003, "batch_size": 32, "optimizer": "adam", "schedule": "cosine"},
                     "character LSTM on standard-library sources (metric: bits per character)"),
        WorkloadSpec("charlm-transformer", charlm_transformer.build,
                     {"epochs": 5, "lr": 0.002, "batch_size": 16, "optimizer": "adam", "schedule": "cosine"},
                     "character transformer (2 blocks, 0.47M parameters) on standard-library sources, "
                     "where Adam matters (metric: bits per character)"),
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
        raise ValueError(f"unknown workload {name!r}; allowed: {', '.join(_SPECS)}")
    return _SPECS[name]


def defaults(name: str) -> dict[str, Any]:
    """Training defaults for ``name`` (epochs, lr, batch_size, optimizer)."""
    return dict(get(name).defaults)


def build(name: str, **options: Any) -> Workload:
    """Build workload ``name``; unknown names raise ValueError listing the allowed ones."""
    return get(name).build(**options)
