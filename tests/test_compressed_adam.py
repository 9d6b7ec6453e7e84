"""1-bit Adam and 0/1 Adam against float64 references the test computes
itself from the papers' formulas (Tang et al. 2021; Lu et al. 2022), on 2
gloo workers: exact distributed Adam without compression or freeze, frozen
variance, the compressed allreduce with worker- and server-side error
feedback, identical replicas, bit-identical resume."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from distributed import checkpoint, restore, run_workers, value_errors
from test_algorithms import batch, make_model, mse_grads_at

import gradpress.algorithms as algorithms

WORLD = 2
LR = 0.01
BETAS = (0.9, 0.999)
EPS = 1e-8
ONEBIT_CHUNK = 64  # 1-bit Adam's default scale chunk (docs/results/compressed-adam-charlm-transformer.md)


def grads_at(params: list[torch.Tensor], rank: int, step: int) -> list[torch.Tensor]:
    return mse_grads_at(params, *batch(rank, step))


def flat(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def reference_adam(steps: int, v_steps: list[bool], wd: float = 0.0, decoupled: bool = False) -> list[torch.Tensor]:
    """Adam on the exactly averaged gradient, float64, by its formula;
    ``v_steps[t]``: whether step t+1 updates the variance (else it stays,
    with its bias correction). Returns the flat parameters after each step."""
    params = [p.detach().clone() for p in make_model().parameters()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    s, out = 0, []
    b1, b2 = BETAS
    for t in range(1, steps + 1):
        per_rank = [grads_at(params, r, t - 1) for r in range(WORLD)]
        s += int(v_steps[t - 1])
        for i, p in enumerate(params):
            g = sum(gr[i] for gr in per_rank) / WORLD
            if wd and not decoupled:
                g = g + wd * p
            m[i] = b1 * m[i] + (1 - b1) * g
            if v_steps[t - 1]:
                v[i] = b2 * v[i] + (1 - b2) * g * g
            if wd and decoupled:
                p *= 1 - LR * wd
            p -= LR / (1 - b1 ** t) * m[i] / ((v[i] / (1 - b2 ** s)).sqrt() + EPS)
        out.append(flat(params))
    return out


def _zeroone_local_phase(params: list[torch.Tensor], m: list[torch.Tensor], denom: list[torch.Tensor],
                         out: list[list[torch.Tensor]], freeze: int, steps: int, scaler: int, clipper: int,
                         average: Callable[[int, list[torch.Tensor]], torch.Tensor]) -> list[list[torch.Tensor]]:
    """0/1 Adam's local phase after the freeze, float64: each worker steps
    its own momentum with the frozen ``denom``; when ``t % H == 0`` the
    changes since the anchor times ``denom`` are averaged by ``average(i,
    changes)``, every momentum becomes ``-mean (1 - b1^t) / sum(lr)`` and
    every replica ``anchor + mean / denom``; H doubles every ``scaler``
    local steps up to ``clipper``. Appends each rank's flat parameters
    after each step to ``out`` and returns it."""
    b1 = BETAS[0]
    anchor = [p.clone() for p in params]
    local = [[p.clone() for p in params] for _ in range(WORLD)]
    moms = [[mi.clone() for mi in m] for _ in range(WORLD)]
    interval, counter, lrs = 1, 0, 0.0
    for t in range(freeze + 1, steps + 1):
        for r in range(WORLD):
            g = grads_at(local[r], r, t - 1)
            for i in range(len(params)):
                moms[r][i] = b1 * moms[r][i] + (1 - b1) * g[i]
                local[r][i] = local[r][i] - LR / (1 - b1 ** t) * moms[r][i] / denom[i]
        lrs += LR
        if t % interval == 0:
            for i in range(len(params)):
                mean = average(i, [(local[r][i] - anchor[i]) * denom[i] for r in range(WORLD)])
                anchor[i] = anchor[i] + mean / denom[i]
                for r in range(WORLD):
                    moms[r][i] = -mean * (1 - b1 ** t) / lrs
                    local[r][i] = anchor[i].clone()
            lrs = 0.0
        counter += 1
        if counter == scaler:
            counter, interval = 0, min(clipper, interval * 2)
        for r in range(WORLD):
            out[r].append(flat(local[r]))
    return out


#: 0/1 Adam: exact Adam for 3 steps, then local steps synchronized every H = 1, 2, 2, ... steps
ZO_LOCAL = "zeroone_adam:var_update_scaler=1000,var_freeze_step=3,local_step_scaler=1,local_step_clipper=2"


def reference_zeroone_local(steps: int, freeze: int, scaler: int, clipper: int) -> list[list[torch.Tensor]]:
    """0/1 Adam (Lu et al. 2022) with an identity compressor, float64: exact
    Adam (variance updated every step) for ``freeze`` steps, then local steps:
    each worker updates its own momentum with its own gradient and steps with
    the frozen variance; when ``t % H == 0`` the workers average their change
    since the last synchronization times the denominator, every momentum
    becomes ``-mean (1 - b1^t) / sum(lr)`` (the momentum that change implies)
    and every replica ``anchor + mean / denom``; ``H`` doubles every
    ``scaler`` local steps up to ``clipper``. Returns each rank's flat
    parameters after each step."""
    b1, b2 = BETAS
    params = [p.detach().clone() for p in make_model().parameters()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    out: list[list[torch.Tensor]] = [[] for _ in range(WORLD)]
    for t in range(1, freeze + 1):  # the variance phase: every step is a variance step
        per_rank = [grads_at(params, r, t - 1) for r in range(WORLD)]
        for i, p in enumerate(params):
            g = sum(gr[i] for gr in per_rank) / WORLD
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            p -= LR / (1 - b1 ** t) * m[i] / ((v[i] / (1 - b2 ** t)).sqrt() + EPS)
        for r in range(WORLD):
            out[r].append(flat(params))
    denom = [(vi / (1 - b2 ** freeze)).sqrt() + EPS for vi in v]
    return _zeroone_local_phase(params, m, denom, out, freeze, steps, scaler, clipper,
                                lambda i, xs: sum(xs) / WORLD)


def scaled_sign(x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """efsignsgd by definition: mean|x_k| * sign(x_k) over each run x_k of
    ``chunk`` consecutive entries of the flat x (0: the whole x), sign(0) = +1."""
    step = chunk or max(x.numel(), 1)
    return torch.cat([c.abs().mean() * torch.where(c >= 0, 1.0, -1.0).to(x.dtype) for c in x.split(step)])


def reference_onebit(steps: int, freeze: int, min_numel: int, chunk: int = 0) -> list[torch.Tensor]:
    """1-bit Adam (Tang et al. 2021, Algorithm 1) with DeepSpeed's compressed
    allreduce, float64: each worker adds its residual to its momentum, sends
    the scaled sign of each of the N partitions (one scale per ``chunk``
    entries of a partition; 0: per partition); the owner of a partition
    averages the N decoded partitions, adds its own residual and sends the
    scaled sign of that; residuals keep what each compression dropped."""
    params = [p.detach().clone() for p in make_model().parameters()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    werr = [[torch.zeros(p.numel(), dtype=p.dtype) for p in params] for _ in range(WORLD)]
    serr = [[torch.zeros(p.numel(), dtype=p.dtype) for p in params] for _ in range(WORLD)]
    b1, b2 = BETAS
    out = []
    for t in range(1, steps + 1):
        per_rank = [grads_at(params, r, t - 1) for r in range(WORLD)]
        for i, p in enumerate(params):
            if t <= freeze:
                g = sum(gr[i] for gr in per_rank) / WORLD
                m[i] = b1 * m[i] + (1 - b1) * g
                v[i] = b2 * v[i] + (1 - b2) * g * g
            elif p.dim() < 2 or p.numel() < min_numel:  # travels plain
                m[i] = sum(b1 * m[i] + (1 - b1) * gr[i] for gr in per_rank) / WORLD
            else:
                local = [(b1 * m[i] + (1 - b1) * gr[i]).reshape(-1) + werr[r][i] for r, gr in enumerate(per_rank)]
                chunks_sent = [[scaled_sign(c, chunk) for c in torch.tensor_split(x, WORLD)] for x in local]
                for r in range(WORLD):
                    werr[r][i] = local[r] - torch.cat(chunks_sent[r])
                result = []
                for k in range(WORLD):
                    owner_err = torch.tensor_split(serr[k][i], WORLD)[k]
                    s = sum(chunks_sent[r][k] for r in range(WORLD)) / WORLD + owner_err
                    c = scaled_sign(s, chunk)
                    torch.tensor_split(serr[k][i], WORLD)[k].copy_(s - c)
                    result.append(c)
                m[i] = torch.cat(result).reshape(p.shape)
            s_v = min(t, freeze)
            p -= LR / (1 - b1 ** t) * m[i] / ((v[i] / (1 - b2 ** s_v)).sqrt() + EPS)
        out.append(flat(params))
    return out


def compressed_average(xs: list[torch.Tensor], werr: list[torch.Tensor], serr: list[torch.Tensor],
                       chunk: int = 0) -> torch.Tensor:
    """DeepSpeed's compressed allreduce of one flat tensor per rank, float64:
    worker r adds its residual ``werr[r]`` and sends the scaled sign of each of
    the N partitions; the owner k of partition k averages the N decoded
    partitions, adds its residual (partition k of ``serr[k]``) and sends the
    scaled sign of that. Both residuals are updated in place with what each
    compression dropped; returns the flat result every rank decodes."""
    n = len(xs)
    local = [x + e for x, e in zip(xs, werr)]
    sent = [[scaled_sign(c, chunk) for c in torch.tensor_split(x, n)] for x in local]
    for r in range(n):
        werr[r].copy_(local[r] - torch.cat(sent[r]))
    result = []
    for k in range(n):
        owned = torch.tensor_split(serr[k], n)[k]
        s = sum(sent[r][k] for r in range(n)) / n + owned
        c = scaled_sign(s, chunk)
        owned.copy_(s - c)
        result.append(c)
    return torch.cat(result)


def reference_zeroone_compressed(steps: int, freeze: int, kappa: int, scaler: int, clipper: int,
                                 min_numel: int) -> list[list[torch.Tensor]]:
    """0/1 Adam (Lu et al. 2022) with its default compressor (scaled sign,
    one scale per partition) through DeepSpeed's compressed allreduce,
    float64. Variance phase (t <= ``freeze``): v is updated on the steps
    where t % I == 0 (I = 1, doubling after every ``kappa`` such updates)
    with the exactly averaged gradient; on the other steps the gradient
    goes through the compressed allreduce with both residuals (2-D tensors
    of at least ``min_numel`` entries; the others are averaged plain), is
    zeroed where v == 0, and only m is updated. At the freeze both residuals
    are cleared (they held gradient errors; they will hold update errors).
    Local phase: every worker steps its own m with the frozen variance; when
    t % H == 0 the changes since the anchor times the denominator go through
    the compressed allreduce, m becomes ``-mean (1 - b1^t) / sum(lr)`` and
    every replica ``anchor + mean / denom``; H doubles every ``scaler``
    local steps up to ``clipper``. Returns each rank's flat parameters
    after each step."""
    b1, b2 = BETAS
    params = [p.detach().clone() for p in make_model().parameters()]
    compressed = [p.dim() >= 2 and p.numel() >= min_numel for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    werr = [[torch.zeros(p.numel(), dtype=p.dtype) for _ in range(WORLD)] for p in params]
    serr = [[torch.zeros(p.numel(), dtype=p.dtype) for _ in range(WORLD)] for p in params]

    def average(i: int, xs: list[torch.Tensor]) -> torch.Tensor:
        if not compressed[i]:
            return sum(xs) / WORLD
        flat_xs = [x.reshape(-1) for x in xs]
        return compressed_average(flat_xs, werr[i], serr[i]).reshape(xs[0].shape)

    out: list[list[torch.Tensor]] = [[] for _ in range(WORLD)]
    interval, updates, s = 1, 0, 0
    for t in range(1, freeze + 1):
        per_rank = [grads_at(params, r, t - 1) for r in range(WORLD)]
        exact = t % interval == 0
        if exact:
            s += 1
            updates += 1
            if updates == kappa:
                updates, interval = 0, interval * 2
        for i, p in enumerate(params):
            if exact:
                g = sum(gr[i] for gr in per_rank) / WORLD
                v[i] = b2 * v[i] + (1 - b2) * g * g
            else:
                g = torch.where(v[i] == 0, 0.0, average(i, [gr[i] for gr in per_rank]))
            m[i] = b1 * m[i] + (1 - b1) * g
            p -= LR / (1 - b1 ** t) * m[i] / ((v[i] / (1 - b2 ** s)).sqrt() + EPS)
        for r in range(WORLD):
            out[r].append(flat(params))
    for i in range(len(params)):  # the freeze clears both residuals
        for e in (*werr[i], *serr[i]):
            e.zero_()
    denom = [(vi / (1 - b2 ** s)).sqrt() + EPS for vi in v]
    return _zeroone_local_phase(params, m, denom, out, freeze, steps, scaler, clipper,
                                lambda i, xs: torch.where(v[i] == 0, 0.0, average(i, xs)))


#: 0/1 Adam compressed: variance steps 1, 2, 4 (kappa 1), compressed gradients at 3 and 5, the freeze after
#: step 5, local steps synchronized (compressed) at 6 and 8 (H = 1, then 2)
ZO_COMPRESSED = ("zeroone_adam:var_update_scaler=1,var_freeze_step=5,local_step_scaler=1,local_step_clipper=2", 8)


def _run(rank: int, spec: str, compressor: str | None, steps: int, opt_cls: type = torch.optim.Adam,
         wd: float = 0.0, watch: bool = False, unused: bool = False, **kw) -> dict:  # noqa: ANN003
    model = make_model()
    if rank == 1:  # the algorithm must start every rank from rank 0's weights
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = opt_cls(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=wd)
    algo = algorithms.create(spec, model, opt, compressor=compressor, **kw)
    params, vs, ms = [], [], []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(rank, step)
        if unused:  # input 0 always 0: column 0 of the first weight never has a gradient
            x = torch.cat([torch.zeros_like(x[:, :1]), x[:, 1:]], dim=1)
        torch.nn.functional.mse_loss(model(x), y).backward()
        algo.step()
        params.append(flat(list(model.parameters())))
        if watch:
            vs.append(flat(algo.exp_avg_sq))
            ms.append(flat(algo.exp_avg))
    return {"params": params, "v": vs, "m": ms, "algo": algo, "model": model, "opt": opt, "stats": algo.stats}


def _resume(rank: int, spec: str, compressor: str, first: int, then: int, **kw) -> dict:  # noqa: ANN003
    run = _run(rank, spec, compressor, first, **kw)
    saved = checkpoint(algo=run["algo"], model=run["model"])

    def go(model: torch.nn.Module, algo: algorithms.Algorithm, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        out = []
        for step in range(first, first + then):
            opt.zero_grad()
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            algo.step()
            out.append(flat(list(model.parameters())))
        return out

    cont = go(run["model"], run["algo"], run["opt"])
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR, betas=BETAS, eps=EPS)
    algo = algorithms.create(spec, model, opt, compressor=compressor, **kw)
    restore(saved, model=model, algo=algo)  # the model after the construction's broadcast: replicas may differ
    return {"cont": cont, "resumed": go(model, algo, opt), "keys": sorted(saved["algo"]["exchange"]["feedback"]["residuals"]),
            "extra": sorted(saved["algo"]["extra"])}


def _worker(rank: int, world: int) -> dict:
    out: dict = {}
    out["adam"] = _run(rank, "onebit_adam:freeze_step=100", "none", 6)["params"]
    out["adam_l2"] = _run(rank, "onebit_adam:freeze_step=100", "none", 6, wd=0.1)["params"]
    out["adamw"] = _run(rank, "onebit_adam:freeze_step=100", "none", 6, opt_cls=torch.optim.AdamW, wd=0.1)["params"]
    out["frozen_none"] = _run(rank, "onebit_adam:freeze_step=3", "none", 7)["params"]
    run = _run(rank, "onebit_adam:freeze_step=3", None, 8, watch=True, min_numel=64)
    out["onebit"] = {k: run[k] for k in ("params", "v", "m", "stats")}
    out["onebit"]["describe"] = run["algo"].describe()
    out["onebit_chunk"] = _run(rank, "onebit_adam:freeze_step=3", "efsignsgd:chunk=16", 8, min_numel=64)["params"]
    for spec in ("onebit_adam:freeze_step=2", "zeroone_adam:var_update_scaler=1,var_freeze_step=5"):
        run = _run(rank, spec, None, 8, unused=True, min_numel=64)
        out.setdefault("unused", []).append(run["model"][0].weight[:, 0].detach().clone())
    out["init"] = make_model()[0].weight[:, 0].detach().clone()
    out["zo_adam"] = _run(rank, "zeroone_adam:var_update_scaler=1000", "none", 6)["params"]
    out["zo_frozen_none"] = _run(rank, "zeroone_adam:var_update_scaler=1000,var_freeze_step=3,local_step_clipper=1",
                                 "none", 7)["params"]
    out["zo_local_none"] = _run(rank, ZO_LOCAL, "none", 9)["params"]
    out["zo_compressed"] = _run(rank, ZO_COMPRESSED[0], None, ZO_COMPRESSED[1], min_numel=64)["params"]
    run = _run(rank, "zeroone_adam:var_update_scaler=2,var_freeze_step=9,local_step_scaler=2,local_step_clipper=4",
               None, 16, watch=True, min_numel=64)
    out["zo"] = {k: run[k] for k in ("params", "v", "m", "stats")}
    out["resume_onebit"] = _resume(rank, "onebit_adam:freeze_step=2", "efsignsgd:chunk=16", 4, 4, min_numel=64)
    out["resume_zo"] = _resume(rank, "zeroone_adam:var_update_scaler=2,var_freeze_step=4,local_step_scaler=1,"
                               "local_step_clipper=4", "efsignsgd", 7, 6, min_numel=64)
    def onebit_adam_with(make):  # noqa: ANN001, ANN202
        model = make_model()
        return algorithms.create("onebit_adam", model, make(model))

    out["errors"] = value_errors(onebit_adam_with, {
        "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=LR),
        "amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=LR, amsgrad=True)})
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


def _close(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> None:
    assert len(got) == len(want)
    for t, (a, b) in enumerate(zip(got, want)):
        assert torch.allclose(a, b, rtol=tol, atol=tol), f"step {t + 1}: max diff {(a - b).abs().max():.3g}"


@pytest.mark.parametrize("key,wd,decoupled", [("adam", 0.0, False), ("adam_l2", 0.1, False), ("adamw", 0.1, True)])
def test_no_compression_no_freeze_is_distributed_adam(results: list[dict], key: str, wd: float,
                                                      decoupled: bool) -> None:
    want = reference_adam(6, [True] * 6, wd, decoupled)
    for res in results:
        _close(res[key], want, 1e-12)


def test_zeroone_no_compression_no_freeze_is_distributed_adam(results: list[dict]) -> None:
    want = reference_adam(6, [True] * 6)
    for res in results:
        _close(res["zo_adam"], want, 1e-12)


def test_identity_compressor_after_freeze_is_adam_with_frozen_variance(results: list[dict]) -> None:
    want = reference_adam(7, [t < 3 for t in range(7)])
    for res in results:
        _close(res["frozen_none"], want, 1e-12)
        _close(res["zo_frozen_none"], want, 1e-12)  # 0/1 Adam's local steps with H = 1 are the same


def test_zeroone_local_steps_rebuild_the_momentum_at_each_synchronization(results: list[dict]) -> None:
    """After the freeze, with H = 2 (so a synchronization follows two local
    steps and the rebuilt momentum differs from the mean of the workers'
    own), every rank's parameters after every step equal the float64
    reference; the local steps in between differ between the ranks."""
    want = reference_zeroone_local(9, freeze=3, scaler=1, clipper=2)
    for rank, res in enumerate(results):
        _close(res["zo_local_none"], want[rank], 1e-12)
    assert not torch.equal(results[0]["zo_local_none"][4], results[1]["zo_local_none"][4])  # step 5 is local


def test_zeroone_compressed_gradients_and_local_steps_match_the_reference(results: list[dict]) -> None:
    """0/1 Adam with its default compressor against the float64 reference:
    compressed gradients between the variance steps (worker and owner
    residuals carried from step 3 to step 5), both residuals cleared at the
    freeze, compressed synchronizations of the local steps (float64 scales
    travel with 2^-21 relative precision: loose tolerance, as for 1-bit Adam)."""
    spec, steps = ZO_COMPRESSED
    want = reference_zeroone_compressed(steps, freeze=5, kappa=1, scaler=1, clipper=2, min_numel=64)
    for rank, res in enumerate(results):
        _close(res["zo_compressed"], want[rank], 1e-5)
    assert not torch.equal(results[0]["zo_compressed"][6], results[1]["zo_compressed"][6])  # step 7 is local


def test_onebit_compressed_allreduce_with_both_residuals(results: list[dict]) -> None:
    """The compression stage equals the paper's compressed allreduce with
    worker and server error feedback (float64 scales travel with 2^-21
    relative precision: loose tolerance). The run uses 1-bit Adam's default
    compressor, one scale per ONEBIT_CHUNK entries of a partition."""
    want = reference_onebit(8, 3, 64, chunk=ONEBIT_CHUNK)
    for res in results:
        _close(res["onebit"]["params"], want, 1e-5)


def test_onebit_chunked_scale_matches_reference(results: list[dict]) -> None:
    """``efsignsgd:chunk=16`` (one scale per 16 entries of each partition, at
    the worker and at the owner) against the float64 reference with the same
    per-chunk scale: 120- and 60-entry partitions, so several chunks each and
    a short last one."""
    want = reference_onebit(8, 3, 64, chunk=16)
    for res in results:
        _close(res["onebit_chunk"], want, 1e-5)
    assert not torch.allclose(want[-1], reference_onebit(8, 3, 64)[-1], rtol=1e-5, atol=1e-5)  # the chunks matter


def test_variance_frozen_and_replicas_identical(results: list[dict]) -> None:
    run0, run1 = results[0]["onebit"], results[1]["onebit"]
    for t in range(8):
        assert torch.equal(run0["params"][t], run1["params"][t])
        assert torch.equal(run0["m"][t], run1["m"][t])
        if t >= 3:  # steps 4.. never touch v
            assert torch.equal(run0["v"][t], run0["v"][2])
        elif t:
            assert not torch.equal(run0["v"][t], run0["v"][t - 1])
    assert results[0]["onebit"]["describe"]["strategy"] == "ps"
    assert results[0]["onebit"]["describe"]["compressor"] == algorithms.get_class("onebit_adam").default_compressor


def test_zeroone_variance_schedule_and_replicas(results: list[dict]) -> None:
    """kappa = 2: the variance changes at steps 1, 2, then every 2nd (4, 6),
    every 4th (8), and never after var_freeze_step = 9; replicas agree after
    every synchronized step: from step 10 the local interval H is 1, 1, 2,
    2, then 4 (DeepSpeed's rule: synchronize when t % H == 0), so steps
    10, 11, 12 and 16 synchronize and 13-15 are local."""
    run0, run1 = results[0]["zo"], results[1]["zo"]
    changed = [t + 1 for t in range(16) if not torch.equal(run0["v"][t], run0["v"][t - 1] if t else
                                                           torch.zeros_like(run0["v"][0]))]
    assert changed == [1, 2, 4, 6, 8]
    synced = set(range(1, 13)) | {16}
    for t in range(16):
        same = torch.equal(run0["params"][t], run1["params"][t])
        assert same == (t + 1 in synced), f"step {t + 1}"


def test_coordinates_without_gradient_never_move(results: list[dict]) -> None:
    """A coordinate whose gradient is always exactly 0 has v = 0: one bit
    cannot send its zero momentum, and m / eps would throw it away; it must
    stay where it started (1-bit Adam and 0/1 Adam, compressed stages)."""
    for res in results:
        for col in res["unused"]:
            assert torch.equal(col, results[0]["init"])


def test_bytes_after_freeze(results: list[dict]) -> None:
    """After the freeze, each compressed momentum tensor costs >= 10x less
    than its dense gradient (one bit per element plus a scale per chunk;
    this tiny model's biases travel plain and dominate its total)."""
    st = results[0]["onebit"]["stats"]
    assert st["steps"] == 8 and st["exchanges"] == 8
    assert st["last_step_bytes"] < st["last_step_dense_bytes"]
    for key, numel in (("0.weight", 240), ("2.weight", 120)):
        assert 0 < st["tensor_bytes"][key] * 10 <= numel * 8, (key, st["tensor_bytes"][key])


@pytest.mark.parametrize("key", ["resume_onebit", "resume_zo"])
def test_resume_is_bit_identical_and_keeps_both_residuals(results: list[dict], key: str) -> None:
    for res in results:
        r = res[key]
        for a, b in zip(r["cont"], r["resumed"]):
            assert torch.equal(a, b)
        assert "0.weight" in r["keys"]  # the worker residual
        assert any(k.startswith("root/") for k in r["keys"])  # this rank owns chunks
        assert {"exp_avg", "exp_avg_sq", "t", "v_steps", "phase"} <= set(r["extra"])
    roots = [k for res in results for k in res[key]["keys"] if k.startswith("root/")]
    assert sorted(roots) == sorted({"root/0.weight#0#ps", "root/0.weight#1#ps", "root/2.weight#0#ps",
                                    "root/2.weight#1#ps"})  # each chunk's residual on its owner only


def test_refuses_other_optimizers(results: list[dict]) -> None:
    errors = results[0]["errors"]
    assert "torch.optim.Adam or AdamW" in errors["sgd"] and "SGD" in errors["sgd"]
    assert "amsgrad" in errors["amsgrad"]


def test_registered_with_default_compressor() -> None:
    assert algorithms.get_class("onebit_adam").default_compressor == f"efsignsgd:chunk={ONEBIT_CHUNK}"
    assert algorithms.get_class("zeroone_adam").default_compressor == "efsignsgd"
