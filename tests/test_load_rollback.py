"""A ``load_state_dict`` that fails part-way leaves the object exactly as it was, and usable: the DDP hook
and the algorithms that own state, one spawn of 2 gloo workers, about 30 s.

Each case runs an object ``a`` and its twin ``b`` (same model, data and seed) for 3 steps, ``a`` having
saved its state (through ``torch.save`` / ``torch.load(weights_only=True)``) after its first step, so that
the saved state differs from the live one in every part (residuals, compressor and strategy state,
counters, anchors, momenta...). That state, broken in a part the load reaches only after others have
loaded (the PS strategy's state after the residuals and the compressor's; the stats, the engine's last
part; an algorithm's extra state after the engine's; inside the extra state, a tensor of the wrong shape
after the earlier ones were copied, a truncated list after the tensors were set), is loaded into ``a``:
``ValueError`` naming the part and "nothing was loaded"; ``a``'s ``state_dict()`` then equals the one
taken before the load (every tensor bitwise and of the same dtype, every counter, the step, the loss
scale), so do its parameters, the hook stays bound; and the next 2 steps of ``a`` and ``b`` give
bit-identical parameters and states. An unbound hook keeps the state it was given to load at binding when
a later load is refused. The stats' counters are checked at the load: ``"steps": "x"`` or a float byte count in
``tensor_bytes`` is refused naming the key, the value and what is allowed, and rolled back. An unbound hook
whose pending state does not load as it binds (rank 1's saved by rank 0), through ``bind`` or at the first
backward, fails on every rank (rank 0's loads: the ranks agree) and stays unbound with that state; loaded a
fitting one, it binds with it. A state loaded on rank 0 only binds on both (the agreement runs on every rank).

The model is loaded from the same checkpoint before the failed load, as a resumed run does (SGP's load
sets the parameters to ``x / w``: a failed one must leave them as loaded). LGC's broken state sets
``frozen`` before failing: the autoencoder must stay trainable.

A case that raises is reported by its own test (``crash``); the others still run.

Planted: the rollback's restore removed (``Rollback.__exit__`` re-raising without ``restore``): all 14
cases of the hook and the algorithms fail (the unbound hook's passes: nothing is loaded there); SGP's
``load_touches`` returning nothing: its case fails (``params[0]: values differ``); LGC's load freezing
only one way (the code before): its case crashes at the next step (the frozen autoencoder has no grad).
The stats loaded unchecked (``check_counters`` not called): ``hook_stats_steps`` loads and crashes at the next
step (``TypeError: can only concatenate str``), ``hook_stats_tensor_bytes`` loads. The hook bound to the new
engine before the pending state loads (the code before): the unbound-refused test fails (``bound`` True).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from distributed import checkpoint, run_workers
from state_diff import diff as _diff
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
import gradpress.algorithms as algorithms

WORLD = 2
F64 = torch.float64
STEPS_BEFORE, STEPS_AFTER = 3, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).to(F64)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(5, 6, generator=g, dtype=F64)
    return x, torch.sin(x[:, :3])


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]






def _broken_load(obj: Any, saved: dict, corrupt: Callable[[dict], None], model: nn.Module) -> dict[str, Any]:
    """Load ``saved`` broken by ``corrupt`` into ``obj`` (an algorithm or a hook): the error, whether ``saved``
    differs from ``obj``'s state before the load, and where the state and ``model``'s parameters after it
    differ from before (None: nowhere); ``twin`` to fill with the steps after."""
    before, params = copy.deepcopy(obj.state_dict()), _params(model)
    broken = copy.deepcopy(saved)
    corrupt(broken)
    try:
        obj.load_state_dict(broken)
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"error": error, "saved_differs": _diff(saved, before), "state": _diff(before, obj.state_dict(), "state"),
            "params": _diff(params, _params(model), "params"), "twin": []}


# ------------------------------------------------------------------ the algorithms
def _wrong_shape(t: torch.Tensor) -> torch.Tensor:
    """A tensor ``copy_`` cannot broadcast into ``t``."""
    return torch.zeros(t.numel() + 1, dtype=t.dtype)


def _last_anchor(s: dict) -> None:
    s["extra"]["anchor"][-1] = _wrong_shape(s["extra"]["anchor"][-1])


def _ps_root(s: dict) -> None:
    s["exchange"]["strategies"]["ps"]["next_root"] = "x"


def _stats(s: dict) -> None:
    s["exchange"]["stats"]["tensor_bytes"] = 5


def _outer(s: dict) -> None:
    s["extra"]["outer"]["param_groups"] = []


def _merged_bytes(s: dict) -> None:
    s["extra"]["merged_bytes"] = "x"


def _in_copy(s: dict) -> None:
    s["extra"]["in_copy"] = {"99": []}


def _last_hat(s: dict) -> None:
    s["extra"]["hat"][-1] = _wrong_shape(s["extra"]["hat"][-1])


def _leaders(s: dict) -> None:
    s["extra"]["leaders"]["local"] = ["x"]


def _lr_sums(s: dict) -> None:
    s["extra"]["lr_sums"] = s["extra"]["lr_sums"][:-1]


def _v_steps(s: dict) -> None:
    s["extra"]["v_steps"] = s["extra"]["v_steps"][:-1]


def _stepped(s: dict) -> None:
    s["extra"]["phase"]["stepped"] = s["extra"]["phase"]["stepped"][:-1]


def _lgc_frozen(s: dict) -> None:
    s["extra"]["frozen"] = True  # loaded (the autoencoder frozen), then:
    s["extra"]["ae_bytes"] = "x"


TOPK = {"compressor": "topk:ratio=0.5", "min_numel": 1}
#: case: (spec, optimizer, options, how the saved state is broken, the part the error names)
ALGORITHMS: dict[str, tuple[str, str, dict[str, Any], Callable[[dict], None], str]] = {
    "localsgd": ("localsgd:period=2", "momentum", TOPK, _last_anchor, "extra"),
    "localsgd_ps": ("localsgd:period=2", "momentum", {**TOPK, "strategy": "ps"}, _ps_root,
                    "exchange: strategies['ps']"),
    "localsgd_stats": ("localsgd:period=2", "momentum", TOPK, _stats, "exchange: stats"),
    "diloco": ("diloco:period=2,outer_momentum=0.5", "momentum", {**TOPK, "nonfinite": "skip"}, _outer, "extra"),
    "streaming": ("streaming-diloco:period=2,fragments=2,overlap=1", "momentum", {}, _merged_bytes, "extra"),
    "sgp": ("sgp", "sgd", TOPK, _in_copy, "extra"),
    "choco": ("choco", "sgd", TOPK, _last_hat, "extra"),
    "lsgd": ("lsgd:tau=2", "sgd", {}, _leaders, "extra"),
    "scaffold": ("scaffold", "sgd", {}, _lr_sums, "extra"),
    "onebit_adam": ("onebit_adam:freeze_step=2", "adam", {"min_numel": 1}, _v_steps, "extra"),
    "zeroone_adam": ("zeroone_adam", "adam", {"min_numel": 1}, _stepped, "extra"),
    # in phase 2 (the autoencoder trains) at every step here: a failed load must leave it trainable
    "lgc": ("lgc:dense_steps=1,ae_steps=10,ratio=0.5", "sgd", {"min_numel": 1}, _lgc_frozen, "extra"),
}


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    if kind == "momentum":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _algo_step(model: nn.Module, opt: torch.optim.Optimizer, algo: Any, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    opt.zero_grad(set_to_none=True)
    ((model(x) - y) ** 2).mean().backward()
    algo.step()


def _algorithm_case(rank: int, spec: str, kind: str, options: dict[str, Any], corrupt: Callable[[dict], None]
                    ) -> dict[str, Any]:
    objs = []
    for _ in range(2):
        model = _model()
        opt = _optimizer(kind, model)
        objs.append((model, opt, algorithms.create(spec, model, opt, **options)))
    (ma, oa, a), (mb, ob, b) = objs
    saved = None
    for step in range(STEPS_BEFORE):
        _algo_step(ma, oa, a, rank, step)
        _algo_step(mb, ob, b, rank, step)
        if step == 0:
            saved = checkpoint(algo=a, model=ma)
    assert saved is not None
    for model in (ma, mb):  # a resumed run loads the model first, then the algorithm (SGP sets it to x / w)
        model.load_state_dict(saved["model"])
    out = _broken_load(a, saved["algo"], corrupt, ma)
    for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        _algo_step(ma, oa, a, rank, step)
        _algo_step(mb, ob, b, rank, step)
        out["twin"].append((_diff(_params(ma), _params(mb), f"params after step {step}"),
                            _diff(a.state_dict(), b.state_dict(), f"state after step {step}", timing=False)))
    a.close()
    b.close()
    return out


# ------------------------------------------------------------------ the DDP hook
def _hook_ps(s: dict) -> None:
    s["strategies"]["ps"]["next_root"] = "x"


def _hook_stats(s: dict) -> None:
    s["stats"]["strategy_bytes"] = 5


def _hook_steps(s: dict) -> None:
    s["stats"]["steps"] = "x"  # loaded, the stats' sums and ratio would break later: refused at the load


def _hook_seconds(s: dict) -> None:
    s["stats"]["tensor_bytes"] = {**s["stats"]["tensor_bytes"], "0.weight": 1.5}


#: case: (compressor, strategy, how the saved state is broken, the part the error names)
HOOKS: dict[str, tuple[str, str, Callable[[dict], None], str]] = {
    "hook_ps": ("topk:ratio=0.3", "ps", _hook_ps, "strategies['ps']"),
    "hook_stats": ("dgc:ratio=0.3", "collective", _hook_stats, "stats"),
    "hook_stats_steps": ("topk:ratio=0.3", "collective", _hook_steps, "stats: stats['steps']: 'x' (str); allowed: "
                         "an integer >= 0"),
    "hook_stats_tensor_bytes": ("topk:ratio=0.3", "collective", _hook_seconds, "stats: stats['tensor_bytes']"
                                "['0.weight']: 1.5 (float); allowed: an integer >= 0"),
}


def _hook_step(ddp: DDP, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    opt.zero_grad(set_to_none=True)
    ((ddp(x) - y) ** 2).mean().backward()
    opt.step()


def _hook_case(rank: int, compressor: str, strategy: str, corrupt: Callable[[dict], None]) -> dict[str, Any]:
    objs = []
    for _ in range(2):
        ddp = DDP(_model())
        hook = gradpress.ddp.register(ddp, compressor, strategy=strategy, min_numel=1)
        objs.append((ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), hook))
    (da, oa, a), (db, ob, b) = objs
    saved = None
    for step in range(STEPS_BEFORE):
        _hook_step(da, oa, rank, step)
        _hook_step(db, ob, rank, step)
        if step == 0:
            saved = checkpoint(hook=a)["hook"]
    assert saved is not None
    out = {**_broken_load(a, saved, corrupt, da), "bound": a._engine is not None, "step": a.step}
    for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        _hook_step(da, oa, rank, step)
        _hook_step(db, ob, rank, step)
        out["twin"].append((_diff(_params(da), _params(db), f"params after step {step}"),
                            _diff(a.state_dict(), b.state_dict(), f"state after step {step}", timing=False)))
    a.close()
    b.close()
    return out


def _two_steps_state(rank: int, bind: bool) -> dict[str, Any]:
    """The state of a top-k hook after two steps (bound by ``bind`` before its first backward, else at it)."""
    ddp = DDP(_model())
    src, function = gradpress.ddp.make_hook("topk:ratio=0.3", min_numel=1)
    if bind:
        src.bind(ddp)
    ddp.register_comm_hook(src, function)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(2):
        _hook_step(ddp, opt, rank, step)
    good = checkpoint(hook=src)["hook"]
    src.close()
    return good


def _unbound_hook(rank: int) -> dict[str, Any]:
    """An unbound hook given a good state, then a refused one: it binds with the good one."""
    good = _two_steps_state(rank, bind=False)  # binds at its first backward
    fresh = DDP(_model())
    hook, function = gradpress.ddp.make_hook("topk:ratio=0.3", min_numel=1)
    hook.load_state_dict(good)
    try:
        hook.load_state_dict({**good, "format": "gradpress-hook/99"})
        error = None
    except ValueError as exc:
        error = str(exc)
    pending = _diff(good, hook.state_dict(), "pending")
    fresh.register_comm_hook(hook, function)
    _hook_step(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), rank, 2)
    out = {"error": error, "pending": pending, "bound": hook.bound, "bound_step": hook.step}
    hook.close()
    return out


def _unbound_refused(rank: int) -> dict[str, Any]:
    """Unbound hooks whose pending state fails to load as they bind: rank 1's was saved by rank 0 (refused
    there; rank 0's own loads). Through ``bind`` and through the first backward: every rank refuses alike,
    each hook stays unbound with its pending state; a fitting state loaded after, it binds with that one."""
    out: dict[str, Any] = {}
    for way in ("bind", "backward"):  # the saved state's keys: names (bind), or param{i} (the first backward)
        good = _two_steps_state(rank, bind=way == "bind")
        pending = {**good, "rank": 0}  # rank 1: another rank's state
        fresh = DDP(_model())
        hook, function = gradpress.ddp.make_hook("topk:ratio=0.3", min_numel=1)
        hook.load_state_dict(pending)
        try:
            if way == "bind":
                hook.bind(fresh)
            else:
                fresh.register_comm_hook(hook, function)
                x, y = _batch(rank, 2)
                ((fresh(x) - y) ** 2).mean().backward()
            error = None
        except (ValueError, RuntimeError) as exc:
            error = str(exc)
        res = {"error": error, "bound": hook.bound, "pending": _diff(pending, hook.state_dict(), "pending")}
        hook.load_state_dict(good)  # the fitting state: binds with it
        if way == "bind":
            hook.bind(fresh)
            fresh.register_comm_hook(hook, function)
        else:  # a DDP model whose backward raised is not reused
            fresh = DDP(_model())
            fresh.register_comm_hook(hook, function)
        _hook_step(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), rank, 2)
        res.update(rebound=hook.bound, step=hook.step)
        out[way] = res
        hook.close()
        if way == "bind":  # a state loaded on rank 0 only: the binding's agreement runs on every rank, no hang
            hook, function = gradpress.ddp.make_hook("topk:ratio=0.3", min_numel=1)
            if rank == 0:
                hook.load_state_dict(good)
            hook.bind(DDP(_model()))
            out["rank0_only"] = {"bound": hook.bound, "step": hook.step}
            hook.close()
    return out


def _caught(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()``, or its exception as ``{"crash": ...}`` (every rank runs the same cases alike, so one case
    failing on every rank leaves the others to run)."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - reported by the test of that case
        return {"crash": f"{type(exc).__name__}: {exc}"}


def _worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (spec, kind, options, corrupt, _) in ALGORITHMS.items():
        out[name] = _caught(lambda: _algorithm_case(rank, spec, kind, options, corrupt))  # noqa: B023
    for name, (compressor, strategy, corrupt, _) in HOOKS.items():
        out[name] = _caught(lambda: _hook_case(rank, compressor, strategy, corrupt))  # noqa: B023
    out["unbound"] = _caught(lambda: _unbound_hook(rank))
    out["unbound_refused"] = _caught(lambda: _unbound_refused(rank))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_workers(_worker, WORLD)


def _check(results: list[dict[str, Any]], name: str, part: str) -> None:
    for rank, res in enumerate(r[name] for r in results):
        assert "crash" not in res, (name, rank, res.get("crash"))
        assert res["saved_differs"] is not None, (name, rank, "the saved state equals the live one: no test")
        assert res["error"] is not None, (name, rank, "the broken state loaded")
        assert f": {part}" in res["error"] and "nothing was loaded" in res["error"], (name, rank, res["error"])
        assert res["state"] is None, (name, rank, res["state"])
        assert res["params"] is None, (name, rank, res["params"])
        for params, state in res["twin"]:
            assert params is None and state is None, (name, rank, params, state)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_a_failed_algorithm_load_leaves_it_as_it_was_and_stepping_as_its_twin(results: list[dict[str, Any]],
                                                                              name: str) -> None:
    _check(results, name, ALGORITHMS[name][4])


@pytest.mark.parametrize("name", list(HOOKS))
def test_a_failed_hook_load_leaves_it_bound_as_it_was_and_stepping_as_its_twin(results: list[dict[str, Any]],
                                                                               name: str) -> None:
    _check(results, name, HOOKS[name][3])
    for res in (r[name] for r in results):
        assert res["bound"] and res["step"] == STEPS_BEFORE, (name, res["bound"], res["step"])


def test_an_unbound_hook_keeps_its_pending_state_when_a_later_load_is_refused(results: list[dict[str, Any]]
                                                                              ) -> None:
    for res in (r["unbound"] for r in results):
        assert "crash" not in res, res.get("crash")
        assert res["error"] is not None and "gradpress-hook/99" in res["error"], res["error"]
        assert res["pending"] is None, res["pending"]
        assert res["bound"] and res["bound_step"] == 3, res  # bound with the good state (saved at step 2)


def test_an_unbound_hook_whose_pending_state_is_refused_at_binding_stays_unbound_with_it(
        results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(r["unbound_refused"] for r in results):
        assert "crash" not in res, (rank, res.get("crash"))
        for way in ("bind", "backward"):
            got = res[way]
            assert got["error"] is not None, (rank, way, "the binding went through")
            assert "rank 1" in got["error"] and "saved by rank 0, loaded on rank 1" in got["error"], (rank, way, got)
            assert "stays unbound" in got["error"], (rank, way, got["error"])
            assert got["bound"] is False, (rank, way)
            assert got["pending"] is None, (rank, way, got["pending"])
            assert got["rebound"] and got["step"] == 3, (rank, way, got)  # the good state (saved at step 2)
        assert res["rank0_only"] == {"bound": True, "step": 2 if rank == 0 else 0}, (rank, res["rank0_only"])
