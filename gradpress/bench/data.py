"""Inputs for the compressor benchmark.

* ``gaussian``: i.i.d. N(0, 1).
* ``laplace``: i.i.d. Laplace(0, 1) (heavier tails, closer to real gradients).
* ``captured``: real gradients, captured in-process from the first steps of a
  small MLP (64-512-512-10, ReLU; torch's initialization under
  ``manual_seed(seed)``) trained on scikit-learn's bundled ``digits`` data
  (nothing is downloaded; pixels scaled to [0, 1]) in batches of 128 with SGD,
  momentum 0.9 and learning rate 0.05, every parameter's gradient of every
  step concatenated, then tiled to the requested size. Tiling keeps the value
  distribution (and its spread across layers and steps) of real gradients.

Invariant: ``make_input(kind, numel, device, seed)`` is deterministic for a
given ``(kind, numel, seed)`` on one machine, so a test can rebuild exactly
the tensor a benchmark row was measured on.
"""

from __future__ import annotations

import math

import torch

__all__ = ["DATA_KINDS", "make_input", "captured_gradients", "matrix_shape"]

DATA_KINDS = ("gaussian", "laplace", "captured")

_CAPTURED: dict[tuple[int, int], torch.Tensor] = {}


def captured_gradients(steps: int = 8, seed: int = 0) -> torch.Tensor:
    """Flat fp32 CPU tensor: the gradients of ``steps`` SGD steps of a small
    MLP on scikit-learn's ``digits`` (about 300K values per step)."""
    key = (steps, seed)
    if key in _CAPTURED:
        return _CAPTURED[key]
    from sklearn.datasets import load_digits

    digits = load_digits()
    xs = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    ys = torch.tensor(digits.target, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 512), torch.nn.ReLU(),
            torch.nn.Linear(512, 512), torch.nn.ReLU(),
            torch.nn.Linear(512, 10),
        )
    params = list(model.parameters())
    velocity = [torch.zeros_like(p) for p in params]
    grads = []
    for _ in range(steps):
        batch = torch.randint(0, xs.shape[0], (128,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(xs[batch]), ys[batch])
        step_grads = torch.autograd.grad(loss, params)
        grads.append(torch.cat([g.reshape(-1) for g in step_grads]))
        with torch.no_grad():  # SGD with momentum 0.9, lr 0.05 (no torch.optim: it is slow to import)
            for p, v, g in zip(params, velocity, step_grads):
                v.mul_(0.9).add_(g)
                p.sub_(0.05 * v)
    flat = torch.cat(grads)
    _CAPTURED[key] = flat
    return flat


def make_input(kind: str, numel: int, device: str | torch.device = "cpu", seed: int = 0) -> torch.Tensor:
    """A flat fp32 tensor of ``numel`` elements of data ``kind`` on ``device``."""
    if kind not in DATA_KINDS:
        raise ValueError(f"--data got {kind!r}; allowed: {', '.join(DATA_KINDS)}")
    if numel <= 0:
        raise ValueError(f"numel got {numel}; allowed: a positive integer")
    gen = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        x = torch.randn(numel, generator=gen)
    elif kind == "laplace":
        # inverse CDF: -sign(u) * ln(1 - 2|u|), u ~ U(-1/2, 1/2)
        u = torch.rand(numel, generator=gen) - 0.5
        x = -torch.sign(u) * torch.log1p(-2.0 * u.abs().clamp(max=0.5 - 1e-7))
    else:
        base = captured_gradients(seed=seed)
        reps = math.ceil(numel / base.numel())
        x = base.repeat(reps)[:numel].clone() if reps > 1 else base[:numel].clone()
    return x.to(device)


def matrix_shape(numel: int, max_cols: int = 1024) -> tuple[int, int]:
    """``(rows, cols)`` with ``rows * cols == numel`` and ``cols`` the largest
    divisor of ``numel`` that is at most ``max_cols`` (the matrix view used for
    low-rank methods such as PowerSGD)."""
    for cols in range(min(max_cols, numel), 0, -1):
        if numel % cols == 0:
            return numel // cols, cols
    return numel, 1
