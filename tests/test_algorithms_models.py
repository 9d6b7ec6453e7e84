"""Local SGD, post-local SGD, DiLoCo and Streaming DiLoCo with the models users bring, on 2 gloo workers: BatchNorm
(floating statistics and an int64 ``num_batches_tracked``), one Parameter
registered twice (tied), a frozen layer (``requires_grad=False``), a layer no
rank ever uses (``.grad`` stays None), a layer only rank 1 uses at even steps,
float64, bfloat16, float16 and a float32 model with bfloat16 layers.

Every check compares with a reference computed here from the definitions in
float64, from what each worker recorded: its gradients after ``backward()``,
its parameters and buffers right after the inner optimizer's step (a step
post-hook, so before the algorithm's exchange) and its training losses.
Resume: ``state_dict`` of the model, the optimizer and the algorithm through
``torch.save`` / ``torch.load(weights_only=True)`` into fresh objects, then the
same steps bit-identical. Leader SGD, SGP and 1-bit Adam on the same model are in
tests/test_algorithms_models_lsgd_sgp_adam.py, which imports ``Zoo`` and the
helpers from here (as tests/test_algorithms_models2.py and
tests/test_algorithms_models_scaffold.py do)."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.nn as nn
from distributed import run_workers

import gradpress.algorithms as algorithms

WORLD = 2
LR = 0.1
MU, WD = 0.9, 0.01
OUTER_LR, OUTER_MU = 0.7, 0.5
F64 = torch.float64
BF16 = torch.bfloat16
#: the trainable parameters, each once (tied2.weight is tied1.weight; frozen.* are frozen)
TRAINABLE = ["inp.weight", "inp.bias", "bn.weight", "bn.bias", "tied1.weight", "out.weight", "out.bias",
             "extra.weight", "extra.bias", "unused.weight", "unused.bias"]
FLOAT_BUFFERS = ["bn.running_mean", "bn.running_var"]


class Zoo(nn.Module):
    """BatchNorm, tied weights, a frozen layer, a never-used layer and a
    layer used on rank 1 at even steps only (``use_extra``)."""

    def __init__(self, dtype: torch.dtype = F64, head: torch.dtype | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.tied1 = nn.Linear(8, 8, bias=False)
        self.tied2 = nn.Linear(8, 8, bias=False)
        self.tied2.weight = self.tied1.weight
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.out = nn.Linear(8, 2)
        self.extra = nn.Linear(8, 2)
        self.unused = nn.Linear(8, 2)
        self.use_extra = False
        self.to(dtype)
        if head is not None:
            self.out.to(head)
            self.extra.to(head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.bn(self.inp(x.to(self.inp.weight.dtype))))
        h = self.frozen(torch.tanh(self.tied2(torch.tanh(self.tied1(h)))))
        h = h.to(self.out.weight.dtype)
        y = self.out(h)
        if self.use_extra:
            y = y + self.extra(h)
        return y.to(F64)


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    if kind == "momentum":
        return torch.optim.SGD(model.parameters(), lr=LR, momentum=MU, weight_decay=WD)
    return torch.optim.SGD(model.parameters(), lr=LR)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _run(model: nn.Module, opt: torch.optim.Optimizer, algo: Any, rank: int, steps: range,
         out: list[dict] | None) -> None:
    local: dict[str, Any] = {}
    handle = opt.register_step_post_hook(lambda o, a, k: local.update(params=_params(model), buffers=_buffers(model)))
    try:
        for s in steps:
            g = torch.Generator().manual_seed(1000 * s + rank)
            x = torch.randn(8, 4, generator=g, dtype=F64) * (1 + rank)  # the ranks' statistics differ
            model.use_extra = rank == 1 and s % 2 == 0
            opt.zero_grad(set_to_none=True)
            loss = ((model(x) - torch.sin(x[:, :2])) ** 2).mean()
            loss.backward()
            grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
            local.clear()
            algo.step()
            if out is not None:
                out.append({"grads": grads, "loss": float(loss.detach()), "local": local.get("params"),
                            "local_buffers": local.get("buffers"), "after": _params(model),
                            "buffers": _buffers(model), "bytes": algo.stats["last_step_bytes"]})
    finally:
        handle.remove()


def _scenario(rank: int, spec: str, kind: str = "sgd", steps: int = 4, resume_at: int = 2,
              dtype: torch.dtype = F64, head: torch.dtype | None = None, **kw: Any) -> dict:
    """Run ``spec`` for ``steps`` steps, checkpoint after ``resume_at``, and
    rerun the rest from the checkpoint in fresh objects."""
    def build() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        model = Zoo(dtype, head)
        opt = _optimizer(kind, model)
        return model, opt, algorithms.create(spec, model, opt, **kw)

    model, opt, algo = build()
    rec: dict[str, Any] = {"init": _params(model), "named": [n for n, _ in algo.named], "steps": []}
    if hasattr(algo, "frags"):
        rec["frags"] = [[algo.named[i][0] for i in f] for f in algo.frags]
        rec["launch_at"] = dict(algo.launch_at)
    _run(model, opt, algo, rank, range(resume_at), rec["steps"])
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "algo": algo.state_dict()}, blob)
    _run(model, opt, algo, rank, range(resume_at, steps), rec["steps"])
    rec["opt_state"] = {n: {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
                        for n, p in model.named_parameters() if p in opt.state}
    algo.close()
    model, opt, algo = build()
    blob.seek(0)
    saved = torch.load(blob, weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    algo.load_state_dict(saved["algo"])
    rec["resumed"] = []
    _run(model, opt, algo, rank, range(resume_at, steps), rec["resumed"])
    algo.close()
    return rec


class Heads(nn.Module):
    """Two same-shaped heads; ``use`` picks the one this step trains."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(3, 3).double()
        self.b = nn.Linear(3, 3).double()
        self.use = "a"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a if self.use == "a" else self.b)(x)


def _heads(rank: int) -> dict:
    """Local SGD averaging the momentum: rank 0 trains head a then b, rank 1
    b then a, so their optimizers created the states in opposite orders."""
    model = Heads()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MU)
    algo = algorithms.create("localsgd:period=2,optimizer_state=average", model, opt)
    grads: dict[str, torch.Tensor] = {}
    for s, head in enumerate(["a", "b"] if rank == 0 else ["b", "a"]):
        model.use = head
        opt.zero_grad(set_to_none=True)
        x = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(10 * s + rank))
        model(x).pow(2).sum().backward()
        grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        algo.step()
    momentum = {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()}
    algo.close()
    return {"grads": grads, "momentum": momentum}


def _refusal(rank: int, spec: str, **kw: Any) -> str:
    model = Zoo(torch.float32, BF16)
    try:
        algorithms.create(spec, model, _optimizer("sgd", model), **kw).close()
    except ValueError as exc:
        return str(exc)
    return "accepted"


SCENARIOS: dict[str, dict[str, Any]] = {
    "localsgd1": {"spec": "localsgd:period=1"},
    "localsgd_momentum": {"spec": "localsgd:period=2", "kind": "momentum", "steps": 5, "resume_at": 3},
    "postlocalsgd_switch": {"spec": "postlocalsgd:period=2,switch=3", "kind": "momentum", "steps": 5},
    "diloco": {"spec": f"diloco:period=2,outer_lr={OUTER_LR},outer_momentum={OUTER_MU}", "kind": "momentum",
               "steps": 6, "resume_at": 3},
    "diloco_switch": {"spec": f"diloco:period=2,outer_momentum={OUTER_MU},switch=3", "kind": "momentum",
                      "steps": 5},
    "diloco_topk": {"spec": f"diloco:period=2,outer_momentum={OUTER_MU}", "compressor": "topk:ratio=0.25",
                    "min_numel": 1, "kind": "momentum", "steps": 5, "resume_at": 3},
    "streaming": {"spec": f"streaming-diloco:period=2,fragments=2,overlap=1,alpha=0.5,outer_lr={OUTER_LR},"
                          f"outer_momentum={OUTER_MU}", "steps": 6, "resume_at": 3},
    "localsgd1_bf16": {"spec": "localsgd:period=1", "dtype": BF16},
    "localsgd1_mixed": {"spec": "localsgd:period=1", "dtype": torch.float32, "head": BF16},
    "localsgd1_fp16": {"spec": "localsgd:period=1", "dtype": torch.float16},
    "diloco_bf16": {"spec": f"diloco:period=2,outer_lr={OUTER_LR},outer_momentum={OUTER_MU}", "dtype": BF16,
                    "steps": 4},
    "diloco_mixed": {"spec": f"diloco:period=2,outer_lr={OUTER_LR},outer_momentum={OUTER_MU}",
                     "dtype": torch.float32, "head": BF16, "steps": 4},
    "diloco_fp16": {"spec": f"diloco:period=2,outer_lr={OUTER_LR},outer_momentum={OUTER_MU}",
                    "dtype": torch.float16, "steps": 4},
}


def _worker(rank: int, world: int) -> dict:
    out: dict[str, Any] = {name: _scenario(rank, **cfg) for name, cfg in SCENARIOS.items()}
    out["heads"] = _heads(rank)
    out["refuse_select_model"] = _refusal(rank, "diloco:select=model")
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


# ------------------------------------------------------------------ helpers
def _mean(ts: list[torch.Tensor]) -> torch.Tensor:
    return sum(t.double() for t in ts) / len(ts)


def _tol(dtype: torch.dtype, ref: torch.Tensor, ulps: float = 4) -> torch.Tensor:
    """``ulps`` units in the last place of ``dtype`` at ``ref`` (float64: 1e-12 absolute)."""
    if dtype == F64:
        return torch.full_like(ref, 1e-12)
    eps = torch.finfo(dtype).eps
    return ulps * eps * ref.abs().clamp_min(torch.finfo(dtype).tiny) + 1e-30


def _close(got: torch.Tensor, ref: torch.Tensor, what: Any, ulps: float = 4, extra: float = 0.0) -> None:
    bad = (got.double() - ref).abs() > _tol(got.dtype, ref, ulps) + extra
    assert not bad.any(), (what, (got.double() - ref).abs().max().item())


def _equal_ranks(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names: list[str], what: Any) -> None:
    for n in names:
        assert torch.equal(a[n], b[n]), (what, n)


def _check_common(results: list[dict], name: str, steps: int) -> None:
    """What every algorithm promises whatever it exchanges: the trainable
    parameters each once (the tied one once), frozen and never-used ones
    untouched, ``num_batches_tracked`` int64 counting this rank's forwards,
    dtypes kept, resume bit-identical."""
    for rank, res in enumerate(r[name] for r in results):
        assert res["named"] == TRAINABLE, (name, res["named"])
        init = res["init"]
        assert len(res["steps"]) == steps
        for t, st in enumerate(res["steps"]):
            for n in ("frozen.weight", "frozen.bias", "unused.weight", "unused.bias"):
                assert torch.equal(st["after"][n], init[n]), (name, rank, t, n)
            assert st["after"]["tied1.weight"] is not None and "tied2.weight" not in st["after"]
            for n, p in st["after"].items():
                assert p.dtype == init[n].dtype, (name, n, p.dtype)
            nbt = st["buffers"]["bn.num_batches_tracked"]
            assert nbt.dtype == torch.int64 and int(nbt) == t + 1, (name, rank, t, nbt)
        start = steps - len(res["resumed"])
        for t, (a, b) in enumerate(zip(res["steps"][start:], res["resumed"]), start):
            _equal_ranks(a["after"], b["after"], list(a["after"]), (name, "resume", rank, t))
            _equal_ranks(a["buffers"], b["buffers"], list(a["buffers"]), (name, "resume buffers", rank, t))


def _trainable_bytes(init: dict[str, torch.Tensor]) -> int:
    return sum(init[n].numel() * init[n].element_size() for n in TRAINABLE)


def _sgd_step(p: torch.Tensor, g: torch.Tensor | None, buf: torch.Tensor | None, momentum: bool
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch's SGD by its definition (a None gradient: no step, no state)."""
    if g is None:
        return p, buf
    if not momentum:
        return p - LR * g, None
    d = g + WD * p
    buf = d if buf is None else MU * buf + d
    return p - LR * buf, buf


def _ddp_grad(steps: list[dict], n: str) -> torch.Tensor | None:
    """DDP's gradient: the mean over ranks (zeros where a rank has none),
    None when no rank has one (DDP leaves ``.grad`` untouched)."""
    gs = [st["grads"][n] for st in steps]
    if all(g is None for g in gs):
        return None
    return _mean([g if g is not None else torch.zeros_like(steps[0]["after"][n]) for g in gs])


# -------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_frozen_unused_tied_buffers_dtypes_and_resume(results: list[dict], name: str) -> None:
    cfg = SCENARIOS[name]
    _check_common(results, name, cfg.get("steps", 4))


@pytest.mark.parametrize("name", ["localsgd1", "localsgd1_bf16", "localsgd1_mixed", "localsgd1_fp16"])
def test_localsgd_period_1_is_synchronous_averaging(results: list[dict], name: str) -> None:
    """H = 1, plain SGD: x <- x - lr * mean_i g_i (a rank without a gradient
    contributes a zero step); floating buffers the mean of the ranks'; the
    bytes are the trainable parameters once, the floating buffers and the
    optimizer-state flags (one per trainable parameter)."""
    r0, r1 = (r[name] for r in results)
    prev = {n: p.double() for n, p in r0["init"].items()}
    buf_bytes = sum(r0["init"]["bn.weight"].element_size() * 8 for _ in FLOAT_BUFFERS)
    for t, (a, b) in enumerate(zip(r0["steps"], r1["steps"])):
        _equal_ranks(a["after"], b["after"], TRAINABLE, (name, t))
        _equal_ranks(a["buffers"], b["buffers"], FLOAT_BUFFERS, (name, t))
        for n in TRAINABLE:
            step = _mean([s["grads"][n] if s["grads"][n] is not None else torch.zeros_like(prev[n]) for s in (a, b)])
            sync = _mean([a["local"][n], b["local"][n]])  # the average of the replicas after their local steps
            _close(a["after"][n], sync, (name, t, n))
            if a["after"][n].dtype == F64:
                _close(a["after"][n], prev[n] - LR * step, (name, t, n, "sync SGD"))
            prev[n] = a["after"][n].double()
        for n in FLOAT_BUFFERS:
            _close(a["buffers"][n], _mean([a["local_buffers"][n], b["local_buffers"][n]]), (name, t, n))
        # optimizer_state=auto (uncompressed) averages the state every rank holds: a flag per parameter in the
        # first parameter's dtype rides with the deltas
        flags = r0["init"][TRAINABLE[0]].element_size() * len(TRAINABLE)
        assert a["bytes"] == _trainable_bytes(r0["init"]) + buf_bytes + flags, (name, t, a["bytes"])


def test_localsgd_momentum_average_pairs_each_parameters_state(results: list[dict]) -> None:
    """``optimizer_state=average``: each parameter's momentum is the mean of
    the ranks' momentum of that parameter, whatever order the optimizers
    created their states in (rank 0 trained head a first, rank 1 head b)."""
    r0, r1 = (r["heads"] for r in results)
    for n in r0["grads"]:
        want = _mean([r0["grads"][n], r1["grads"][n]])  # one step each: the momentum is the gradient
        _close(r0["momentum"][n], want, n)
        _close(r1["momentum"][n], want, n)


def test_localsgd_with_a_rank_that_lacks_some_momentum(results: list[dict]) -> None:
    """SGD momentum averaged (``auto``, uncompressed): ``extra`` has a
    momentum on rank 1 only (rank 0 never trains it): it stays rank 1's own,
    the rest is averaged; parameters and buffers equal after every average."""
    name = "localsgd_momentum"
    r0, r1 = (r[name] for r in results)
    for t, (a, b) in enumerate(zip(r0["steps"], r1["steps"])):
        if (t + 1) % 2 == 0:
            _equal_ranks(a["after"], b["after"], TRAINABLE, (name, t))
            _equal_ranks(a["buffers"], b["buffers"], FLOAT_BUFFERS, (name, t))
            for n in TRAINABLE:
                _close(a["after"][n], _mean([a["local"][n], b["local"][n]]), (name, t, n))
    s0, s1 = r0["opt_state"], r1["opt_state"]
    assert "extra.weight" not in s0 and "extra.weight" in s1
    assert "unused.weight" not in s0 and "unused.weight" not in s1
    for n in s0:  # the last step (5) is local: the states of step 4 differ by one local step
        assert n in s1


@pytest.mark.parametrize("name", ["postlocalsgd_switch", "diloco_switch"])
def test_synchronous_start_follows_ddp_for_missing_gradients(results: list[dict], name: str) -> None:
    """The ``switch`` steps are DDP's: the mean gradient (zeros where a rank
    has none), and a parameter no rank has a gradient for is not stepped (DDP
    leaves its ``.grad`` None: no momentum, no weight decay)."""
    r0, r1 = (r[name] for r in results)
    p = {n: v.double() for n, v in r0["init"].items()}
    buf: dict[str, torch.Tensor | None] = {n: None for n in TRAINABLE}
    for t, (a, b) in enumerate(zip(r0["steps"][:3], r1["steps"][:3])):
        _equal_ranks(a["after"], b["after"], TRAINABLE, (name, t))
        for n in TRAINABLE:
            p[n], buf[n] = _sgd_step(p[n], _ddp_grad([a, b], n), buf[n], momentum=True)
            _close(a["after"][n], p[n], (name, t, n))
        for n in FLOAT_BUFFERS:
            _close(a["buffers"][n], _mean([a["local_buffers"][n], b["local_buffers"][n]]), (name, t, n))


def _outer(theta: torch.Tensor, v: torch.Tensor | None, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The outer Nesterov SGD: v <- mu v + Delta (v = Delta at the first step), theta -= lr (Delta + mu v)."""
    v = delta if v is None else OUTER_MU * v + delta
    return theta - OUTER_LR * (delta + OUTER_MU * v), v


@pytest.mark.parametrize("name", ["diloco", "diloco_bf16", "diloco_mixed", "diloco_fp16"])
def test_diloco_outer_step_by_its_formula(results: list[dict], name: str) -> None:
    """Every 2 steps: Delta = theta - mean_i x_i, the outer Nesterov step,
    every replica restarts bit-identical from theta (the tied weight stepped
    once); the floating buffers are the mean of the ranks'. In between each
    worker keeps its own model."""
    r0, r1 = (r[name] for r in results)
    theta = {n: r0["init"][n].double() for n in TRAINABLE}
    v: dict[str, torch.Tensor | None] = {n: None for n in TRAINABLE}
    for t, (a, b) in enumerate(zip(r0["steps"], r1["steps"])):
        if (t + 1) % 2:
            for n in TRAINABLE:
                assert torch.equal(a["after"][n], a["local"][n]), (name, t, n)
            continue
        _equal_ranks(a["after"], b["after"], TRAINABLE, (name, t))
        _equal_ranks(a["buffers"], b["buffers"], FLOAT_BUFFERS, (name, t))
        for n in TRAINABLE:
            delta = theta[n] - _mean([a["local"][n], b["local"][n]])
            ref, v[n] = _outer(theta[n], v[n], delta)
            # low precision: theta, Delta and the momentum are rounded to the parameter's dtype
            low = a["after"][n].dtype
            _close(a["after"][n], ref, (name, t, n), ulps=8,
                   extra=0.0 if low == F64 else 4 * torch.finfo(low).eps * float(delta.abs().max()))
            theta[n] = a["after"][n].double()  # step-wise: the next outer step starts from the code's theta
        for n in FLOAT_BUFFERS:
            _close(a["buffers"][n], _mean([a["local_buffers"][n], b["local_buffers"][n]]), (name, t, n))


def test_streaming_diloco_fragments_by_their_formula(results: list[dict]) -> None:
    """2 fragments, overlap 1, alpha 0.5: the fragments partition the
    trainable parameters (the tied one once); the fragment launched at step t
    (Delta = theta_p - mean_i x_i(t)) is merged at t + 1: the outer step,
    then x_p <- x_p + 0.5 (theta_p - x_p); buffers travel with the fragment
    launched at offset 0 (the mean of the ranks' at its launch)."""
    r0, r1 = (r["streaming"] for r in results)
    frags, launch_at = r0["frags"], r0["launch_at"]
    assert sorted(n for f in frags for n in f) == sorted(TRAINABLE)
    theta = {n: r0["init"][n].double() for n in TRAINABLE}
    v: dict[str, torch.Tensor | None] = {n: None for n in TRAINABLE}
    pending: tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor] | None] | None = None
    for t, (a, b) in enumerate(zip(r0["steps"], r1["steps"])):
        step = t + 1
        merged: set[str] = set()
        if pending is not None:
            frag, deltas, bufs = pending
            for n in frags[frag]:
                theta[n], v[n] = _outer(theta[n], v[n], deltas[n])
                for res in (a, b):
                    local = res["local"][n].double()
                    _close(res["after"][n], local + 0.5 * (theta[n] - local), ("streaming", t, n))
                merged.add(n)
            for n in FLOAT_BUFFERS:
                want = bufs[n] if bufs is not None else None
                for res in (a, b):
                    if want is not None:
                        _close(res["buffers"][n], want, ("streaming buffers", t, n))
                    else:
                        assert torch.equal(res["buffers"][n], res["local_buffers"][n]), ("streaming", t, n)
        for n in TRAINABLE:
            if n not in merged:
                for res in (a, b):
                    assert torch.equal(res["after"][n], res["local"][n]), ("streaming", t, n)
        frag = launch_at[step % 2]
        deltas = {n: theta[n] - _mean([a["local"][n], b["local"][n]]) for n in frags[frag]}
        bufs = ({n: _mean([a["local_buffers"][n], b["local_buffers"][n]]) for n in FLOAT_BUFFERS}
                if step % 2 == 0 else None)
        pending = (frag, deltas, bufs)


def test_diloco_topk_restarts_every_replica_from_theta(results: list[dict]) -> None:
    r0, r1 = (r["diloco_topk"] for r in results)
    for t, (a, b) in enumerate(zip(r0["steps"], r1["steps"])):
        if (t + 1) % 2 == 0:
            _equal_ranks(a["after"], b["after"], TRAINABLE, ("diloco_topk", t))
            _equal_ranks(a["buffers"], b["buffers"], FLOAT_BUFFERS, ("diloco_topk", t))


def test_select_model_with_two_dtypes_is_refused_naming_the_field(results: list[dict]) -> None:
    for r in results:
        msg = r["refuse_select_model"]
        assert "'select'" in msg and "2 dtypes" in msg and "allowed: select=tensor" in msg, msg
