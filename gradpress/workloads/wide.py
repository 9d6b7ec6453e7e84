"""Synthetic communication-heavy workload: a wide MLP on random data.

Inputs are standard normal vectors of dimension 256; labels come from a fixed
random linear teacher (argmax over 10 classes), so the task is learnable and
accuracy is meaningful. The network is 256 -> h -> h -> 10 with h chosen so
the parameter count is close to ``params`` (h^2 + 268 h + 10 ~ params).
What matters here is the size of the gradients, not the data.
"""

from __future__ import annotations

import math
import re

import torch

from gradpress.workloads.base import Workload, mlp, positive_int

IN_DIM = 256
CLASSES = 10
DEFAULT_PARAMS = 2_000_000

_SUFFIX = {"": 1, "K": 1_000, "M": 1_000_000, "G": 1_000_000_000}


def parse_count(value: int | str, field: str = "params") -> int:
    """``"10M"`` -> 10_000_000; suffixes K, M, G (case-insensitive); plain integers too."""
    if isinstance(value, bool):
        raise ValueError(f"{field} must be a count like 500K or 10M, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", str(value))
        if not m:
            raise ValueError(f"{field} must be a count like 500K, 10M or 250000 (suffixes K, M, G), got {value!r}")
        n = round(float(m.group(1)) * _SUFFIX[m.group(2).upper()])  # not int(): 1.005 * 1000 is 1004.99...
    if n < 1000:
        raise ValueError(f"{field} must be at least 1K, got {value!r}")
    return n


def width_for(params: int) -> int:
    """Hidden width h whose 256 -> h -> h -> 10 MLP has about ``params`` parameters."""
    b = IN_DIM + 1 + 1 + CLASSES  # linear terms: weights in, two biases, weights out
    return max(1, round((-b + math.sqrt(b * b + 4 * (params - CLASSES))) / 2))


def build(*, params: int | str | None = None, samples: int | None = None, **_: object) -> Workload:
    target = DEFAULT_PARAMS if params is None else parse_count(params)
    n_train = 4096 if samples is None else positive_int("samples", samples)
    n_test = max(n_train // 4, 1)
    h = width_for(target)
    g = torch.Generator().manual_seed(1234)  # data do not depend on the run seed
    teacher = torch.randn(IN_DIM, CLASSES, generator=g)
    x = torch.randn(n_train + n_test, IN_DIM, generator=g)
    y = (x @ teacher).argmax(dim=1)
    model = mlp([IN_DIM, h, h, CLASSES])
    count = sum(p.numel() for p in model.parameters())
    return Workload("wide-mlp", model, (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:]),
                    info={"hidden": h, "params": count})
