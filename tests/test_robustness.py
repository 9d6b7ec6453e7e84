"""Robustness of the DDP hook (gloo, 2 and 3 workers).

Invariants held here (docs/guarantees.md lists them one per line):

* checkpoint/resume is bit-identical for every stateful path (residuals,
  PowerSGD factors, DGC/SIDCo/AdaComp/Signum state, shared-seed random-k, the
  ring's and the parameter server's own residuals), the hook's state dict
  loads with ``torch.load(weights_only=True)`` and does not alias live state;
  a state of another world size, compressor or strategy is refused by name;
* a NaN/Inf on one rank is handled alike on every rank (``skip``,
  ``raise``, ``propagate``) and never reaches a residual;
* DDP features: ``no_sync`` accumulation, ``find_unused_parameters``,
  ``static_graph``, frozen parameters, several parameter dtypes;
* mixed precision: bf16 autocast, a bf16 model, fp16 autocast with
  ``GradScaler`` (one rank overflowing), an fp16 model;
* a dead or stuck peer makes the survivor raise within the hook's timeout;
* the extra memory per compressed element (one fp32 residual for error
  feedback, PowerSGD's Q factors, Signum's momentum).
"""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from distributed import fault_entry, run_until_rank0_reports, run_workers
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress

MIN_NUMEL = 64
BUCKET_MB = 0.004  # several buckets on the small model
TOPK = "topk:ratio=0.05"


def make_model(seed: int = 1234) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 32), nn.Tanh(), nn.Linear(32, 3)
    )


def make_data(rank: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, 24, generator=gen)
    w = torch.randn(24, 3, generator=torch.Generator().manual_seed(7))
    return x, torch.tanh(x @ w)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def compressed_numel(model: nn.Module) -> int:
    """Elements of the parameters the hook compresses (2-D, >= MIN_NUMEL)."""
    return sum(p.numel() for p in model.parameters() if p.dim() > 1 and p.numel() >= MIN_NUMEL)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.float() - y) ** 2).mean()


def same_state(a, b) -> bool:  # noqa: ANN001
    """Deep, bit-exact equality of two state dicts."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


def nonzero(obj) -> bool:  # noqa: ANN001
    """Whether some tensor in a (nested) state dict has a non-zero entry."""
    if isinstance(obj, torch.Tensor):
        return bool(obj.count_nonzero()) if obj.numel() else False
    if isinstance(obj, dict):
        return any(nonzero(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(nonzero(v) for v in obj)
    return False


# ------------------------------------------------------- 1. checkpoint/resume
RESUME_CASES = [
    (TOPK, "collective"),
    ("powersgd:rank=2,start_iter=2", "collective"),
    ("dgc:ratio=0.05", "collective"),
    ("sidco:ratio=0.05", "collective"),
    ("adacomp", "collective"),
    ("signum", "collective"),
    ("randomk:ratio=0.25", "collective"),
    (TOPK, "ring"),
    (TOPK, "ps"),
    (TOPK, "union"),
    ("qsgd", "ps"),  # with error feedback: the roots' re-compression residuals are not zero
]
#: registration keywords per (spec, strategy) besides the defaults
EXTRA_KW: dict[tuple[str, str], dict] = {("qsgd", "ps"): {"error_feedback": True}}


def _session(rank: int, spec: str, strategy: str, model: nn.Module | None = None):  # noqa: ANN202
    model = model if model is not None else make_model()
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    kw = EXTRA_KW.get((spec, strategy), {})
    hook = gradpress.ddp.register(ddp, spec, strategy=strategy, min_numel=MIN_NUMEL, **kw)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    return model, ddp, hook, opt


def _sgd_step(ddp: DDP, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    opt.zero_grad()
    loss = mse(ddp(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def _parts(hook_state: dict) -> dict:
    """The hook state by owner: the worker's residuals ("memory"), the
    compressor's state, and the strategies' (their residuals live in the
    one feedback store under the ring/ and root/ namespaces)."""
    residuals = hook_state["feedback"]["residuals"]
    strategy_keys = {k for k in residuals if k.startswith(("ring/", "root/"))}
    return {
        "memory": {k: v for k, v in residuals.items() if k not in strategy_keys},
        "compressor": hook_state["compressor"],
        "strategies": [hook_state["strategies"], {k: residuals[k] for k in strategy_keys}],
    }


def _resume(rank: int, world: int) -> dict:
    x, y = make_data(rank)
    out = {}
    for spec, strategy in RESUME_CASES:
        case = f"{spec}@{strategy}"
        model, ddp, hook, opt = _session(rank, spec, strategy)
        for _ in range(6):
            _sgd_step(ddp, opt, x, y)
        live = hook.state_dict()  # kept as returned: must not alias the hook's live state
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": live}, buf)
        cont = [_sgd_step(ddp, opt, x, y) for _ in range(6)]
        params_cont = flat_params(model)
        steps_cont = hook.stats["steps"]
        hook.close()

        buf.seek(0)
        ckpt = torch.load(buf, weights_only=True)  # what torch.load does by default
        model2 = make_model(seed=999)  # different init: everything must come from the checkpoint
        model2.load_state_dict(ckpt["model"])
        _, ddp2, hook2, opt2 = _session(rank, spec, strategy, model2)
        hook2.load_state_dict(ckpt["hook"])
        opt2.load_state_dict(ckpt["opt"])
        resumed = [_sgd_step(ddp2, opt2, x, y) for _ in range(6)]
        out[case] = {
            "cont": cont, "resumed": resumed, "params_cont": params_cont, "params_resumed": flat_params(model2),
            "steps": (steps_cont, hook2.stats["steps"]), "not_aliased": same_state(live, ckpt["hook"]),
            "nonzero": {part for part, held in _parts(ckpt["hook"]).items() if nonzero(held)},
        }
        hook2.close()
        if spec == TOPK:
            out[case]["saved"] = ckpt["hook"]

    # a state of another compressor, or another strategy, is refused by name
    refusals = {}
    saved = out[f"{TOPK}@collective"]["saved"]
    for label, (spec, strategy) in {"compressor": ("qsgd", "collective"), "strategy": (TOPK, "ring")}.items():
        _, _, hook, _ = _session(rank, spec, strategy)
        try:
            hook.load_state_dict(saved)
            refusals[label] = "accepted"
        except ValueError as exc:
            refusals[label] = str(exc)
        hook.close()
    out["refusals"] = refusals
    return out


#: where each compressor keeps the state the resume test is about (else: the hook's residuals)
#: (with two workers a PS root re-encodes two top-k packets at twice the density: nothing
#: is dropped, its residual stays zero; topk-ps checks the hook residuals and the roots)
STATE_PART: dict = {"powersgd": "compressor", "dgc": "compressor", "adacomp": "compressor", "signum": "compressor",
                    (TOPK, "ring"): "strategies", ("qsgd", "ps"): "strategies"}


@pytest.fixture(scope="module")
def resume_results() -> list[dict]:
    return run_workers(_resume, 2)


@pytest.mark.parametrize("spec,strategy", RESUME_CASES, ids=[f"{s.split(':')[0]}-{t}" for s, t in RESUME_CASES])
def test_resume_is_bit_identical(resume_results: list[dict], spec: str, strategy: str) -> None:
    case = f"{spec}@{strategy}"
    for rank, res in enumerate(resume_results):
        r = res[case]
        part = STATE_PART.get((spec, strategy)) or STATE_PART.get(spec.split(":")[0], "memory")
        assert part in r["nonzero"], f"{case}: its {part} state is empty or zero, the test would prove nothing"
        assert r["not_aliased"], f"{case} rank {rank}: state_dict() shares tensors with the live hook state"
        assert r["cont"] == r["resumed"], f"{case} rank {rank}: losses differ after resume"
        assert torch.equal(r["params_cont"], r["params_resumed"]), f"{case} rank {rank}: params differ after resume"
        assert r["steps"] == (12, 12)
    assert torch.equal(resume_results[0][case]["params_resumed"], resume_results[1][case]["params_resumed"])


def test_resume_refuses_other_compressor_or_strategy(resume_results: list[dict]) -> None:
    for res in resume_results:
        ref = res["refusals"]
        assert "compressor" in ref["compressor"] and "qsgd" in ref["compressor"], ref["compressor"]
        assert "strategy" in ref["strategy"] and "ring" in ref["strategy"], ref["strategy"]


def _other_world(rank: int, saved: dict) -> str:
    _, _, hook, _ = _session(rank, TOPK, "collective")
    try:
        hook.load_state_dict(saved)
        return "accepted"
    except ValueError as exc:
        return str(exc)
    finally:
        hook.close()


def _three_workers(rank: int, world: int, saved: dict) -> dict:
    """The checks that need a third worker, in one spawn."""
    return {"other_world": _other_world(rank, saved), "uncompressed": _nonfinite_uncompressed(rank)}


@pytest.fixture(scope="module")
def three_worker_results(resume_results: list[dict]) -> list[dict]:
    saved = resume_results[0][f"{TOPK}@collective"]["saved"]
    assert saved["config"]["world_size"] == 2
    return run_workers(_three_workers, 3, saved)


def test_resume_refuses_other_world_size(three_worker_results: list[dict]) -> None:
    for res in three_worker_results:
        msg = res["other_world"]
        assert "world_size" in msg and "2" in msg and "3" in msg, msg


# ------------------------------------------------------ 2. non-finite gradients
BAD_STEP = 3
NF_STEPS = 7


def _own_state(hook: gradpress.ddp.GradpressHook) -> dict:
    """What the compressor and the strategies keep: their own state and the
    strategies' residuals (ring hops, PS roots), which live in the one
    feedback store beside the worker's own residuals."""
    sd = hook.state_dict()
    worker = hook.memory.namespace("")
    strategy_residuals = {k: v for k, v in sd["feedback"]["residuals"].items() if k not in worker}
    return {"compressor": sd["compressor"], "strategies": sd["strategies"], "strategy_residuals": strategy_residuals}


def _nan_run(rank: int, mode: str, min_numel: int = MIN_NUMEL, spec: str = TOPK, strategy: str = "collective") -> dict:
    """Rank 1's ``2.weight`` gradient gets one NaN at BAD_STEP."""
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    kw = EXTRA_KW.get((spec, strategy), {})
    hook = gradpress.ddp.register(ddp, spec, strategy=strategy, min_numel=min_numel, nonfinite=mode, **kw)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    x, y = make_data(rank)
    step = {"i": 0}

    def inject(g: torch.Tensor) -> torch.Tensor:
        if rank == 1 and step["i"] == BAD_STEP:
            g = g.clone()
            g.view(-1)[5] = float("nan")
        return g

    model[2].weight.register_hook(inject)
    rec: dict = {"skipped": [], "grads_finite": [], "residuals_kept": [], "state_kept": [], "losses": [], "error": None}
    for i in range(NF_STEPS):
        step["i"] = i
        before = {k: v.clone() for k, v in hook.memory.residuals.items()}
        state_before = _own_state(hook)
        opt.zero_grad()
        loss = mse(ddp(x), y)
        try:
            loss.backward()
        except Exception as exc:  # noqa: BLE001
            rec["error"] = (i, f"{type(exc).__name__}: {exc}")
            break
        after = hook.memory.residuals
        rec["residuals_kept"].append(bool(before) and before.keys() == after.keys()
                                     and all(torch.equal(before[k], after[k]) for k in before))
        rec["state_kept"].append(same_state(state_before, _own_state(hook)))
        rec["skipped"].append(hook.last_step_skipped)
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
        rec["grads_finite"].append(finite)
        if not hook.last_step_skipped and finite:  # what a GradScaler / careful loop does
            opt.step()
        rec["losses"].append(loss.item())
    rec["stats"] = hook.stats
    rec["params"] = flat_params(model)
    hook.close()
    return rec


STATEFUL_SKIP = [("dgc:ratio=0.05", "collective"), ("signum", "collective"), (TOPK, "ring"), ("qsgd", "ps")]


def _nonfinite(rank: int, world: int) -> dict:
    out: dict = {mode: _nan_run(rank, mode) for mode in ("skip", "propagate", "raise")}
    for spec, strategy in STATEFUL_SKIP:
        out[(spec, strategy)] = _nan_run(rank, "skip", spec=spec, strategy=strategy)
    return out


@pytest.fixture(scope="module")
def nonfinite_results() -> list[dict]:
    return run_workers(_nonfinite, 2)


def test_nonfinite_skip_drops_the_step_on_every_rank(nonfinite_results: list[dict]) -> None:
    expected = [i == BAD_STEP for i in range(NF_STEPS)]
    for rank, res in enumerate(nonfinite_results):
        r = res["skip"]
        assert r["error"] is None, r["error"]
        assert r["skipped"] == expected, f"rank {rank}: last_step_skipped {r['skipped']}"
        assert r["stats"]["skipped_steps"] == 1 and r["stats"]["nonfinite_steps"] == 1, r["stats"]
        # residuals change every step (top-k drops something) except the skipped one
        assert r["residuals_kept"][1:] == expected[1:], f"rank {rank}: residuals {r['residuals_kept']}"
        assert r["grads_finite"] == [True] * NF_STEPS, "skip must hand back finite (zeroed) gradients"
        assert torch.isfinite(r["params"]).all()
        assert all(map(lambda v: v == v, r["losses"])) and r["losses"][-1] < r["losses"][0]
    assert torch.equal(nonfinite_results[0]["skip"]["params"], nonfinite_results[1]["skip"]["params"])


def test_nonfinite_propagate_reaches_every_rank(nonfinite_results: list[dict]) -> None:
    expected = [i == BAD_STEP for i in range(NF_STEPS)]
    for rank, res in enumerate(nonfinite_results):
        r = res["propagate"]
        assert r["error"] is None, r["error"]
        assert r["grads_finite"] == [not e for e in expected], f"rank {rank}: finite grads {r['grads_finite']}"
        assert r["residuals_kept"][1:] == expected[1:], f"rank {rank}: residuals {r['residuals_kept']}"
        assert r["skipped"] == [False] * NF_STEPS
        assert r["stats"]["nonfinite_steps"] == 1 and r["stats"]["skipped_steps"] == 0, r["stats"]
        assert torch.isfinite(r["params"]).all()
    assert torch.equal(nonfinite_results[0]["propagate"]["params"], nonfinite_results[1]["propagate"]["params"])


def test_nonfinite_raise_fails_on_every_rank_naming_the_parameter(nonfinite_results: list[dict]) -> None:
    for rank, res in enumerate(nonfinite_results):
        err = res["raise"]["error"]
        assert err is not None, f"rank {rank} did not raise"
        step, msg = err
        assert step == BAD_STEP
        assert "2.weight" in msg and "non-finite" in msg, msg
        assert msg.startswith("FloatingPointError: gradpress"), f"documented type, not DDP's wrapping: {msg}"


@pytest.mark.parametrize("spec,strategy", STATEFUL_SKIP, ids=[f"{s.split(':')[0]}-{t}" for s, t in STATEFUL_SKIP])
def test_nonfinite_skip_keeps_compressor_and_strategy_state(nonfinite_results: list[dict], spec: str, strategy: str) -> None:
    """A skipped step leaves no trace: neither the compressor's own state
    (DGC's accumulators, Signum's momentum) nor the strategies' residuals
    (ring, ps) may absorb the gradients of a step that is dropped."""
    expected = [i == BAD_STEP for i in range(NF_STEPS)]
    for rank, res in enumerate(nonfinite_results):
        r = res[(spec, strategy)]
        assert r["error"] is None, r["error"]
        assert r["skipped"] == expected, f"rank {rank}: last_step_skipped {r['skipped']}"
        assert r["state_kept"][1:] == expected[1:], f"{spec}@{strategy} rank {rank}: state kept per step {r['state_kept']}"
    assert torch.equal(nonfinite_results[0][(spec, strategy)]["params"], nonfinite_results[1][(spec, strategy)]["params"])


def _nonfinite_uncompressed(rank: int) -> dict:
    # nothing is compressed (every tensor below min_numel): what "auto" does on a fast link
    return {mode: _nan_run(rank, mode, min_numel=10**9) for mode in ("skip", "raise")}


def test_nonfinite_modes_hold_when_nothing_is_compressed(three_worker_results: list[dict]) -> None:
    """``skip``/``raise`` must not depend on whether the planner compressed the
    bucket: a skipped step that is not reported lets NaN into the parameters."""
    expected = [i == BAD_STEP for i in range(NF_STEPS)]
    problems = []
    for rank, res in enumerate(r["uncompressed"] for r in three_worker_results):
        if res["skip"]["skipped"] != expected:
            problems.append(f"rank {rank} skip: last_step_skipped {res['skip']['skipped']}")
        if not torch.isfinite(res["skip"]["params"]).all():
            problems.append(f"rank {rank} skip: non-finite parameters")
        err = res["raise"]["error"]
        if err is None or err[0] != BAD_STEP or "2.weight" not in err[1] or not err[1].startswith("FloatingPointError"):
            problems.append(f"rank {rank} raise: {err}")
    assert not problems, "; ".join(problems)


# ------------------------------------------------------------ 3. DDP features
class Branchy(nn.Module):
    """A trunk plus a branch that is skipped on some steps (on some ranks)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4321)
        self.trunk = nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 3))
        self.branch = nn.Linear(24, 3)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        out = self.trunk(x)
        return out + self.branch(x) if use_branch else out


class TwoDtypes(nn.Module):
    """An fp64 first layer and fp32 layers: DDP buckets them separately."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(55)
        self.first = nn.Linear(24, 48).double()
        self.rest = nn.Sequential(nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(self.first(x.double()).float())


def _train_feature(rank: int, spec: str, feature: str) -> dict:
    x, y = make_data(rank)
    kw: dict = {"bucket_cap_mb": BUCKET_MB}
    if feature == "unused":
        model: nn.Module = Branchy()
        kw["find_unused_parameters"] = True
    elif feature == "dtypes":
        model = TwoDtypes()
    else:
        model = make_model()
    if feature == "static_graph":
        kw["static_graph"] = True
    if feature == "frozen":
        for p in model[2].parameters():
            p.requires_grad_(False)
    frozen_before = model[2].weight.detach().clone() if feature == "frozen" else None
    ddp = DDP(model, **kw)
    hook = gradpress.ddp.register(ddp, spec, strategy="collective", min_numel=MIN_NUMEL)
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.05)
    losses = []
    steps = 6
    for i in range(steps):
        opt.zero_grad()
        if feature == "accumulation":
            micro = x.chunk(3)
            targets = y.chunk(3)
            with ddp.no_sync():
                for xm, ym in zip(micro[:2], targets[:2]):
                    mse(ddp(xm), ym).div(3).backward()
            loss = mse(ddp(micro[2]), targets[2]).div(3)
            loss.backward()
        elif feature == "unused":
            # step 0 mod 3: branch unused everywhere; 1 mod 3: unused on rank 1 only
            use = not (i % 3 == 0 or (i % 3 == 1 and rank == 1))
            loss = mse(ddp(x, use), y)
            loss.backward()
        else:
            loss = mse(ddp(x), y)
            loss.backward()
        opt.step()
        losses.append(loss.item())
    out = {"losses": losses, "params": flat_params(model), "stats": hook.stats, "steps": steps}
    if frozen_before is not None:
        out["frozen_kept"] = torch.equal(frozen_before, model[2].weight)
    hook.close()
    return out


FEATURES = ("accumulation", "unused", "static_graph", "frozen", "dtypes")
FEATURE_SPECS = (TOPK, "qsgd")


def _ddp_features(rank: int, world: int) -> dict:
    return {(spec, f): _train_feature(rank, spec, f) for spec in FEATURE_SPECS for f in FEATURES}


@pytest.fixture(scope="module")
def feature_results() -> list[dict]:
    return run_workers(_ddp_features, 2, allow_errors=False)


@pytest.mark.parametrize("feature", FEATURES)
def test_ddp_features_keep_replicas_identical(feature_results: list[dict], feature: str) -> None:
    for spec in FEATURE_SPECS:
        a, b = (res[(spec, feature)] for res in feature_results)
        assert torch.equal(a["params"], b["params"]), f"{feature} with {spec}: replicas diverged"
        for r in (a, b):
            assert all(torch.isfinite(torch.tensor(r["losses"]))), r["losses"]
            # accumulation: the two no_sync micro-batches never reach the hook
            assert r["stats"]["steps"] == r["steps"], f"{feature} with {spec}: {r['stats']['steps']} hook steps"
            assert r["stats"]["compressed_tensors"] >= 1, f"{feature} with {spec}: nothing was compressed"
            if feature == "frozen":
                assert r["frozen_kept"]
        # "unused" changes the model from step to step: compare steps 0 and 3 (branch unused on every rank)
        last = 3 if feature == "unused" else -1
        assert a["losses"][last] < a["losses"][0], f"{feature} with {spec}: loss did not fall {a['losses']}"


# ----------------------------------------------------------- 4. mixed precision
def _train_mixed(rank: int, spec: str, mode: str) -> dict:
    x, y = make_data(rank)
    model = make_model()
    if mode == "bf16_model":
        model = model.to(torch.bfloat16)
    elif mode == "fp16_model":
        model = model.to(torch.float16)
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    hook = gradpress.ddp.register(ddp, spec, strategy="collective", min_numel=MIN_NUMEL)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) if mode == "fp16_scaler" else None
    losses, scales = [], []
    for i in range(6):
        opt.zero_grad()
        xi = x
        if mode == "bf16_autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = ddp(xi)
        elif mode == "fp16_scaler":
            if rank == 1 and i == 2:
                xi = x * 1e5  # only rank 1 overflows in fp16 at this step
            with torch.autocast("cpu", dtype=torch.float16):
                out = ddp(xi)
        else:
            out = ddp(xi.to(next(model.parameters()).dtype))
        loss = mse(out, y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            loss.backward()
            opt.step()
        losses.append(loss.item())
    grad_dtype = str(next(model.parameters()).grad.dtype)
    out = {"losses": losses, "scales": scales, "params": flat_params(model), "grad_dtype": grad_dtype,
           "stats": hook.stats}
    hook.close()
    return out


MIXED_MODES = ("bf16_autocast", "bf16_model", "fp16_scaler", "fp16_model")
MIXED_SPECS = (TOPK, "qsgd", "fp16")
#: torch 2.2.2 has no device-generic ``torch.amp.GradScaler`` (only CUDA's): no CPU loss scaling to test there
HAS_CPU_SCALER = hasattr(torch.amp, "GradScaler")


def _mixed(rank: int, world: int) -> dict:
    modes = [m for m in MIXED_MODES if m != "fp16_scaler" or HAS_CPU_SCALER]
    return {(spec, m): _train_mixed(rank, spec, m) for spec in MIXED_SPECS for m in modes}


@pytest.fixture(scope="module")
def mixed_results() -> list[dict]:
    return run_workers(_mixed, 2)


@pytest.mark.parametrize("mode", MIXED_MODES)
def test_mixed_precision_trains_with_identical_replicas(mixed_results: list[dict], mode: str) -> None:
    if mode == "fp16_scaler" and not HAS_CPU_SCALER:
        pytest.skip("this torch has no torch.amp.GradScaler for CPU")
    want_dtype = {"bf16_model": "torch.bfloat16", "fp16_model": "torch.float16"}.get(mode, "torch.float32")
    for spec in MIXED_SPECS:
        a, b = (res[(spec, mode)] for res in mixed_results)
        assert torch.equal(a["params"], b["params"]), f"{mode} with {spec}: replicas diverged"
        for r in (a, b):
            assert r["grad_dtype"] == want_dtype
            assert r["stats"]["compressed_tensors"] >= 1
            assert torch.isfinite(r["params"]).all()
            # the loss of the overflow step itself may be inf; every other one is finite
            finite = [v for i, v in enumerate(r["losses"]) if not (mode == "fp16_scaler" and i == 2)]
            assert all(torch.isfinite(torch.tensor(finite))), f"{mode} with {spec}: {r['losses']}"
        if mode == "fp16_scaler":
            # rank 1's overflow reached rank 0 too: both scalers skipped and backed off alike
            assert a["scales"] == b["scales"], (a["scales"], b["scales"])
            assert a["scales"][2] < a["scales"][1], f"{spec}: no back-off after the overflow {a['scales']}"
        assert a["losses"][-1] < a["losses"][0], f"{mode} with {spec}: loss did not fall {a['losses']}"


# ------------------------------------------------------------------- 5. faults
FAULT_STEP = 3
HOOK_TIMEOUT = 5.0


def _fault_setup(rank: int) -> Callable[[int], None]:
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    gradpress.ddp.register(ddp, TOPK, strategy="collective", min_numel=MIN_NUMEL, timeout=HOOK_TIMEOUT)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    x, y = make_data(rank)
    return lambda i: _sgd_step(ddp, opt, x, y)


def _run_fault(how: str, deadline: float = 60.0) -> tuple[dict | None, float]:
    return run_until_rank0_reports(fault_entry, 2, (how, _fault_setup, (), FAULT_STEP, FAULT_STEP + 3), deadline)


@pytest.mark.parametrize("how", ["exit", "stuck"])
def test_dead_or_stuck_peer_makes_survivor_raise(how: str) -> None:
    result, waited = _run_fault(how)
    assert result is not None, f"rank 0 neither finished nor raised within {waited:.0f} s (peer {how})"
    assert result["error"] is not None, f"rank 0 finished {result.get('steps')} steps without its peer"
    # a dead peer is noticed at once (connection reset) or by the timeout; a stuck
    # one by the hook's timeout (5 s), not the default group's (120 s here)
    assert result["elapsed"] < HOOK_TIMEOUT + 25, f"rank 0 raised only after {result['elapsed']:.1f} s"
    if how == "stuck":
        assert result["elapsed"] >= HOOK_TIMEOUT - 0.5, f"raised after {result['elapsed']:.1f} s: not the timeout"
    assert waited < 60


# ------------------------------------------------------------------- 6. memory
MEMORY_SPECS = [
    ("none", "collective"), (TOPK, "collective"), ("qsgd", "collective"),
    ("powersgd:rank=2,start_iter=2", "collective"), ("signum", "collective"),
    ("dgc:ratio=0.05", "collective"), ("sidco:ratio=0.05", "collective"), ("adacomp", "collective"),
    ("randomk:ratio=0.25", "collective"), ("fp16", "collective"), (TOPK, "ring"), (TOPK, "ps"),
]


def _memory(rank: int, world: int) -> dict:
    x, y = make_data(rank)
    out = {}
    for spec, strategy in MEMORY_SPECS:
        model, ddp, hook, opt = _session(rank, spec, strategy)
        for _ in range(4):
            _sgd_step(ddp, opt, x, y)
        mem = hook.memory_bytes()
        out[(spec, strategy)] = {
            "mem": mem, "error_feedback": hook.error_feedback,
            "q_shapes": sorted(tuple(v.shape) for v in hook.compressor.state_dict().get("q", {}).values()),
        }
        hook.close()
    model = make_model()
    out["compressed_numel"] = compressed_numel(model)
    out["matrices"] = [tuple(p.shape) for p in model.parameters() if p.dim() > 1 and p.numel() >= MIN_NUMEL]
    return out


@pytest.fixture(scope="module")
def memory_results() -> list[dict]:
    return run_workers(_memory, 2)


def test_memory_of_error_feedback_and_compressor_state(memory_results: list[dict]) -> None:
    from gradpress.compress import create

    for res in memory_results:
        numel = res["compressed_numel"]
        dense = 4 * numel  # fp32 bytes of the compressed parameters
        assert res[("none", "collective")]["mem"]["total"] == 0
        topk = res[(TOPK, "collective")]
        assert topk["error_feedback"] and topk["mem"]["residuals"] == dense, topk["mem"]
        assert topk["mem"]["compressor"] == 0 and topk["mem"]["strategies"] == 0
        # PowerSGD keeps Q (m x r) for every matrix it factors, and a residual per compressed tensor
        psgd = res[("powersgd:rank=2,start_iter=2", "collective")]
        comp = create("powersgd:rank=2,start_iter=2")
        factored = [s for s in res["matrices"] if comp.compresses(torch.Size(s), 10)]
        want_q = sorted((s[1], min(2, s[0], s[1])) for s in factored)
        assert psgd["q_shapes"] == want_q
        assert psgd["mem"]["compressor"] == 4 * sum(m * r for m, r in want_q)
        assert psgd["mem"]["residuals"] == (dense if psgd["error_feedback"] else 0)
        # Signum: one momentum buffer per compressed tensor, no residual (no error feedback)
        signum = res[("signum", "collective")]
        assert signum["mem"]["compressor"] == dense and signum["mem"]["residuals"] == 0
        for spec in (TOPK, "qsgd", "powersgd:rank=2,start_iter=2"):
            assert res[(spec, "collective")]["mem"]["total"] <= 2 * dense, (spec, res[(spec, "collective")]["mem"])
        # documented figures (docs/guarantees.md): extra bytes per compressed element
        for key, per_elem in MEMORY_TABLE.items():
            got = res[key]["mem"]["total"] / numel
            assert got == per_elem, f"{key}: {got:.3f} bytes/element, documented {per_elem}"
    # ps: every rank keeps the hook residual, and each root a residual for the tensors it owns
    ps = [res[(TOPK, "ps")]["mem"] for res in memory_results]
    numel = memory_results[0]["compressed_numel"]
    assert all(m["residuals"] == 4 * numel for m in ps)
    assert sum(m["strategies"] for m in ps) == 4 * numel, [m["strategies"] for m in ps]


#: extra bytes kept per compressed fp32 parameter element (2 workers, default
#: error feedback of each compressor); docs/guarantees.md shows the same table.
#: powersgd (4 + 4 r / n per n x m matrix it factors) and ps (4 + 4 on the
#: root of each tensor) are checked by formula above.
MEMORY_TABLE: dict[tuple[str, str], float] = {
    ("none", "collective"): 0.0,
    (TOPK, "collective"): 4.0,          # error-feedback residual
    ("qsgd", "collective"): 0.0,        # unbiased: no error feedback by default
    ("fp16", "collective"): 0.0,
    ("randomk:ratio=0.25", "collective"): 4.0,
    ("sidco:ratio=0.05", "collective"): 4.0,
    ("signum", "collective"): 4.0,      # momentum, no error feedback
    ("adacomp", "collective"): 4.0,     # its own residual, hook error feedback off
    ("dgc:ratio=0.05", "collective"): 8.0,  # momentum u and accumulation v
    (TOPK, "ring"): 8.0,                # ring residual + a hook residual that stays zero
}
