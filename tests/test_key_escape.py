"""Residual store keys that two tensors can share (docs/architecture.md, "Residual keys").

The store keeps the worker's residual under the tensor's key and a
strategy's under ``namespace/key`` (``host/w``, ``root/w#ps``), a partition
under ``key#k``. ``register_parameter`` and ``nn.ParameterDict`` refuse '.'
but take '/' and '#', so a parameter can be named like another tensor's
strategy key (``host/w``, ``root/w#ps``) or like another's partition
(``w#0``). Before the key encoding these shared one store entry: the worker
residual of ``host/w`` (zero under ``hierarchical``) overwrote ``w``'s host
residual, the worker residual of ``root/w#ps`` overwrote ``w``'s PS root
residual, and partition 0 of ``w`` and the parameter ``w#0`` shared one root
residual (and one root); ``memory_bytes`` counted ``ring/x``'s worker
residual as a strategy's. Every result here is checked against a float64
reference computed in the test from the definitions (top-k with error
feedback; the PS root re-sparsifying the mean at density ``ratio * N`` with
its own residual). One spawn of 2 gloo workers, about 10 s.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers
from references import topk
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

RATIO = 0.25
STEPS = 3
#: the PS_LINK costs of tests/test_strategies.py: with 2 workers, ps for 64..128 entries, ps in 2 parts from 256
PS_LINK = {"allreduce": (2e-4, 2e-4, 1e-6), "allgather": (2e-4, 2e-4, 4e-6), "broadcast": (5e-5, 5e-5, 1e-8),
           "p2p": (2e-4, 2e-4, 1e-6), "encode": (1e-5, 1e-5, 1e-9), "decode": (1e-5, 1e-5, 1e-9),
           "wire": (0.0, 0.0, 1.0), "root_wire": (0.0, 0.0, 1.0)}

TOPK = f"topk:ratio={RATIO}"
#: scenario: (compressor, strategy, plan_costs, parameter shapes by name, reference kind, parts per name)
SCENARIOS = {
    "hierarchical-slash": (TOPK, "hierarchical:workers_per_host=1", None, {"w": (8, 8), "host/w": (8, 8)},
                           "ef", {}),
    "ps-slash": (TOPK, "ps", None, {"w": (8, 8), "root/w#ps": (8, 8)}, "ps", {}),
    # the scaled sign: a PS root's re-encoding loses something, so the root residual is not zero (top-k's
    # is: the mean of N top-k packets has at most N k entries, all kept at density ratio * N)
    "ps-partition": ("efsignsgd", "auto", PS_LINK, {"w": (16, 16), "w#0": (8, 16)}, "ps", {"w": 2}),
    "ps-percent": (TOPK, "ps", None, {"w%2F": (8, 8), "w/": (8, 8), "root/w%2F#ps": (8, 8)}, "ps", {}),
}


class Named(nn.Module):
    """Parameters registered under the given names (as ``nn.ParameterDict`` or ``register_parameter`` do)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape)))

    def forward(self, coeffs: dict[str, torch.Tensor]) -> torch.Tensor:
        # linear: the gradient of each parameter is exactly its coefficient
        return sum((self._parameters[n] * c).sum() for n, c in coeffs.items())  # type: ignore[misc]


def _grad(name_index: int, shape: tuple[int, ...], rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + name_index)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _hook_run(rank: int, world: int, scenario: str) -> dict:
    import gradpress

    spec, strategy, costs, shapes, _, _ = SCENARIOS[scenario]
    model = Named(shapes)
    ddp = DDP(model)
    hook = gradpress.ddp.register(ddp, spec, strategy=strategy, plan_costs=costs, min_numel=16,
                                  error_feedback=True)
    plan = {k: (d.strategy, d.parts) for k, d in hook.plan.decisions.items()}
    got = []
    for step in range(STEPS):
        ddp.zero_grad()
        coeffs = {n: _grad(i, s, rank, step).float() for i, (n, s) in enumerate(shapes.items())}
        ddp(coeffs).backward()
        got.append({n: p.grad.detach().double().clone() for n, p in model.named_parameters()})
    mem = hook.memory_bytes()
    hook.close()
    return {"got": got, "plan": plan, "memory": mem}


def _algorithm_run(rank: int, world: int) -> dict:
    """``localsgd:period=1`` with plain SGD (lr 1): every step averages the delta ``-g`` through ``ps``."""
    import gradpress.algorithms as algorithms

    shapes = {"w": (8, 8), "root/w#ps": (8, 8)}
    model = Named(shapes)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    algo = algorithms.create("localsgd:period=1", model, opt, compressor=f"topk:ratio={RATIO}", strategy="ps",
                             min_numel=16, error_feedback=True)
    got = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        coeffs = {n: _grad(i, s, rank, step).float() for i, (n, s) in enumerate(shapes.items())}
        model(coeffs).backward()
        algo.step()
        got.append({n: p.detach().double().clone() for n, p in model.named_parameters()})
    return {"got": got}


def _memory_run(rank: int, world: int) -> dict:
    import gradpress

    model = Named({"x": (8, 8), "ring/x": (8, 8)})
    ddp = DDP(model)
    hook = gradpress.ddp.register(ddp, f"topk:ratio={RATIO}", min_numel=16, error_feedback=True)
    ddp.zero_grad()
    ddp({n: _grad(i, (8, 8), rank, 0).float() for i, n in enumerate(("x", "ring/x"))}).backward()
    mem = hook.memory_bytes()
    hook.close()
    return {"memory": mem}


#: what a state written before the key encoding held, by the old definition: keys built from the raw names
OLD_KEYS = {"residuals": {"enc%2Fx": "enc/x", "root/enc%2Fx#ps": "root/enc/x#ps"},
            "roots": {"enc%2Fx": "enc/x"}}


def _engine(names: list[str]):  # noqa: ANN202
    from gradpress.exchange import Synchronizer

    return Synchronizer("efsignsgd", params=[(n, (8, 8), torch.float32) for n in names], strategy="ps", min_numel=16,
                        error_feedback=True)


def _steps(engine, names: list[str], rank: int, steps: range) -> list[torch.Tensor]:  # noqa: ANN001
    out = []
    for step in steps:
        grads = [_grad(i, (8, 8), rank, step).float() for i in range(len(names))]
        engine.sync(names, grads, step=step)
        out += grads
    return out


def _old_state(state: dict, names: dict[str, dict[str, str]]) -> dict:
    """``state`` as the code before the key encoding wrote it: no ``keys`` entry, keys renamed by ``names``."""
    old = {k: v for k, v in state.items() if k != "keys"}
    fb = state["feedback"]
    old["feedback"] = {**fb, "residuals": {names["residuals"].get(k, k): v for k, v in fb["residuals"].items()}}
    ps = state["strategies"]["ps"]
    old["strategies"] = {**state["strategies"], "ps": {**ps, "roots": {names["roots"].get(k, k): v
                                                                       for k, v in ps["roots"].items()}}}
    return old


def _resume_run(rank: int, world: int) -> dict:
    """A checkpoint without the ``keys`` entry, of an ordinary model and of one with ``enc/x``: it loads to the
    state today's code keeps (the same tensors under today's keys) and the resumed run goes on bit for bit."""
    import copy
    import io
    import warnings

    out: dict = {}
    for label, names, renamed in (("ordinary", ["w", "v.weight"], {"residuals": {}, "roots": {}}),
                                  ("escaped", ["w", "enc/x"], OLD_KEYS)):
        a = _engine(names)
        _steps(a, names, rank, range(3))
        saved = copy.deepcopy(a.state_dict())
        buf = io.BytesIO()
        torch.save(_old_state(saved, renamed), buf)
        buf.seek(0)
        b = _engine(names)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing was shared: nothing to warn about
            b.load_state_dict(torch.load(buf, weights_only=True))
        loaded = b.state_dict()
        out[label] = {
            "keys": sorted(saved["feedback"]["residuals"]),
            "same_residuals": sorted(loaded["feedback"]["residuals"]) == sorted(saved["feedback"]["residuals"])
            and all(torch.equal(v, loaded["feedback"]["residuals"][k]) for k, v in saved["feedback"]["residuals"].items()),
            "same_roots": loaded["strategies"]["ps"] == saved["strategies"]["ps"],
            "same_steps": all(torch.equal(x, y) for x, y in zip(_steps(a, names, rank, range(3, 6)),
                                                                 _steps(b, names, rank, range(3, 6)))),
        }
    return out


def _all(rank: int, world: int) -> dict:
    out: dict = {name: _hook_run(rank, world, name) for name in SCENARIOS}
    out["algorithm"] = _algorithm_run(rank, world)
    out["memory"] = _memory_run(rank, world)
    out["resume"] = _resume_run(rank, world)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_workers(_all, 2)


# ------------------------------------------------------------------ references (float64, by the definitions)
def _scaled_sign(x: torch.Tensor) -> torch.Tensor:
    """efsignsgd: ``mean |x| * sign(x)``, sign(0) = +1."""
    return x.abs().mean() * torch.where(x >= 0, 1.0, -1.0).to(x.dtype)


def _ef_allgather(grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """grads[step][rank] -> the average per step: each rank sends top-k(g + e), keeps e = (g + e) - sent."""
    world = len(grads[0])
    e = [torch.zeros_like(grads[0][0]) for _ in range(world)]
    out = []
    for step in grads:
        sent = []
        for r, g in enumerate(step):
            p = g + e[r]
            sent.append(topk(p, RATIO))
            e[r] = p - sent[-1]
        out.append(sum(sent) / world)
    return out


def _ps(grads: list[list[torch.Tensor]], parts: int, spec: str = TOPK) -> list[torch.Tensor]:
    """The ``ps`` strategy with error feedback: each rank compensates its whole tensor (``p = g + e``),
    cuts it into ``parts`` flat pieces and sends C(piece) (top-k, or the scaled sign); the root of a piece
    averages what it got, adds its own residual ``E`` and re-encodes (top-k at density ``ratio * N``)
    with ``E = q - sent``; everyone gets the root's result."""
    comp = _scaled_sign if spec == "efsignsgd" else (lambda x: topk(x, RATIO))
    world = len(grads[0])
    e = [torch.zeros_like(grads[0][0]) for _ in range(world)]
    root_e: list[torch.Tensor | None] = [None] * parts
    out = []
    for step in grads:
        pieces_by_rank = []
        for r, g in enumerate(step):
            p = g + e[r]
            pieces = torch.tensor_split(p.reshape(-1), parts) if parts > 1 else [p]
            sent = [comp(q) for q in pieces]
            e[r] = p - (torch.cat([s.reshape(-1) for s in sent]).reshape(p.shape) if parts > 1 else sent[0])
            pieces_by_rank.append(sent)
        results = []
        for k in range(parts):
            avg = sum(pieces_by_rank[r][k] for r in range(world)) / world
            q = avg + (root_e[k] if root_e[k] is not None else 0)
            s = _scaled_sign(q) if spec == "efsignsgd" else topk(q, min(1.0, RATIO * world))
            root_e[k] = q - s
            results.append(s)
        out.append(torch.cat([s.reshape(-1) for s in results]).reshape(step[0].shape) if parts > 1 else results[0])
    return out


def _reference(scenario: str, world: int) -> dict[str, list[torch.Tensor]]:
    spec, _, _, shapes, kind, parts = SCENARIOS[scenario]
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        grads = [[_grad(i, shape, r, step).float().double() for r in range(world)] for step in range(STEPS)]
        out[name] = _ef_allgather(grads) if kind == "ef" else _ps(grads, parts.get(name, 1), spec)
    return out


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_hook_residuals_of_names_that_look_like_store_keys(runs: list[dict], scenario: str) -> None:
    """Through ``gradpress.ddp.register``: every parameter's averaged gradient at every step equals its own
    float64 reference, whatever the other parameters are called."""
    _, _, _, shapes, _, parts = SCENARIOS[scenario]
    want = _reference(scenario, len(runs))
    for rank, run in enumerate(runs):
        res = run[scenario]
        for name, k in parts.items():  # the plan the scenario is about (partitions from the injected costs)
            assert res["plan"][name] == ("ps", k), (scenario, res["plan"])
        for step in range(STEPS):
            for name in shapes:
                got, ref = res["got"][step][name], want[name][step]
                err = float((got - ref).abs().max())
                assert err < 1e-5, f"{scenario}: rank {rank} step {step} parameter {name!r} off by {err:.3g}"


def test_algorithm_residuals_of_names_that_look_like_store_keys(runs: list[dict]) -> None:
    """``localsgd:period=1`` (SGD, lr 1) through ``ps``: the parameters after every step are the sum of the
    averaged deltas ``-g``, each parameter's by its own float64 reference (``w``'s root residual was
    overwritten by the worker residual of the parameter ``root/w#ps``)."""
    world = len(runs)
    shapes = {"w": (8, 8), "root/w#ps": (8, 8)}
    for i, (name, shape) in enumerate(shapes.items()):
        grads = [[-_grad(i, shape, r, step).float().double() for r in range(world)] for step in range(STEPS)]
        theta = torch.zeros(shape, dtype=torch.float64)
        for step, avg in enumerate(_ps(grads, 1)):
            theta = theta + avg
            for rank, run in enumerate(runs):
                err = float((run["algorithm"]["got"][step][name] - theta).abs().max())
                assert err < 1e-5, f"rank {rank} step {step} parameter {name!r} off by {err:.3g}"


def test_memory_bytes_counts_a_slash_named_worker_residual_as_the_workers(runs: list[dict]) -> None:
    """``collective`` top-k keeps one worker residual per parameter and no strategy residual: 2 x 64 fp32
    entries, whatever the parameters are called (``ring/x``'s was counted as a ring residual)."""
    for run in runs:
        mem = run["memory"]["memory"]
        assert mem["residuals"] == 2 * 64 * 4 and mem["strategies"] == 0, mem


@pytest.mark.parametrize("label", ["ordinary", "escaped"])
def test_a_checkpoint_from_before_the_key_encoding_resumes_bit_for_bit(runs: list[dict], label: str) -> None:
    """An engine state without ``keys`` (written before the encoding; ``ps`` with the scaled sign: worker and
    root residuals, PS roots) loads into the state the uninterrupted run holds, tensors bit for bit, and the
    resumed run's next 3 steps equal the uninterrupted run's. For ``enc/x`` the old keys (``enc/x``,
    ``root/enc/x#ps``, the root of ``enc/x``) are re-keyed (``enc%2Fx``...); ordinary names keep theirs."""
    for rank, run in enumerate(runs):
        res = run["resume"][label]
        assert res["same_residuals"] and res["same_roots"] and res["same_steps"], (rank, res)
    held = {k for run in runs for k in run["resume"][label]["keys"]}
    if label == "escaped":  # the residuals the renaming is about exist (the root's on one rank)
        assert {"enc%2Fx", "root/enc%2Fx#ps"} <= held, held
    else:
        assert "w" in held and "v.weight" in held, held


def test_an_old_key_two_tensors_shared_is_dropped_with_a_warning() -> None:
    """Before the encoding the parameter ``root/w#ps``'s residual and ``w``'s PS root residual shared the key
    ``root/w#ps`` (whichever was written last): it cannot be given back to either, so it is dropped, naming it;
    every key one tensor built is re-keyed (``root/root/w#ps#ps``, the PS roots), ordinary keys stay."""
    from gradpress.exchange.keys import KEYS_FORMAT, upgrade_keys

    names = ["w", "root/w#ps"]
    t = {k: torch.full((2,), float(i)) for i, k in enumerate(["w", "root/w#ps", "root/root/w#ps#ps"])}
    state = {"feedback": {"residuals": dict(t)}, "compressor": {"q": {"w": t["w"], "root/w#ps": t["root/w#ps"]}},
             "strategies": {"ps": {"roots": {"w": 0, "root/w#ps": 1}, "next_root": 2}},
             "plan": {n: {"strategy": "ps", "parts": 1} for n in names}}
    with pytest.warns(UserWarning, match=r"root/w#ps were shared by two tensors"):
        new = upgrade_keys(state, names)
    assert new["keys"] == KEYS_FORMAT
    assert new["feedback"]["residuals"] == {"w": t["w"], "root/root%2Fw%23ps#ps": t["root/root/w#ps#ps"]}
    assert new["compressor"]["q"] == {"w": t["w"], "root%2Fw%23ps": t["root/w#ps"]}
    assert new["strategies"]["ps"] == {"roots": {"w": 0, "root%2Fw%23ps": 1}, "next_root": 2}
    # partition 0 of a tensor in 2 parts and a parameter named like it: shared; in 1 part: the parameter's
    part = {"feedback": {"residuals": {"root/w#0#ps": t["w"]}}, "plan": {"w": {"strategy": "ps", "parts": 2}}}
    with pytest.warns(UserWarning, match="root/w#0#ps"):
        assert upgrade_keys(part, ["w", "w#0"])["feedback"]["residuals"] == {}
    part["plan"]["w"]["parts"] = 1
    assert upgrade_keys(part, ["w", "w#0"])["feedback"]["residuals"] == {"root/w%230#ps": t["w"]}


def _randomk_partitions(rank: int, world: int) -> dict:
    """randomk (unscaled, summable) on ``auto`` with the PS_LINK costs: 256 entries go ``ps`` in 2 parts."""
    from gradpress.exchange import Synchronizer

    engine = Synchronizer(f"randomk:ratio={RATIO}", params=[("w", (16, 16), torch.float32)], strategy="auto",
                          plan_costs=PS_LINK, min_numel=16, error_feedback=False)
    plan = {k: (d.strategy, d.parts) for k, d in engine.plan.decisions.items()}
    got = []
    for step in range(STEPS):
        g = _grad(0, (16, 16), rank, step).float()
        engine.sync(["w"], [g], step=step)
        got.append(g.double())
    return {"plan": plan, "got": got}


def test_each_partition_of_a_randomk_tensor_draws_its_own_shared_indices() -> None:
    """A tensor the plan cuts into K partitions is exchanged as K tensors keyed ``w#0`` .. ``w#K-1``
    (exchange/keys.py ``part_key``), and randomk draws its indices from the shared seed of the key
    (``derive_seed("shared", seed, step, key)``): partition k keeps ``kept_count(m, ratio)`` entries at
    ``random_indices(m, k, that seed)``, each the float64 mean of the ranks' entries (unscaled, ps sums the
    packets). With every partition keyed ``w#0`` the two equal partitions kept the same positions: still a
    random-k, and no reference of the efsignsgd scenario (deterministic) could tell."""
    from gradpress.compress.base import derive_seed
    from gradpress.compress.randomk import random_indices
    from gradpress.compress.sparse import kept_count

    results = run_workers(_randomk_partitions, 2)
    assert results[0]["plan"] == {"w": ("ps", 2)}
    m = 128
    k = kept_count(m, RATIO)
    for step in range(STEPS):
        mean = sum(_grad(0, (16, 16), r, step).float().double() for r in range(2)) / 2
        want = []
        for part, piece in enumerate(torch.tensor_split(mean.reshape(-1), 2)):
            idx = random_indices(m, k, derive_seed("shared", 0, step, f"w#{part}"), torch.device("cpu"))
            out = torch.zeros(m, dtype=torch.float64)
            out[idx] = piece[idx]
            want.append(out)
        want_t = torch.cat(want).reshape(16, 16)
        for r in range(2):
            torch.testing.assert_close(results[r]["got"][step], want_t, rtol=1e-6, atol=1e-7)
