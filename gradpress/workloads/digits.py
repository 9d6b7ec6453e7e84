"""scikit-learn's bundled handwritten digits (8 x 8 images, 1797 samples,
10 classes; ships with the package, no download): an MLP 64 -> 128 -> 10.
Split 80/20 with a fixed permutation; pixels scaled to [0, 1]."""

from __future__ import annotations

import numpy as np
import torch

from gradpress.workloads.base import Workload, mlp, positive_int, split_cap


def load() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    order = np.random.RandomState(0).permutation(len(y))
    x, y = x[order], y[order]
    cut = int(0.8 * len(y))
    return ((torch.from_numpy(x[:cut]), torch.from_numpy(y[:cut])),
            (torch.from_numpy(x[cut:]), torch.from_numpy(y[cut:])))


def build(*, hidden: int | None = None, samples: int | None = None, **_: object) -> Workload:
    width = 128 if hidden is None else positive_int("hidden", hidden)
    train, test = split_cap(*load(), samples)
    return Workload("digits-mlp", mlp([64, width, 10]), train, test, info={"hidden": width})
