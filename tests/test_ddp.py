"""Multi-process DDP tests of the hook (gloo, 2 and 3 workers).

Invariants held here: with ``none`` the hook equals plain DDP; with every
registered compressor the replicas stay bit-identical and the loss falls;
``stats`` counts the bytes actually handed to collectives; a configuration
that differs between ranks fails on every rank with a clear message; several
buckets with a multi-round protocol (PowerSGD) keep collective order.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from distributed import run_workers
from regression import fit, regression_data
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
from gradpress.compress import create

# Specs that make each method do real work on a tiny model in 20 steps.
SPECS = {
    "topk": "topk:ratio=0.05",
    "randomk": "randomk:ratio=0.25",
    "threshold": "threshold:tau=0.001",
    "powersgd": "powersgd:rank=2,start_iter=2",
    "dgc": "dgc:ratio=0.05",
    "sidco": "sidco:ratio=0.05",
    "dgc_threshold": "dgc_threshold:ratio=0.05",
    "redsync": "redsync:ratio=0.05",
    "gaussiank": "gaussiank:ratio=0.05",
    "fft": "fft:theta=0.5",
}
# sign methods move every coordinate by +-lr: they need a small step
LR = {"signsgd": 0.002, "signum": 0.002}
MIN_NUMEL = 64


def spec_for(name: str) -> str:
    return SPECS.get(name, name)


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(
        nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 32), nn.Tanh(), nn.Linear(32, 3)
    )


def make_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return regression_data(rank)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train(spec: str | None, rank: int, steps: int = 20, lr: float = 0.05, **kw) -> dict:
    model = make_model()
    # several buckets; torch 2.2.2's DDP caps the first bucket at _DEFAULT_FIRST_BUCKET_BYTES (1 MiB) whatever
    # bucket_cap_mb says (2.13 applies bucket_cap_mb to every bucket when it is given)
    dist._DEFAULT_FIRST_BUCKET_BYTES = int(0.004 * 2**20)
    ddp = DDP(model, bucket_cap_mb=0.004)
    kw.setdefault("strategy", "collective")  # the compressor as configured, not the planner's choice
    hook = gradpress.ddp.register(ddp, spec, min_numel=MIN_NUMEL, **kw) if spec is not None else None
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    x, y = make_data(rank)
    out = {"losses": fit(ddp, opt, x, y, steps), "params": flat_params(model)}
    if hook is not None:
        out["stats"] = hook.stats
        out["state"] = hook.state_dict()
        hook.close()
    return out


# ---------------------------------------------------------------- workers
def _none_equals_plain(rank: int, world: int) -> dict:
    plain = train(None, rank, steps=8)
    hooked = train("none", rank, steps=8)
    return {"plain": plain["params"], "hooked": hooked["params"], "stats": hooked["stats"]}


def _every_compressor(rank: int, world: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        spec = spec_for(name)
        res = train(spec, rank, steps=20, lr=LR.get(name, 0.05))
        out[name] = {"first": res["losses"][0], "last": min(res["losses"][-3:]), "params": res["params"],
                     "stats": res["stats"]}
    return out


def _mismatch(rank: int, world: int) -> str:
    model = make_model()
    ddp = DDP(model)
    spec = "topk:ratio=0.01" if rank == 0 else "topk:ratio=0.02"
    try:
        gradpress.ddp.register(ddp, spec)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _bad_spec_one_rank(rank: int, world: int) -> str:
    ddp = DDP(make_model())
    try:
        gradpress.ddp.register(ddp, "topk:ratio=0.01" if rank == 0 else "topk:ratio=7")
    except ValueError as exc:
        return str(exc)
    return "no error"


def _resume(rank: int, world: int) -> dict:
    """Train 6 steps, checkpoint hook + model + optimizer, train 6 more; a
    fresh model/hook loaded from the checkpoint must give the same 6 steps."""
    spec = "topk:ratio=0.05"
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.004)
    hook = gradpress.ddp.register(ddp, spec, min_numel=MIN_NUMEL, strategy="collective")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    x, y = make_data(rank)

    def step(d, o):
        o.zero_grad()
        loss = ((d(x) - y) ** 2).mean()
        loss.backward()
        o.step()
        return loss.item()

    for _ in range(6):
        step(ddp, opt)
    ckpt = {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": __import__("copy").deepcopy(opt.state_dict()), "hook": hook.state_dict()}
    cont = [step(ddp, opt) for _ in range(6)]
    hook.close()
    model2 = make_model()
    model2.load_state_dict(ckpt["model"])
    ddp2 = DDP(model2, bucket_cap_mb=0.004)
    hook2 = gradpress.ddp.register(ddp2, spec, min_numel=MIN_NUMEL, strategy="collective")
    hook2.load_state_dict(ckpt["hook"])
    opt2 = torch.optim.SGD(ddp2.parameters(), lr=0.05, momentum=0.9)
    opt2.load_state_dict(ckpt["opt"])
    resumed = [step(ddp2, opt2) for _ in range(6)]
    # a state dict of another configuration is refused
    hook3 = gradpress.ddp.register(DDP(make_model()), "topk:ratio=0.5", min_numel=MIN_NUMEL, strategy="collective")
    try:
        hook3.load_state_dict(ckpt["hook"])
        refused = "accepted"
    except ValueError as exc:
        refused = str(exc)
    return {"cont": cont, "resumed": resumed, "refused": refused,
            "params_a": flat_params(model), "params_b": flat_params(model2)}


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("world", [2, 3])
def test_none_equals_plain_ddp(world: int) -> None:
    results = run_workers(_none_equals_plain, world)
    for r in results:
        assert torch.equal(r["plain"], r["hooked"]), "hook with 'none' must equal DDP's own allreduce"
        assert r["stats"]["ratio"] == pytest.approx(1.0)
        assert r["stats"]["steps"] == 8


def _all_names() -> list[str]:
    return gradpress.compressors.names()


@functools.cache
def _every_compressor_results(world: int) -> list[dict]:
    """Every registered compressor through the hook on ``world`` workers, run once per module (the wire-size
    test reads the same runs)."""
    return run_workers(_every_compressor, world, _all_names())


@pytest.mark.parametrize("world", [2, 3])
def test_every_compressor_keeps_replicas_identical_and_learns(world: int) -> None:
    names = _all_names()
    results = _every_compressor_results(world)
    for name in names:
        per_rank = [res[name] for res in results]
        for other in per_rank[1:]:
            assert torch.equal(per_rank[0]["params"], other["params"]), f"{name}: replicas diverged"
        for r in per_rank:
            assert r["last"] < r["first"], f"{name}: loss did not fall ({r['first']} -> {r['last']})"
            assert r["stats"]["steps"] == 20
            assert r["stats"]["bytes_sent"] > 0


def _expected_ratio_floor(name: str) -> float:
    """Minimum dense/sent ratio we demand on the test model for methods whose
    size we know: 4 + elsize bytes per kept entry for sparsifiers, etc."""
    return {"topk": 3.0, "randomk": 2.0, "fp16": 1.5, "bf16": 1.5, "signsgd": 3.0, "efsignsgd": 3.0,
            "onebit": 3.0, "qsgd": 3.0, "terngrad": 3.0, "natural": 2.5, "powersgd": 1.2}.get(name, 1.0)


def test_stats_bytes_match_wire_sizes() -> None:
    names = [n for n in _all_names() if n in ("topk", "fp16", "qsgd", "signsgd", "natural", "onebit", "randomk")]
    results = _every_compressor_results(2)
    model = make_model()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    for name in names:
        stats = results[0][name]["stats"]
        comp = create(spec_for(name))
        for key, nbytes in stats["tensor_bytes"].items():
            shape = shapes[key]
            if len(shape) > 1 and shape.numel() >= MIN_NUMEL:
                assert nbytes == comp.encode(torch.randn(shape)).nbytes, f"{name}: {key} accounted {nbytes}"
            else:
                assert nbytes == shape.numel() * 4
        assert stats["dense_bytes"] / stats["bytes_sent"] >= _expected_ratio_floor(name), name
        assert stats["ratio"] == pytest.approx(stats["dense_bytes"] / stats["bytes_sent"])
        # DDP rebuilds its buckets after the first step, so per-bucket padding may differ once
        assert abs(stats["last_step_bytes"] * 20 - stats["bytes_sent"]) <= 8 * 8


def test_mismatched_configuration_fails_on_every_rank() -> None:
    messages = run_workers(_mismatch, 2)
    for msg in messages:
        assert "differs between ranks" in msg and "ratio=0.02" in msg and "compressor" in msg


def test_bad_spec_on_one_rank_fails_on_every_rank() -> None:
    messages = run_workers(_bad_spec_one_rank, 2)
    for msg in messages:
        assert "rank 1" in msg and "'ratio'" in msg and "0 < ratio <= 1" in msg


def test_resume_continues_identically_and_refuses_other_config() -> None:
    results = run_workers(_resume, 2)
    for r in results:
        assert r["cont"] == r["resumed"]
        assert torch.equal(r["params_a"], r["params_b"])
        assert "different configuration" in r["refused"] and "compressor" in r["refused"]


def test_register_validates_arguments() -> None:
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        gradpress.ddp.register(nn.Linear(2, 2), "topk")  # type: ignore[arg-type]
    assert not dist.is_initialized()


# ------------------------------------------------- make_hook: PyTorch's (state, hook) pair
def _make_hook_paths(rank: int, world: int) -> dict:
    """The same 4+4 steps through ``register``, through ``make_hook(spec,
    model)`` + ``register_comm_hook``, and through an unbound
    ``make_hook(spec)`` that binds itself at the first backward; then a
    resume through an unbound state loaded before its first backward."""
    spec, kw = "topk:ratio=0.05", {"min_numel": MIN_NUMEL, "strategy": "collective"}
    x, y = make_data(rank)

    def run(attach, steps: int = 8, start: dict | None = None) -> dict:  # noqa: ANN001
        model = make_model()
        if start is not None:
            model.load_state_dict(start["model"])
        ddp = DDP(model, bucket_cap_mb=0.004)
        state = attach(ddp)
        if start is not None:
            state.load_state_dict(start["hook"])
        losses, mid = [], None
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for i in range(steps):
            opt.zero_grad()
            loss = ((ddp(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if i == 3:
                mid = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "hook": state.state_dict()}
        out = {"losses": losses, "params": flat_params(model), "state": state.state_dict(), "stats": state.stats,
               "mid": mid, "bound_keys": sorted(state.memory_bytes())}
        state.close()
        return out

    def with_make_hook(ddp: DDP):  # noqa: ANN202
        state, hook = gradpress.ddp.make_hook(spec, ddp, **kw)
        ddp.register_comm_hook(state, hook)
        return state

    unbound: dict = {}

    def lazily(ddp: DDP):  # noqa: ANN202
        state, hook = gradpress.ddp.make_hook(spec, **kw)
        unbound["before"] = state.bound
        try:
            state.stats  # noqa: B018
        except RuntimeError as exc:
            unbound["stats_error"] = str(exc)
        ddp.register_comm_hook(state, hook)
        return state

    out = {"register": run(lambda d: gradpress.ddp.register(d, spec, **kw)), "make_hook": run(with_make_hook),
           "lazy": run(lazily)}
    out["unbound"] = unbound
    # resume: an unbound state keeps a loaded state and applies it when it binds at the first backward
    out["lazy_resumed"] = run(lazily, steps=4, start=out["lazy"]["mid"])
    # bind() is idempotent for the same model and refuses another
    state, _ = gradpress.ddp.make_hook(spec, **kw)
    model = make_model()
    state.bind(model)
    state.bind(DDP(model))
    try:
        state.bind(make_model())
        out["rebind"] = "accepted"
    except ValueError as exc:
        out["rebind"] = str(exc)
    state.close()
    return out


def test_make_hook_is_register_and_binds_itself_at_the_first_backward() -> None:
    for r in run_workers(_make_hook_paths, 2):
        reg, made, lazy = r["register"], r["make_hook"], r["lazy"]
        # one implementation: the (state, hook) pair gives register's steps, stats and state, bit for bit
        assert made["losses"] == reg["losses"] and torch.equal(made["params"], reg["params"])
        assert made["stats"]["bytes_sent"] == reg["stats"]["bytes_sent"] and made["stats"]["steps"] == 8
        assert made["state"]["config"] == reg["state"]["config"] and made["state"]["step"] == reg["state"]["step"] == 8
        for key, value in reg["state"]["feedback"]["residuals"].items():
            assert torch.equal(made["state"]["feedback"]["residuals"][key], value), key
        # unbound until the first backward, then keyed by position: the same training, the same bytes
        assert r["unbound"]["before"] is False and "not bound" in r["unbound"]["stats_error"]
        assert lazy["losses"] == reg["losses"] and torch.equal(lazy["params"], reg["params"])
        assert lazy["stats"]["bytes_sent"] == reg["stats"]["bytes_sent"]
        assert lazy["state"]["step"] == 8 and lazy["stats"]["steps"] == 8  # binding does not count a step twice
        assert all(name.startswith("param") for name, *_ in lazy["state"]["config"]["parameters"])
        # a state loaded before binding is applied at the bind: the resumed 4 steps equal the last 4
        assert r["lazy_resumed"]["losses"] == lazy["losses"][4:]
        assert torch.equal(r["lazy_resumed"]["params"], lazy["params"])
        assert r["lazy_resumed"]["state"]["step"] == 8
        assert "another model" in r["rebind"]


def test_make_hook_checks_the_spec_before_any_process_group() -> None:
    with pytest.raises(ValueError, match="ratio"):
        gradpress.ddp.make_hook("topk:ratio=7")
    state, hook = gradpress.ddp.make_hook("topk:ratio=0.1")
    assert hook is gradpress.ddp.gradpress_hook and not state.bound
    with pytest.raises(RuntimeError, match="not bound"):
        state.state_dict()
    with pytest.raises(ValueError, match="not a gradpress hook state"):
        state.load_state_dict({"format": "something else"})
    with pytest.raises(RuntimeError, match="not initialized"):
        state.bind(make_model())  # binding is collective: it needs the process group
    state.close()
    assert not dist.is_initialized()


# ------------------------------------------------- coalesced buckets (PowerSGD)
def _coalesced_powersgd(rank: int, world: int, coalesce: bool | None) -> dict:
    """PowerSGD r=1 on several DDP buckets. At step 2 (warm start: Q of
    step 1 known) record each rank's own gradient (autograd on the bare
    module, same weights and data), the residuals and Q before the step, and
    the averaged gradient the hook wrote; count the allreduces per step."""
    model = make_model()
    # several buckets; torch 2.2.2's DDP caps the first bucket at _DEFAULT_FIRST_BUCKET_BYTES (1 MiB) whatever
    # bucket_cap_mb says (2.13 applies bucket_cap_mb to every bucket when it is given)
    dist._DEFAULT_FIRST_BUCKET_BYTES = int(0.004 * 2**20)
    ddp = DDP(model, bucket_cap_mb=0.004)
    hook = gradpress.ddp.register(ddp, "powersgd:rank=1,start_iter=1", min_numel=MIN_NUMEL, coalesce=coalesce)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    x, y = make_data(rank)
    calls: list[int] = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):  # noqa: ANN001, ANN202
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    out: dict = {"calls": [], "buckets": None}
    try:
        for step in range(4):
            if step == 2:
                names = [n for n, _ in model.named_parameters()]
                local = torch.autograd.grad(((model(x) - y) ** 2).mean(), list(model.parameters()))
                out["local"] = {n: g.double() for n, g in zip(names, local)}
                out["residual"] = {k: v.double().clone() for k, v in hook.memory.residuals.items()}
                out["q"] = {k: v.double().clone() for k, v in hook.compressor.q.items()}
            opt.zero_grad()
            calls.clear()
            ((ddp(x) - y) ** 2).mean().backward()
            out["calls"].append(len(calls))
            if step == 2:
                out["avg"] = {n: p.grad.double().clone() for n, p in model.named_parameters()}
            opt.step()
    finally:
        dist.all_reduce = real
    out["buckets"] = len(ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(", "))
    out["coalescing"] = hook.coalescing
    out["params"] = flat_params(model)
    hook.close()
    return out


def _powersgd_rank1_reference(ms: list[torch.Tensor], q: torch.Tensor) -> torch.Tensor:
    """One warm-started PowerSGD r=1 step by the formula, float64: P = sum M_r Q,
    P / ||P||, Q' = sum M_r^T P / N, average = P Q'^T."""
    p = sum(m @ q for m in ms)
    p = p / p.norm()
    q2 = sum(m.t() @ p for m in ms) / len(ms)
    return p @ q2.t()


@pytest.mark.parametrize("coalesce", [None, False])
def test_powersgd_coalesces_a_steps_buckets_into_one_collective_per_round(coalesce: bool | None) -> None:
    """Default (None): PowerSGD's buckets are averaged together, two
    allreduces per step whatever the bucket count (P with the plain tensors
    and NaN flags, then Q); ``coalesce=False``: two per bucket. Either way
    the average is the float64 formula's and the replicas are identical."""
    results = run_workers(_coalesced_powersgd, 2, coalesce)
    for r in results:
        assert r["buckets"] >= 3
        assert r["coalescing"] is (coalesce is None)
        # step 0 is dense (start_iter=1), on DDP's first-iteration buckets; then two rounds per call
        assert r["calls"][1:] == [2 if coalesce is None else 2 * r["buckets"]] * 3
    assert torch.equal(results[0]["params"], results[1]["params"])
    for name, avg in results[0]["avg"].items():
        grads = [r["local"][name] for r in results]
        if avg.dim() < 2 or avg.numel() < MIN_NUMEL:  # plain average
            want = sum(grads) / len(grads)
        else:
            ms = [(g + r["residual"][name]).reshape(g.shape[0], -1) for g, r in zip(grads, results)]
            want = _powersgd_rank1_reference(ms, results[0]["q"][name]).reshape(avg.shape)
        assert torch.allclose(avg, want, rtol=1e-4, atol=1e-6 * float(want.abs().max())), name
        assert torch.equal(avg, results[1]["avg"][name]), name


@pytest.mark.parametrize("saved, message", [
    ({"format": "other"}, "format 'other'; expected 'gradpress-ranks/1'"),
    ({"format": "gradpress-ranks/1", "world_size": 4, "ranks": [{}] * 4}, "the checkpoint has 4, this run has 2"),
    ({"format": "gradpress-ranks/1", "world_size": 1, "ranks": [{}]}, "the checkpoint has 1, this run has 2"),
    # a file whose header and entries disagree is refused too, whichever of them matches this run
    ({"format": "gradpress-ranks/1", "world_size": 4, "ranks": [{}] * 2}, "the checkpoint has 4, this run has 2"),
    ({"format": "gradpress-ranks/1", "world_size": 2, "ranks": [{}] * 3}, "the checkpoint has 2, this run has 2"),
])
def test_rank_states_of_another_world_size_are_refused(saved: dict, message: str) -> None:
    """``load_rank_state`` (Lightning, Accelerate, Transformers checkpoints)
    refuses before touching the hook state."""
    from gradpress.ddp.ranks import load_rank_state

    with pytest.raises(ValueError, match=re.escape(message)):
        load_rank_state(None, saved, 0, 2, where="ckpt")  # type: ignore[arg-type]
