"""Leader SGD, SGP and 1-bit Adam with the models users bring
(tests/test_algorithms_models.py's ``Zoo``: BatchNorm, a tied weight, a frozen
layer, a never-used layer, a layer rank 1 uses at even steps only), on 2 gloo
workers, one spawn, about 5 s; split out of tests/test_algorithms_models.py,
which keeps local SGD, post-local SGD, DiLoCo and Streaming DiLoCo.

Every check compares with a reference computed here from the definitions in
float64, from what each worker recorded (gradients, the parameters right after
the inner optimizer's step, losses): LSGD's pull toward the leader (and
``average=true``), SGP's two-worker average, uncompressed 1-bit Adam as Adam
on DDP's gradient with the variance frozen; compressed 1-bit Adam keeps the
replicas bit-identical. Frozen and unused parameters never move, the tied one
is exchanged once, buffers averaged or local as documented, dtypes kept,
resume through ``torch.load(weights_only=True)`` bit-identical."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_workers
from test_algorithms_models import (
    BF16,
    F64,
    FLOAT_BUFFERS,
    TRAINABLE,
    WORLD,
    _check_common,
    _close,
    _ddp_grad,
    _equal_ranks,
    _mean,
    _scenario,
    _trainable_bytes,
)

SCENARIOS: dict[str, dict[str, Any]] = {
    "lsgd": {"spec": "lsgd:tau=2,c=0.5", "steps": 5, "resume_at": 3},
    "lsgd_average": {"spec": "lsgd:tau=2,c=0.5,average=true", "steps": 5, "resume_at": 3},
    "sgp": {"spec": "sgp"},
    "sgp_topk": {"spec": "sgp", "compressor": "topk:ratio=0.5", "min_numel": 1},
    "onebit": {"spec": "onebit_adam:freeze_step=3", "compressor": "none", "kind": "adam", "steps": 5,
               "resume_at": 4},
    "onebit_compressed": {"spec": "onebit_adam:freeze_step=2", "min_numel": 1, "kind": "adam", "steps": 5,
                          "resume_at": 3},
    "sgp_mixed": {"spec": "sgp", "dtype": torch.float32, "head": BF16},
    "onebit_bf16": {"spec": "onebit_adam:freeze_step=2", "compressor": "none", "kind": "adam", "dtype": BF16,
                    "steps": 4},

}


def _worker(rank: int, world: int) -> dict:
    return {name: _scenario(rank, **cfg) for name, cfg in SCENARIOS.items()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_frozen_unused_tied_buffers_dtypes_and_resume(results: list[dict], name: str) -> None:
    cfg = SCENARIOS[name]
    _check_common(results, name, cfg.get("steps", 4))


@pytest.mark.parametrize("name", ["lsgd", "lsgd_average"])
def test_lsgd_pull_toward_the_leader(results: list[dict], name: str) -> None:
    """Every 2 steps the rank with the lower mean loss leads; the pull moves
    the trainable parameters only (``average``: every rank to 0.5 * mean + 0.5
    * leader, bit-identical); buffers stay each rank's own."""
    r0, r1 = (r[name] for r in results)
    c = 0.5
    for t, (a, b) in enumerate(zip(r0["steps"], r1["steps"])):
        for res in (a, b):
            for n in FLOAT_BUFFERS:
                assert torch.equal(res["buffers"][n], res["local_buffers"][n]), (name, t, n)
        if (t + 1) % 2:
            for res in (a, b):
                _equal_ranks(res["after"], res["local"], TRAINABLE, (name, t))
            continue
        losses = [sum(r[name]["steps"][s]["loss"] for s in (t - 1, t)) / 2 for r in results]
        leader = (a, b)[min(range(WORLD), key=lambda r: (losses[r], r))]
        if name == "lsgd_average":
            _equal_ranks(a["after"], b["after"], TRAINABLE, (name, t))
        for res in (a, b):
            for n in TRAINABLE:
                base = _mean([a["local"][n], b["local"][n]]) if name == "lsgd_average" else res["local"][n].double()
                _close(res["after"][n], (1 - c) * base + c * leader["local"][n].double(), (name, t, n))


@pytest.mark.parametrize("name", ["sgp", "sgp_mixed"])
def test_sgp_on_two_workers_averages_every_step(results: list[dict], name: str) -> None:
    """Two workers, one peer: each round every worker keeps half of (x, w)
    and sends half, so z = (x_0 + x_1) / 2 on both; buffers stay local; the
    bytes are the trainable parameters once plus the 8-byte weight."""
    r0, r1 = (r[name] for r in results)
    for t, (a, b) in enumerate(zip(r0["steps"], r1["steps"])):
        for n in TRAINABLE:
            want = _mean([a["local"][n], b["local"][n]])
            _close(a["after"][n], want, (name, t, n))
            _close(b["after"][n], want, (name, t, n))
        for res in (a, b):
            for n in FLOAT_BUFFERS:
                assert torch.equal(res["buffers"][n], res["local_buffers"][n]), (name, t, n)
        assert a["bytes"] == _trainable_bytes(r0["init"]) + 8, (name, t, a["bytes"])


@pytest.mark.parametrize("name,freeze", [("onebit", 3), ("onebit_bf16", 2)])
def test_onebit_adam_is_adam_on_the_ddp_gradient(results: list[dict], name: str, freeze: int) -> None:
    """Uncompressed 1-bit Adam: Adam (torch's bias correction, per-parameter
    counts) on DDP's gradient (a parameter no rank has a gradient for is not
    stepped), the variance frozen after ``freeze`` steps; replicas
    bit-identical; BatchNorm statistics stay each rank's own."""
    r0, r1 = (r[name] for r in results)
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 0.01
    p = {n: r0["init"][n].double() for n in TRAINABLE}
    m = {n: torch.zeros_like(p[n]) for n in TRAINABLE}
    v = {n: torch.zeros_like(p[n]) for n in TRAINABLE}
    steps = dict.fromkeys(TRAINABLE, 0)
    vsteps = dict.fromkeys(TRAINABLE, 0)
    for t, (a, b) in enumerate(zip(r0["steps"], r1["steps"])):
        _equal_ranks(a["after"], b["after"], TRAINABLE, (name, t))
        for n in TRAINABLE:
            g = _ddp_grad([a, b], n)
            if g is None:
                assert torch.equal(a["after"][n].double(), p[n]), (name, t, n)
                continue
            steps[n] += 1
            m[n] = b1 * m[n] + (1 - b1) * g
            if t < freeze:
                v[n] = b2 * v[n] + (1 - b2) * g * g
                vsteps[n] += 1
            denom = (v[n] / (1 - b2 ** vsteps[n])).sqrt() + eps
            update = lr / (1 - b1 ** steps[n]) * m[n] / denom
            extra = 0.0 if a["after"][n].dtype == F64 else 0.05 * float(update.abs().max())
            _close(a["after"][n], p[n] - update, (name, t, n), extra=extra)
            p[n] = a["after"][n].double()
        assert any(not torch.equal(a["buffers"][n], b["buffers"][n]) for n in FLOAT_BUFFERS)


def test_compressed_onebit_adam_keeps_replicas_identical(results: list[dict]) -> None:
    r0, r1 = (r["onebit_compressed"] for r in results)
    for t, (a, b) in enumerate(zip(r0["steps"], r1["steps"])):
        _equal_ranks(a["after"], b["after"], TRAINABLE, ("onebit_compressed", t))
