"""The remaining algorithms with the models users bring (tests/test_algorithms_models.py's
``Zoo``: BatchNorm, a tied weight, a frozen layer, a never-used layer, a
layer rank 1 uses at even steps only), one spawn of 4 gloo workers (the
graphs need 4: a ring of 4 is not the complete graph): CHOCO-SGD, D-PSGD
(ring and exponential), Comprex (synchronous with the user's optimizer,
stale with re-broadcast, the look-ahead Comprex optimizer), LGC (its three
phases, ring and ps) and 0/1 Adam, in float64, bfloat16 and float32 with
bfloat16 layers.

Every check compares with a float64 reference computed here from the
algorithm's formula (module docstrings, docs/gossip.md, docs/comprex.md,
docs/lgc.md, docs/compressed-adam.md) and what each worker recorded (its
gradients, its parameters right after the inner optimizer step, its
buffers); frozen and never-used parameters never move, ``num_batches_tracked``
stays int64, resume through ``weights_only=True`` is bit-identical
(``_check_common``, imported)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from distributed import run_workers
from references import kept, topk_indices
from test_algorithms_models import (
    BF16,
    F64,
    FLOAT_BUFFERS,
    LR,
    TRAINABLE,
    Zoo,
    _check_common,
    _close,
    _ddp_grad,
    _equal_ranks,
    _mean,
    _scenario,
    _sgd_step,
    _trainable_bytes,
)

import gradpress.algorithms as algorithms

WORLD = 4
F32 = torch.float32
ZEROONE = "zeroone_adam:var_freeze_step=3,var_update_scaler=1,local_step_scaler=1,local_step_clipper=2"

SCENARIOS: dict[str, dict[str, Any]] = {
    # gossip
    "choco_exact": {"spec": "choco:gamma=1", "compressor": "none"},
    "choco_half": {"spec": "choco:gamma=0.5,topology=complete", "compressor": "none", "kind": "momentum"},
    "choco_sign": {"spec": "choco", "min_numel": 1},
    "choco_mixed": {"spec": "choco", "min_numel": 1, "dtype": F32, "head": BF16},
    "dpsgd_ring": {"spec": "dpsgd", "kind": "momentum"},
    "dpsgd_exp_bf16": {"spec": "dpsgd:topology=exponential", "dtype": BF16},
    # comprex
    "comprex_ddp": {"spec": "comprex:staleness=0,update=optimizer,clip=0", "compressor": "none", "kind": "momentum"},
    "comprex_ddp_bf16": {"spec": "comprex:staleness=0,update=optimizer,clip=0", "compressor": "none",
                         "dtype": BF16},
    "comprex_stale": {"spec": "comprex:staleness=1,update=optimizer,clip=0,rebroadcast_every=2",
                      "compressor": "none", "kind": "momentum", "steps": 5, "resume_at": 3},
    "comprex_lookahead": {"spec": "comprex:staleness=1", "compressor": "none", "steps": 5, "resume_at": 3},
    "comprex_topk_mixed": {"spec": "comprex:staleness=1,lookahead=off", "compressor": "topk:ratio=0.25",
                           "min_numel": 1, "dtype": F32, "head": BF16, "steps": 5, "resume_at": 3},
    # lgc: steps 0-1 dense, 2 top-k (the autoencoder trains), 3-4 latents
    "lgc_ring": {"spec": "lgc:dense_steps=2,ae_steps=1,ratio=0.2,master=1", "kind": "momentum", "steps": 5,
                 "resume_at": 3},
    "lgc_ps": {"spec": "lgc:dense_steps=1,ae_steps=1,ratio=0.2,variant=ps,innovation=0.05", "kind": "momentum",
               "steps": 4, "resume_at": 3},
    "lgc_bf16": {"spec": "lgc:dense_steps=1,ae_steps=1,ratio=0.2", "dtype": BF16, "steps": 4, "resume_at": 3},
    # 0/1 Adam: variance updates at t = 1, 2; t = 3 compressed; local steps after, synchronized at t = 4, 6
    "zeroone": {"spec": ZEROONE, "compressor": "none", "kind": "adam", "steps": 7, "resume_at": 5},
    "zeroone_bf16": {"spec": ZEROONE, "kind": "adam", "min_numel": 1, "dtype": BF16, "steps": 7, "resume_at": 5},
}


def _refusal(spec: str, **kw: Any) -> str:
    model = Zoo(F32, BF16)
    try:
        algorithms.create(spec, model, torch.optim.SGD(model.parameters(), lr=LR), **kw).close()
    except ValueError as exc:
        return str(exc)
    return "accepted"


def _worker(rank: int, world: int) -> dict:
    out: dict[str, Any] = {name: _scenario(rank, **cfg) for name, cfg in SCENARIOS.items()}
    out["refuse_lgc_mixed"] = _refusal("lgc")
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


# ------------------------------------------------------------------ helpers
def _w(kind: str) -> torch.Tensor:
    """The mixing matrix on 4 nodes by its definition: uniform 1/(deg + 1)
    over a node and its neighbours (ring: r +- 1; exponential: r +- 1, r +- 2,
    which on 4 nodes is every node)."""
    w = torch.zeros(WORLD, WORLD, dtype=F64)
    for i in range(WORLD):
        peers = {(i + 1) % WORLD, (i - 1) % WORLD} if kind == "ring" else set(range(WORLD)) - {i}
        for j in [i, *peers]:
            w[i, j] = 1.0 / (len(peers) + 1)
    return w


def _runs(results: list[dict], name: str) -> list[list[dict]]:
    """Per rank, the recorded steps of ``name``."""
    return [r[name]["steps"] for r in results]


def _ranks_at(runs: list[list[dict]], t: int) -> list[dict]:
    return [run[t] for run in runs]


def _lowtol(dtype: torch.dtype, ref: torch.Tensor, ulps: float = 4) -> float:
    """``ulps`` of ``dtype`` at the largest |ref| (absolute)."""
    return 0.0 if dtype == F64 else ulps * torch.finfo(dtype).eps * float(ref.abs().max().clamp_min(1e-30))


def _check_local_sgd_steps(results: list[dict], name: str, momentum: bool) -> None:
    """Each rank's own optimizer step from its previous parameters: torch's
    SGD by its definition (a None gradient: not stepped, no momentum)."""
    for run, res in zip(_runs(results, name), (r[name] for r in results)):
        prev = {n: res["init"][n].double() for n in TRAINABLE}
        buf: dict[str, torch.Tensor | None] = dict.fromkeys(TRAINABLE)
        for t, st in enumerate(run):
            for n in TRAINABLE:
                want, buf[n] = _sgd_step(prev[n], st["grads"][n], buf[n], momentum)
                _close(st["local"][n], want, (name, t, n, "local step"))
                prev[n] = st["after"][n].double()


# ----------------------------------------------------------- every scenario
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_frozen_unused_tied_buffers_dtypes_and_resume(results: list[dict], name: str) -> None:
    _check_common(results, name, SCENARIOS[name].get("steps", 4))


# ------------------------------------------------------------------ gossip
@pytest.mark.parametrize("name,kind,gamma", [("choco_exact", "ring", 1.0), ("choco_half", "complete", 0.5)])
def test_choco_exact_gossip_by_its_formula(results: list[dict], name: str, kind: str, gamma: float) -> None:
    """Identity Q: x_i <- x_i + gamma (sum_j w_ij x_j - x_i) after the local
    step (gamma = 1: D-PSGD adapt-then-combine); the tied weight is one
    tensor; each rank sends the trainable parameters once to each
    neighbour; BatchNorm statistics stay each rank's own."""
    runs, w = _runs(results, name), _w(kind)
    _check_local_sgd_steps(results, name, momentum=SCENARIOS[name].get("kind") == "momentum")
    neighbours = int((w[0] > 0).sum()) - 1
    for t in range(len(runs[0])):
        at = _ranks_at(runs, t)
        for i, st in enumerate(at):
            for n in TRAINABLE:
                local = st["local"][n].double()
                mixed = sum(w[i, j] * at[j]["local"][n].double() for j in range(WORLD))
                _close(st["after"][n], local + gamma * (mixed - local), (name, t, i, n), ulps=16)
            _equal_ranks(st["buffers"], st["local_buffers"], FLOAT_BUFFERS, (name, t, i))
            assert st["bytes"] == neighbours * _trainable_bytes(st["after"]), (name, t, st["bytes"])


@pytest.mark.parametrize("name", ["choco_sign", "choco_mixed"])
def test_choco_compressed_gossip_keeps_the_average(results: list[dict], name: str) -> None:
    """Scaled sign: the average over nodes of x moves only by the optimizer
    steps (W doubly stochastic, the public copies the same on both ends)."""
    runs = _runs(results, name)
    if name == "choco_sign":
        _check_local_sgd_steps(results, name, momentum=False)
    for t in range(len(runs[0])):
        at = _ranks_at(runs, t)
        for n in TRAINABLE:
            want = _mean([st["local"][n] for st in at])
            got = _mean([st["after"][n] for st in at])
            dtype = at[0]["after"][n].dtype
            assert (got - want).abs().max() <= 1e-12 + _lowtol(dtype, want, 8), (name, t, n)
        for st in at:
            _equal_ranks(st["buffers"], st["local_buffers"], FLOAT_BUFFERS, (name, t))


@pytest.mark.parametrize("name,kind", [("dpsgd_ring", "ring"), ("dpsgd_exp_bf16", "exponential")])
def test_dpsgd_by_its_formula(results: list[dict], name: str, kind: str) -> None:
    """x_i <- sum_j w_ij x_j + (the local optimizer step from x_i): combine,
    then adapt; exact parameters; each rank sends the trainable parameters
    once to each neighbour."""
    runs, w = _runs(results, name), _w(kind)
    if kind == "ring":
        _check_local_sgd_steps(results, name, momentum=True)
    prev = [{n: r[name]["init"][n].double() for n in TRAINABLE} for r in results]
    neighbours = int((w[0] > 0).sum()) - 1
    for t in range(len(runs[0])):
        at = _ranks_at(runs, t)
        for i, st in enumerate(at):
            for n in TRAINABLE:
                step = st["local"][n].double() - prev[i][n]
                want = sum(w[i, j] * prev[j][n] for j in range(WORLD)) + step
                dtype = st["after"][n].dtype
                extra = 0.0 if dtype == F64 else 8 * torch.finfo(dtype).eps * float(want.abs().max())
                _close(st["after"][n], want, (name, t, i, n), ulps=16, extra=extra)
            _equal_ranks(st["buffers"], st["local_buffers"], FLOAT_BUFFERS, (name, t, i))
            assert st["bytes"] == neighbours * _trainable_bytes(st["after"]), (name, t, st["bytes"])
        prev = [{n: st["after"][n].double() for n in TRAINABLE} for st in at]


# ----------------------------------------------------------------- comprex
@pytest.mark.parametrize("name", ["comprex_ddp", "comprex_ddp_bf16"])
def test_comprex_synchronous_with_the_optimizer_is_ddp(results: list[dict], name: str) -> None:
    """staleness=0, update=optimizer, clip=0: DDP's step, by its
    definition: the mean gradient (zeros where a rank has none) into the
    user's SGD; a parameter no rank has a gradient for is not stepped (no
    momentum, no weight decay); replicas bit-identical; BatchNorm
    statistics stay local (no re-broadcast); the bytes are the gradients
    once plus one presence flag per parameter."""
    runs = _runs(results, name)
    momentum = SCENARIOS[name].get("kind") == "momentum"
    p = {n: results[0][name]["init"][n].double() for n in TRAINABLE}
    buf: dict[str, torch.Tensor | None] = dict.fromkeys(TRAINABLE)
    for t in range(len(runs[0])):
        at = _ranks_at(runs, t)
        for st in at[1:]:
            _equal_ranks(at[0]["after"], st["after"], TRAINABLE, (name, t))
        for n in TRAINABLE:
            p[n], buf[n] = _sgd_step(p[n], _ddp_grad(at, n), buf[n], momentum)
            _close(at[0]["after"][n], p[n], (name, t, n), ulps=8)
            p[n] = at[0]["after"][n].double()
        for st in at:
            _equal_ranks(st["buffers"], st["local_buffers"], FLOAT_BUFFERS, (name, t))
        flags = at[0]["after"][TRAINABLE[0]].element_size() * len(TRAINABLE)
        assert at[0]["bytes"] == _trainable_bytes(at[0]["after"]) + flags, (name, t, at[0]["bytes"])


def test_comprex_stale_update_with_rebroadcast(results: list[dict]) -> None:
    """staleness=1, update=optimizer: step t applies DDP's gradient of step
    t - 1 (nothing at step 0; DDP's rule for missing gradients, as above);
    every 2 steps rank 0's buffers are broadcast (BatchNorm statistics
    bit-identical on every rank then, each rank's own otherwise)."""
    name = "comprex_stale"
    runs = _runs(results, name)
    p = {n: results[0][name]["init"][n].double() for n in TRAINABLE}
    buf: dict[str, torch.Tensor | None] = dict.fromkeys(TRAINABLE)
    for t in range(len(runs[0])):
        at = _ranks_at(runs, t)
        for st in at[1:]:
            _equal_ranks(at[0]["after"], st["after"], TRAINABLE, (name, t))
        if t:
            before = _ranks_at(runs, t - 1)
            for n in TRAINABLE:
                p[n], buf[n] = _sgd_step(p[n], _ddp_grad(before, n), buf[n], momentum=True)
        for n in TRAINABLE:
            _close(at[0]["after"][n], p[n], (name, t, n), ulps=8)
            p[n] = at[0]["after"][n].double()
        if (t + 1) % 2 == 0:
            for st in at[1:]:
                _equal_ranks(at[0]["buffers"], st["buffers"], FLOAT_BUFFERS, (name, t))
        else:
            assert not torch.equal(at[0]["buffers"]["bn.running_mean"], at[1]["buffers"]["bn.running_mean"])


def test_comprex_optimizer_with_lookahead_by_its_formula(results: list[dict]) -> None:
    """The Comprex optimizer, staleness 1, look-ahead (on by default),
    identity compressor: per rank g <- clip(g, 5) over the whole gradient (a
    missing gradient is a zero one), m_r <- 0.9 m_r + lr g; the shared x
    takes x <- x - mean_r m_r(t - 1) at step t; the model holds rank r's
    prediction x - m_r(t) between steps."""
    name = "comprex_lookahead"
    runs = _runs(results, name)
    x = {n: results[0][name]["init"][n].double() for n in TRAINABLE}
    m = [{n: torch.zeros_like(x[n]) for n in TRAINABLE} for _ in range(WORLD)]
    flight: list[dict[str, torch.Tensor]] | None = None
    for t in range(len(runs[0])):
        at = _ranks_at(runs, t)
        sent = []
        for r, st in enumerate(at):
            g = {n: st["grads"][n].double() if st["grads"][n] is not None else torch.zeros_like(x[n])
                 for n in TRAINABLE}
            norm = math.sqrt(sum(float(v.pow(2).sum()) for v in g.values()))
            coef = min(1.0, 5.0 / (norm + 1e-6))
            m[r] = {n: 0.9 * m[r][n] + LR * coef * g[n] for n in TRAINABLE}
            sent.append(m[r])
        if flight is not None:
            x = {n: x[n] - _mean([s[n] for s in flight]) for n in TRAINABLE}
        flight = sent
        for r, st in enumerate(at):
            for n in TRAINABLE:
                _close(st["after"][n], x[n] - m[r][n], (name, t, r, n), ulps=16)


def test_comprex_compressed_stale_keeps_the_shared_weights_identical(results: list[dict]) -> None:
    runs = _runs(results, "comprex_topk_mixed")
    for t in range(len(runs[0])):
        at = _ranks_at(runs, t)
        for st in at[1:]:
            _equal_ranks(at[0]["after"], st["after"], TRAINABLE, ("comprex_topk_mixed", t))


# --------------------------------------------------------------------- lgc
def test_lgc_phases_by_their_formula(results: list[dict]) -> None:
    """Phase 1 (steps 0, 1): DDP's step. Phase 2 (step 2, leader rank 1):
    per tensor the ceil(0.2 numel) entries of the leader's largest |g|, the
    mean of every rank's values there, zero elsewhere, into the user's SGD
    (momentum, weight decay). Phase 3 (steps 3, 4): replicas bit-identical.
    In every phase a parameter no rank has a gradient for is not stepped
    (DDP's rule: ``extra`` at odd steps keeps its value, its momentum
    unapplied). BatchNorm statistics: the mean of the ranks' at every step."""
    name = "lgc_ring"
    runs = _runs(results, name)
    p = {n: results[0][name]["init"][n].double() for n in TRAINABLE}
    buf: dict[str, torch.Tensor | None] = dict.fromkeys(TRAINABLE)
    for t in range(len(runs[0])):
        at = _ranks_at(runs, t)
        for st in at[1:]:
            _equal_ranks(at[0]["after"], st["after"], TRAINABLE, (name, t))
            _equal_ranks(at[0]["buffers"], st["buffers"], FLOAT_BUFFERS, (name, t))
        for n in FLOAT_BUFFERS:
            _close(at[0]["buffers"][n], _mean([st["local_buffers"][n] for st in at]), (name, t, n))
        for n in TRAINABLE:
            some = any(st["grads"][n] is not None for st in at)
            if not some:
                assert torch.equal(at[0]["after"][n].double(), p[n]), (name, t, n, "no gradient: not stepped")
            if t == 2:
                g = _ddp_grad(at, n)
                if g is not None:
                    lead = at[1]["grads"][n]
                    lead = lead.double().reshape(-1) if lead is not None else torch.zeros(g.numel(), dtype=F64)
                    idx = topk_indices(lead, kept(lead.numel(), 0.2))
                    sparse = torch.zeros(g.numel(), dtype=F64)
                    sparse[idx] = g.reshape(-1)[idx]
                    g = sparse.view_as(g)
            if t < 3:
                p[n], buf[n] = _sgd_step(p[n], _ddp_grad(at, n) if t < 2 else g, buf[n], momentum=True)
                _close(at[0]["after"][n], p[n], (name, t, n))
            p[n] = at[0]["after"][n].double()


@pytest.mark.parametrize("name", ["lgc_ps", "lgc_bf16"])
def test_lgc_replicas_identical(results: list[dict], name: str) -> None:
    """ps (float64 values after an odd number of int32 indices: it failed
    there) and bfloat16: replicas and buffers bit-identical at every step."""
    runs = _runs(results, name)
    for t in range(len(runs[0])):
        at = _ranks_at(runs, t)
        for st in at[1:]:
            _equal_ranks(at[0]["after"], st["after"], TRAINABLE, (name, t))
            _equal_ranks(at[0]["buffers"], st["buffers"], FLOAT_BUFFERS, (name, t))


def test_lgc_refuses_two_dtypes_naming_them(results: list[dict]) -> None:
    for r in results:
        msg = r["refuse_lgc_mixed"]
        assert "one floating dtype" in msg and "torch.bfloat16" in msg and "torch.float32" in msg, msg


# --------------------------------------------------------------- 0/1 Adam
def test_zeroone_adam_by_its_formula(results: list[dict]) -> None:
    """Identity compressor, kappa = 1 (variance updates at t = 1, 2), frozen
    from t = 3, H = 1 then 2 (synchronizations at t = 4, 6). Variance phase:
    Adam on DDP's gradient (a parameter no rank has is not stepped), masked
    where v == 0 on the non-variance step. Local steps: each rank's Adam with
    its own m and the frozen v (its step count advances for every
    parameter); a synchronization averages u * denom (u = x - anchor) over the
    ranks, sets m = -bc1 mean / sum(lr) and every replica to anchor + mean /
    denom; a parameter no rank stepped since the last one is left alone."""
    name = "zeroone"
    runs = _runs(results, name)
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 0.01
    init = {n: results[0][name]["init"][n].double() for n in TRAINABLE}
    p = [dict(init) for _ in range(WORLD)]
    m = [{n: torch.zeros_like(init[n]) for n in TRAINABLE} for _ in range(WORLD)]
    v = {n: torch.zeros_like(init[n]) for n in TRAINABLE}
    steps, vsteps = dict.fromkeys(TRAINABLE, 0), dict.fromkeys(TRAINABLE, 0)
    anchor: dict[str, torch.Tensor] = {}
    lrs = dict.fromkeys(TRAINABLE, 0.0)
    stepped = dict.fromkeys(TRAINABLE, False)

    def denom(n: str) -> torch.Tensor:
        return (v[n] / (1 - b2 ** vsteps[n])).sqrt() + eps

    for t0 in range(len(runs[0])):
        t, at = t0 + 1, _ranks_at(runs, t0)
        if t <= 3:  # variance phase: every rank the same
            for n in TRAINABLE:
                g = _ddp_grad(at, n)
                if g is None:
                    continue
                if t in (1, 2):
                    v[n] = b2 * v[n] + (1 - b2) * g * g
                    vsteps[n] += 1
                else:
                    g = torch.where(v[n] == 0, torch.zeros_like(g), g)
                steps[n] += 1
                for r in range(WORLD):
                    m[r][n] = b1 * m[r][n] + (1 - b1) * g
                    p[r][n] = p[r][n] - lr / (1 - b1 ** steps[n]) * m[r][n] / denom(n)
        else:
            for n in TRAINABLE:
                steps[n] += 1
                lrs[n] += lr
                for r, st in enumerate(at):
                    g = st["grads"][n]
                    if g is None:
                        continue
                    stepped[n] = True
                    m[r][n] = b1 * m[r][n] + (1 - b1) * g.double()
                    p[r][n] = p[r][n] - lr / (1 - b1 ** steps[n]) * m[r][n] / denom(n)
            if t in (4, 6):
                for n in TRAINABLE:
                    if stepped[n]:
                        u = _mean([(p[r][n] - anchor[n]) * denom(n) for r in range(WORLD)])
                        u = torch.where(v[n] == 0, torch.zeros_like(u), u)
                        for r in range(WORLD):
                            m[r][n] = u * (-(1 - b1 ** steps[n]) / lrs[n])
                        anchor[n] = anchor[n] + u / denom(n)
                        for r in range(WORLD):
                            p[r][n] = anchor[n]
                    lrs[n], stepped[n] = 0.0, False
        for r, st in enumerate(at):
            for n in TRAINABLE:
                _close(st["after"][n], p[r][n], (name, t, r, n), ulps=64)
                p[r][n] = st["after"][n].double()
        if t in (3, 4, 6):  # synchronized: the replicas and the anchor of the next local steps
            for st in at[1:]:
                _equal_ranks(at[0]["after"], st["after"], TRAINABLE, (name, t))
            anchor = dict(p[0])


def test_zeroone_adam_compressed_replicas_identical_after_every_synchronized_step(results: list[dict]) -> None:
    runs = _runs(results, "zeroone_bf16")
    for t0 in range(len(runs[0])):
        if t0 + 1 in (5, 7):  # local steps between synchronizations
            continue
        at = _ranks_at(runs, t0)
        for st in at[1:]:
            _equal_ranks(at[0]["after"], st["after"], TRAINABLE, ("zeroone_bf16", t0 + 1))
        # BatchNorm statistics stay each rank's own
        assert not torch.equal(at[0]["buffers"]["bn.running_mean"], at[1]["buffers"]["bn.running_mean"])
