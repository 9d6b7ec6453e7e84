"""The DDP hook with the models and DDP options users bring (2 gloo workers).

Each scenario is one model and one set of DDP options: tied weights, a
frozen layer, a branch unused on some steps (``find_unused_parameters``,
with ``gradient_as_bucket_view`` too), ``static_graph`` with a parameter
that never gets a gradient, ``gradient_as_bucket_view`` with many small
buckets, ``no_sync`` accumulation, bf16, fp16 and fp32+bf16 models, a
channels_last Conv2d model, a transposed (non-contiguous) parameter, a
zero-size parameter, one parameter larger than the bucket cap. Each runs three times on the same data: plain DDP, the
hook with ``none`` and the hook with top-k + error feedback, which saves
its state halfway (``torch.load(weights_only=True)``) and is resumed in a
fresh model, DDP and hook.

Checked against what the test computes itself:

* ``none``: every gradient (its value, dtype, strides, or None) and the
  parameters equal plain DDP's, bit for bit;
* top-k + error feedback, by the definition in float64 from each rank's own
  gradient (autograd on the bare module, same weights and data): per rank
  ``p = round_dtype(e + g)``, ``s = topk(p)`` (ties to the lower index),
  ``e <- p - s`` exactly, the gradient handed back is ``mean_r s_r``; a
  parameter used on no rank follows DDP's rule (its gradient untouched,
  None here, or DDP's own average of the bucket with
  ``gradient_as_bucket_view``) and its residual stays as it was, since
  nothing of it is delivered; a frozen parameter is never touched and has
  no residual; replicas are identical after every step;
* the resumed run's gradients, residuals and parameters equal the
  uninterrupted run's.

Also: the used-flags allreduce is in ``stats``; PowerSGD (a step's buckets
coalesced) leaves an unused parameter's state alone, and under ``static_graph``
holds no state of a parameter no rank ever uses; a state that binds
itself at the first backward warns about a parameter without gradient;
sparse gradients are refused, naming the module.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from distributed import checkpoint, run_workers
from references import topk
from test_accounting import Shim
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress

STEPS, SAVE_AT = 4, 2
RATIO = 0.25


class Tied(nn.Module):
    """An embedding tied to the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 16, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.emb(x))))


class Branch(nn.Module):
    """``b`` is used only when ``use`` (a step and rank schedule)."""

    def __init__(self, dtypes: tuple[torch.dtype, ...] = (torch.float32,) * 3) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(8, 8).to(dt) for dt in dtypes)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x.to(self.a.weight.dtype)))
        if use:
            h = h + self.b(h.to(self.b.weight.dtype)).to(h.dtype)
        return self.c(h.to(self.c.weight.dtype)).float()


class Mlp(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(8 if i == 0 else width, width) for i in range(depth)])

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        w = self.layers[0].weight
        return self.layers(x.to(w.dtype)).float()


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 4, 3)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        return self.c2(torch.tanh(self.c1(x))).mean((2, 3))


class ZeroSize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.empty = nn.Parameter(torch.zeros(0, 8))

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        return self.a(x) + self.empty.sum()


class Huge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(512, 512, bias=False)  # 1 MiB of fp32, beside a bucket cap of 0.1 MB
        self.head = nn.Linear(512, 4)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        return self.head(torch.tanh(self.big(x)))


class SparseEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8, sparse=True)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(x))


def _sparse_refusals() -> dict[str, str]:
    """The hook on a model with sparse gradients: ``register`` refuses it;
    a state that binds itself at the first backward refuses its bucket."""
    out = {}
    try:
        gradpress.ddp.register(DDP(SparseEmbedding()), "topk:ratio=0.25")
        out["register"] = "accepted"
    except ValueError as exc:
        out["register"] = str(exc)
    ddp = DDP(SparseEmbedding())
    state, fn = gradpress.ddp.make_hook("topk:ratio=0.25")
    ddp.register_comm_hook(state, fn)
    try:
        _loss(ddp(torch.randint(0, 16, (4, 5)))).backward()
        out["lazy"] = "accepted"
    except (ValueError, RuntimeError) as exc:
        out["lazy"] = str(exc)
    state.close()
    return out


def _frozen() -> nn.Module:
    model = Mlp()
    model.layers[1].requires_grad_(False)
    return model


def _transposed() -> nn.Module:
    model = Mlp()
    w = model.layers[0].weight
    model.layers[0].weight = nn.Parameter(w.detach().t().contiguous().t())  # same values, strides (1, 16)
    return model


def _static_unused() -> nn.Module:
    return Branch()  # used with use=False on every step: b never gets a gradient


# name -> (model, DDP options, input kind, schedule of ``use`` by (step, rank), extra options)
SCENARIOS: dict[str, dict] = {
    "tied": {"model": Tied, "input": "tokens"},
    "frozen": {"model": _frozen},
    # step 0 both ranks use b, step 1 none, step 2 rank 0 only, step 3 both
    "unused": {"model": Branch, "ddp": {"find_unused_parameters": True}, "use": lambda s, r: s != 1 and (s != 2 or r == 0)},
    "unused_view": {"model": Branch, "ddp": {"find_unused_parameters": True, "gradient_as_bucket_view": True},
                    "use": lambda s, r: s != 1 and (s != 2 or r == 0), "set_to_none": False},
    "static_graph": {"model": _static_unused, "ddp": {"static_graph": True}, "use": lambda s, r: False},
    "bucket_view_many_buckets": {"model": lambda: Mlp(24, 6), "ddp": {"gradient_as_bucket_view": True,
                                                                       "bucket_cap_mb": 0.001}},
    "no_sync": {"model": Mlp, "micro": 3},
    "bf16": {"model": lambda: Mlp().to(torch.bfloat16)},
    "fp16": {"model": lambda: Mlp().to(torch.float16)},
    "fp32_bf16": {"model": lambda: Branch((torch.float32, torch.bfloat16, torch.float32))},
    "channels_last": {"model": lambda: Conv().to(memory_format=torch.channels_last), "input": "image"},
    "transposed": {"model": _transposed},
    "zero_size": {"model": ZeroSize, "min_numel": 0},
    "huge": {"model": Huge, "ddp": {"bucket_cap_mb": 0.1}, "input": "wide"},
}


def _inputs(kind: str, step: int, micro: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    if kind == "tokens":
        return torch.randint(0, 16, (4, 5), generator=gen)
    if kind == "image":
        return torch.randn(2, 3, 8, 8, generator=gen).to(memory_format=torch.channels_last)
    return torch.randn(4, 512 if kind == "wide" else 8, generator=gen)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def _run(rank: int, name: str, spec: str | None, steps: range, start: dict | None = None, lazy: bool = False,
         shim: Shim | None = None) -> dict:
    """``steps`` of scenario ``name`` (``spec`` None: plain DDP). Per step:
    this rank's own gradient (float64; None where autograd gives none), the
    gradients DDP leaves, the residuals; a checkpoint after ``SAVE_AT`` steps."""
    sc = SCENARIOS[name]
    torch.manual_seed(7)
    model = sc["model"]()
    if start is not None:
        model.load_state_dict(start["model"])
    first = dist._DEFAULT_FIRST_BUCKET_BYTES
    if "bucket_cap_mb" in sc.get("ddp", {}):  # torch 2.2.2 caps only the later buckets by bucket_cap_mb
        dist._DEFAULT_FIRST_BUCKET_BYTES = int(sc["ddp"]["bucket_cap_mb"] * 2**20)
    ddp = DDP(model, **sc.get("ddp", {}))
    dist._DEFAULT_FIRST_BUCKET_BYTES = first
    hook = None
    if lazy:  # binds itself at the first backward: it does not know DDP's options
        hook, fn = gradpress.ddp.make_hook(spec, min_numel=sc.get("min_numel", 16), strategy="collective")
        ddp.register_comm_hook(hook, fn)
    elif spec is not None:
        hook = gradpress.ddp.register(ddp, spec, min_numel=sc.get("min_numel", 16), strategy="collective")
        if start is not None:
            hook.load_state_dict(start["hook"])
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=0.1)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    out: dict = {"local": [], "grads": [], "residuals": [], "strides": [], "bytes": [], "state": []}
    for step in steps:
        use = sc.get("use", lambda s, r: True)(step, rank)
        micro = [_inputs(sc.get("input", "vector"), step, m, rank) for m in range(sc.get("micro", 1))]
        # this rank's own gradient, by autograd on the bare module (DDP's hooks do not fire)
        local = None
        for x in micro:
            g = torch.autograd.grad(_loss(model(x, use)), trained, allow_unused=True)
            local = list(g) if local is None else [a if b is None else (b if a is None else a + b)
                                                   for a, b in zip(local, g)]
        out["local"].append({n: None if g is None else g.double() for n, g in zip(names, local)})
        opt.zero_grad(set_to_none=sc.get("set_to_none", True))
        before = shim.bytes if shim is not None else 0
        with shim.installed() if shim is not None else contextlib.nullcontext():
            for x in micro[:-1]:
                with ddp.no_sync():
                    _loss(ddp(x, use)).backward()
            _loss(ddp(micro[-1], use)).backward()
        if shim is not None:
            out["bytes"].append((shim.bytes - before, hook.stats["last_step_bytes"]))
        out["grads"].append(_grads(model))
        out["strides"].append({n: p.grad.stride() for n, p in model.named_parameters() if p.grad is not None})
        if hook is not None:
            out["residuals"].append({k: v.double().clone() for k, v in hook.memory.residuals.items()})
            out["state"].append(hook.state_dict())
        opt.step()
        if step + 1 == SAVE_AT and hook is not None and start is None:
            out["saved"] = checkpoint(model=model, hook=hook)
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    if hook is not None:
        out["stats"] = hook.stats
        out["config"] = hook.config()
        hook.close()
    return out


def _worker(rank: int, world: int) -> dict:
    spec = f"topk:ratio={RATIO}"
    out = {}
    for name in SCENARIOS:
        res = {"plain": _run(rank, name, None, range(STEPS)), "none": _run(rank, name, "none", range(STEPS)),
               "topk": _run(rank, name, spec, range(STEPS))}
        res["resumed"] = _run(rank, name, spec, range(SAVE_AT, STEPS), start=res["topk"].pop("saved"))
        out[name] = res
    # the branch unused on every rank at step 1: the bytes stats count, PowerSGD (a step's buckets coalesced),
    # and a state that binds itself at the first backward (it cannot know find_unused_parameters: it warns)
    out["unused_bytes"] = _run(rank, "unused", spec, range(STEPS), shim=Shim())
    out["unused_powersgd"] = _run(rank, "unused", "powersgd:rank=1,start_iter=0", range(STEPS))
    # static_graph (the other DDP option that leaves a parameter without gradient): b is used on no step
    out["static_powersgd"] = _run(rank, "static_graph", "powersgd:rank=1,start_iter=0", range(STEPS))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(rank, "unused", spec, range(STEPS), lazy=True)
    out["lazy_warnings"] = [str(w.message) for w in caught if "got no gradient" in str(w.message)]
    out["sparse"] = _sparse_refusals()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, 2)


# ------------------------------------------------------------------ reference
def _compressed(shape: torch.Size, min_numel: int) -> bool:
    return len(shape) > 1 and math.prod(shape) >= min_numel


def _spacing(dtype: torch.dtype) -> float:
    return {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_none_is_plain_ddp(results: list[dict], name: str) -> None:
    for r in results:
        plain, none = r[name]["plain"], r[name]["none"]
        for step, (want, got) in enumerate(zip(plain["grads"], none["grads"])):
            for n, g in want.items():
                assert (got[n] is None) == (g is None), f"step {step} {n}: None differs from plain DDP"
                if g is not None:
                    assert got[n].dtype == g.dtype and torch.equal(got[n], g), f"step {step} {n}"
            assert none["strides"][step] == plain["strides"][step], f"step {step}: strides"
        for n, p in plain["params"].items():
            assert torch.equal(none["params"][n], p), n


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_topk_error_feedback_follows_the_definition(results: list[dict], name: str) -> None:
    sc = SCENARIOS[name]
    min_numel = sc.get("min_numel", 16)
    runs = [r[name]["topk"] for r in results]
    plain = [r[name]["plain"] for r in results]
    names = list(runs[0]["local"][0])
    shapes = {n: p.shape for n, p in runs[0]["params"].items()}
    dtypes = {n: p.dtype for n, p in runs[0]["params"].items()}
    residual = [{n: torch.zeros(shapes[n], dtype=torch.float64) for n in names} for _ in runs]
    for step in range(STEPS):
        for n in names:
            local = [run["local"][step][n] for run in runs]
            used = [g is not None for g in local]
            g = [x if x is not None else torch.zeros(shapes[n], dtype=torch.float64) for x in local]
            got = [run["grads"][step][n] for run in runs]
            assert (got[0] is None) == (got[1] is None) and (got[0] is None or torch.equal(got[0], got[1])), \
                f"step {step} {n}: replicas differ"
            where = f"{name} step {step} {n}"
            if not any(used):  # DDP's rule: as plain DDP leaves it; nothing delivered, the residual stays
                want = plain[0]["grads"][step][n]
                assert (got[0] is None) == (want is None) and (want is None or torch.equal(got[0], want)), where
            else:
                if _compressed(shapes[n], min_numel):
                    ps = [(e[n] + x).to(dtypes[n]).double() for e, x in zip(residual, g)]
                    sent = [topk(p, RATIO) for p in ps]  # ties to the lower index
                    for e, p, s in zip(residual, ps, sent):
                        e[n] = p - s
                else:  # a plain average
                    sent = g
                want = sum(sent) / len(sent)
                assert got[0] is not None and got[0].dtype == dtypes[n], where
                err = (got[0].double() - want).abs().max().item() if want.numel() else 0.0
                tol = 4 * _spacing(dtypes[n]) * (want.abs().max().item() if want.numel() else 0.0)
                assert err <= tol, f"{where}: {err} from the reference (tolerance {tol})"
                assert runs[0]["strides"][step][n] == plain[0]["strides"][step][n], f"{where}: strides"
            if _compressed(shapes[n], min_numel):
                for rank, run in enumerate(runs):
                    have = run["residuals"][step].get(n, torch.zeros(shapes[n], dtype=torch.float64))
                    assert torch.equal(have, residual[rank][n]), f"{where} rank {rank}: residual"
    for n in names:
        assert torch.equal(runs[0]["params"][n], runs[1]["params"][n]), f"{name} {n}: replicas diverged"


def test_frozen_parameters_are_untouched_and_have_no_state(results: list[dict]) -> None:
    torch.manual_seed(7)
    before = dict(_frozen().named_parameters())
    for r in results:
        for run in ("none", "topk", "resumed"):
            for n in ("layers.1.weight", "layers.1.bias"):
                assert torch.equal(r["frozen"][run]["params"][n], before[n].detach()), f"{run} {n}"
        keys = [k for k, *_ in r["frozen"]["topk"]["config"]["parameters"]]
        assert "layers.1.weight" not in keys and "layers.1.bias" not in keys
        assert not any(k.startswith("layers.1.") for k in r["frozen"]["topk"]["residuals"][-1])


def test_tied_weights_have_one_key(results: list[dict]) -> None:
    for r in results:
        keys = [k for k, *_ in r["tied"]["topk"]["config"]["parameters"]]
        assert keys.count("emb.weight") == 1 and "out.weight" not in keys


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_resume_continues_bit_identically(results: list[dict], name: str) -> None:
    for r in results:
        full, resumed = r[name]["topk"], r[name]["resumed"]
        for i, step in enumerate(range(SAVE_AT, STEPS)):
            for n, g in full["grads"][step].items():
                h = resumed["grads"][i][n]
                assert (g is None) == (h is None) and (g is None or torch.equal(g, h)), f"step {step} {n}"
            assert full["residuals"][step].keys() == resumed["residuals"][i].keys()
            for k, v in full["residuals"][step].items():
                assert torch.equal(resumed["residuals"][i][k], v), f"step {step} residual {k}"
        for n, p in full["params"].items():
            assert torch.equal(resumed["params"][n], p), n
        assert resumed["stats"]["steps"] == full["stats"]["steps"] == STEPS


def test_unused_parameter_flags_are_counted_in_the_stats(results: list[dict]) -> None:
    """With find_unused_parameters the hook allreduces one flag per
    compressed tensor and call: ``last_step_bytes`` is what the collectives
    were handed, step by step."""
    for r in results:
        for step, (handed, reported) in enumerate(r["unused_bytes"]["bytes"]):
            assert handed > 0 and reported == handed, f"step {step}: stats say {reported}, handed {handed}"


def test_coalesced_powersgd_leaves_a_parameter_unused_everywhere_alone(results: list[dict]) -> None:
    """PowerSGD (a step's buckets in one call): at step 1, where no rank uses
    ``b``, its gradient stays None and its residual and Q factor do not move."""
    for r in results:
        run = r["unused_powersgd"]
        before, after = run["state"][0], run["state"][1]
        assert run["grads"][1]["b.weight"] is None
        assert torch.equal(after["feedback"]["residuals"]["b.weight"], before["feedback"]["residuals"]["b.weight"])
        assert torch.equal(after["compressor"]["q"]["b.weight"], before["compressor"]["q"]["b.weight"])
        assert not torch.equal(after["feedback"]["residuals"]["a.weight"], before["feedback"]["residuals"]["a.weight"])
    assert all(torch.equal(results[0]["unused_powersgd"]["params"][n], p)
               for n, p in results[1]["unused_powersgd"]["params"].items())


def test_static_graph_compresses_nothing_of_a_parameter_no_rank_ever_uses(results: list[dict]) -> None:
    """With ``static_graph`` (as with ``find_unused_parameters``) the hook
    knows which parameters got a gradient: ``b``, used on no rank at any
    step, is averaged plain (DDP's rule), so PowerSGD never holds a factor or
    a residual of it. Reading ``find_unused_parameters`` alone (static_graph
    ignored) compressed its zeros: a Q factor and a residual appeared (the
    plants3 session's planted bug, unnoticed before)."""
    for r in results:
        run = r["static_powersgd"]
        for step, state in enumerate(run["state"]):
            assert run["grads"][step]["b.weight"] is None
            assert "b.weight" not in state["compressor"]["q"], f"step {step}: a PowerSGD factor of the unused b"
            assert "b.weight" not in state["feedback"]["residuals"], f"step {step}: a residual of the unused b"
            assert "a.weight" in state["compressor"]["q"] and "a.weight" in state["feedback"]["residuals"]


def test_a_state_that_binds_itself_warns_about_a_parameter_without_gradient(results: list[dict]) -> None:
    for r in results:
        assert len(r["lazy_warnings"]) == 1, r["lazy_warnings"]
        assert "param" in r["lazy_warnings"][0] and "state.bind(ddp)" in r["lazy_warnings"][0]


def test_sparse_gradients_are_refused_naming_the_module(results: list[dict]) -> None:
    for r in results:
        assert "sparse gradients are not supported: emb has sparse=True; use sparse=False" in r["sparse"]["register"]
        assert "sparse gradients are not supported" in r["sparse"]["lazy"] and "sparse=False" in r["sparse"]["lazy"]
