"""MNIST-1D workloads (Greydanus, "Scaling down deep learning", 2020).

The data set is generated locally by the ``mnist1d`` package
(``make_dataset(get_dataset_args())``: 4000 train / 1000 test signals of 40
samples, 10 classes); nothing is downloaded. The published reference: a small
CNN reaches about 94% test accuracy, an MLP about 68%.

``mnist1d-cnn`` is the paper's CNN: three 1-D convolutions (25 channels,
kernels 5/3/3, stride 2, padding 1, ReLU) over the 40-sample signal, then a
linear layer from 25 x 5 features to 10 classes (about 5k parameters).
``mnist1d-mlp`` is the paper's MLP 40 -> 100 -> 100 -> 10.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

from gradpress.workloads.base import Workload, cached_arrays, mlp, positive_int, split_cap


def _generate() -> dict[str, np.ndarray]:
    from mnist1d.data import get_dataset_args, make_dataset

    # make_dataset seeds the global random/numpy generators: leave them as found
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        d = make_dataset(get_dataset_args())  # generates locally; get_dataset() would download
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    return {"x": d["x"].astype(np.float32), "y": d["y"].astype(np.int64),
            "x_test": d["x_test"].astype(np.float32), "y_test": d["y_test"].astype(np.int64)}


def load() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    from importlib.metadata import version

    # cache key without importing mnist1d.data (slow to import): the package
    # version and the generation arguments we use (the package defaults)
    a = cached_arrays("mnist1d", {"mnist1d": version("mnist1d"), "args": "get_dataset_args()"}, _generate)
    return ((torch.from_numpy(a["x"]), torch.from_numpy(a["y"])),
            (torch.from_numpy(a["x_test"]), torch.from_numpy(a["y_test"])))


class ConvNet1D(nn.Module):
    """The MNIST-1D paper's small CNN (input: batch x 40)."""

    def __init__(self, channels: int = 25, length: int = 40, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, 5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        n = length
        for k in (5, 3, 3):
            n = (n + 2 - k) // 2 + 1
        self.linear = nn.Linear(channels * n, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.unsqueeze(1)
        h = torch.relu(self.conv1(h))
        h = torch.relu(self.conv2(h))
        h = torch.relu(self.conv3(h))
        return self.linear(h.flatten(1))


def build_cnn(*, hidden: int | None = None, samples: int | None = None, **_: object) -> Workload:
    channels = 25 if hidden is None else positive_int("hidden", hidden)
    train, test = split_cap(*load(), samples)
    return Workload("mnist1d-cnn", ConvNet1D(channels), train, test, info={"channels": channels})


def build_mlp(*, hidden: int | None = None, samples: int | None = None, **_: object) -> Workload:
    width = 100 if hidden is None else positive_int("hidden", hidden)
    train, test = split_cap(*load(), samples)
    return Workload("mnist1d-mlp", mlp([40, width, width, 10]), train, test, info={"hidden": width})
