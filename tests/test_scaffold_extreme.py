"""SCAFFOLD on finite but extreme gradients, 2 gloo workers, one launch:
mixed magnitudes from the dtype's smallest normal number up to 1e30 (1e4 in
float16) in one tensor, per rank different (non-IID), in float64, float32,
bfloat16 and float16 parameters. Against what the definitions say, computed
here in float64: every parameter, ``c`` and ``c_i`` stays finite, the
replicas and ``c`` are bit-identical on both ranks after each
synchronization, and with ``control=gradients`` (a constant gradient g_i per
rank: c_i = g_i, c = mean g_i, Karimireddy et al. 2020) each entry of ``c_i``
and ``c`` is within a few rounding errors of the dtype from its float64
value: nothing tiny is turned into zero, nothing large overflows."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import run_workers

import gradpress.algorithms as algorithms

WORLD = 2
LR = 1e-3
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def gradient(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s constant gradient: signed magnitudes spread over the
    dtype's normal range (up to 1e30, or 1e4 in float16), float64."""
    lo = max(torch.finfo(dtype).tiny / LR * 16, 1e-300)  # lr * g stays a normal number of the dtype
    hi = 1e4 if dtype == torch.float16 else 1e30
    mags = torch.logspace(math.log10(lo), math.log10(hi), 24, dtype=torch.float64)
    signs = torch.tensor([(-1.0) ** (i + rank) for i in range(24)], dtype=torch.float64)
    return mags * signs * (1.0 + 0.25 * rank)


class Linear(torch.nn.Module):
    """loss = <g_rank, p>: the gradient is g_rank wherever p is."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.ones(24, dtype=dtype))


def _worker(rank: int, world: int) -> dict:
    out: dict = {}
    for name, dtype in DTYPES.items():
        for control in ("gradients", "displacement"):
            model = Linear(dtype)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            algo = algorithms.create(f"scaffold:period=2,control={control}", model, opt)
            g = gradient(rank, dtype).to(dtype)
            synced = []
            for _ in range(6):
                opt.zero_grad()
                (model.p * g).sum().backward()
                algo.step()
                if algo.since == 0:
                    synced.append({"p": model.p.detach().clone(), "c": algo.c[0].clone(),
                                   "ci": algo.c_local[0].clone()})
            out[f"{name}/{control}"] = synced
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


@pytest.mark.parametrize("control", ["gradients", "displacement"])
@pytest.mark.parametrize("name", list(DTYPES))
def test_finite_and_identical_replicas_on_extreme_gradients(results: list[dict], name: str, control: str) -> None:
    runs = [res[f"{name}/{control}"] for res in results]
    assert len(runs[0]) == 3
    for n, (a, b) in enumerate(zip(*runs)):
        for key in ("p", "c", "ci"):
            assert torch.isfinite(a[key]).all() and torch.isfinite(b[key]).all(), f"{name} {control} sync {n} {key}"
        assert torch.equal(a["p"], b["p"]) and torch.equal(a["c"], b["c"]), f"{name} {control} sync {n}: replicas"


@pytest.mark.parametrize("name", list(DTYPES))
def test_control_variates_are_the_gradients_to_rounding(results: list[dict], name: str) -> None:
    dtype = DTYPES[name]
    eps = torch.finfo(dtype).eps
    g = [gradient(r, dtype).to(dtype).double() for r in range(WORLD)]  # the gradient as the dtype holds it
    mean = sum(g) / WORLD
    for rank, res in enumerate(results):
        for n, s in enumerate(res[f"{name}/gradients"]):
            for got, want, what in ((s["ci"], g[rank], "c_i"), (s["c"], mean, "c")):
                rel = ((got.double() - want).abs() / want.abs()).max().item()
                assert rel <= 8 * eps, f"{name} rank {rank} sync {n} {what}: relative error {rel:.3g} > 8 eps"
