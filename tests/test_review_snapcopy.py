"""The per-step state copy of ``nonfinite='skip'`` (and of ``propagate`` while a loss scaler is attached) is one
copy, and what it rests on: every stateful compressor's and strategy's ``state_dict`` is the caller's own.

1. Contract (one process, a one-rank gloo group): for every stateful compressor of the registry (and a
   composition), ``state_dict()`` and the engine's snapshot taken after two steps are unchanged, in float64 by
   value, by three more steps that do move the live state (no live buffer, no view of one, no shared container;
   the snapshot's kept buffers detached first, which the next step's snapshot would otherwise reuse:
   ``tests/test_snapshot_kept.py``).
2. One copy: the bytes the snapshot copies (``aten.clone`` and ``aten.copy_``, counted under a dispatch mode)
   equal the bytes of the state it holds. Before, the state was cloned by ``state_dict`` and again by
   ``copy.deepcopy``: twice (DGC, Signum, PowerSGD, AdaComp). A compressor that does not declare
   ``state_dict_copies`` (a plugin following torch's convention of live tensors in ``state_dict``) is still
   copied whole, and its skipped step still leaves no trace.
3. ``skip`` with DGC, Signum, PowerSGD and AdaComp on 2 gloo workers (one launch, about 6 s): a NaN at step 4
   on rank 1 (and, in a second run, also one at step 5 on rank 0: two bad steps in a row, restored twice) gives,
   at every other step, the average of the float64 reference by the definition without those steps; a bad step
   averages to zeros on both ranks and is counted skipped. The ``ps`` strategy's ``state_dict`` (its root
   assignment) is the caller's own too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from copy_count import Copies, tensor_bytes
from distributed import one_rank_module, run_workers
from references import dgc_run, powersgd_run, signum_run

from gradpress.compress import registry
from gradpress.compress.base import derive_seed
from gradpress.compress.signum import Signum
from gradpress.exchange.engine import Synchronizer

group = one_rank_module  # the module's one-process gloo group

SHAPE = (16, 32)  # 512 entries
MIN_NUMEL = 64
STEPS = 8
BETA = 0.9  # Signum's and DGC's momentum (their defaults)
DGC_RATIO = 0.05
RANK = 2  # PowerSGD's
#: the specs of the skip runs; adacomp's bins (L_T = 500 for a 2-D tensor): [0, 500) and [500, 512)
SKIP_SPECS = {"dgc": f"dgc:ratio={DGC_RATIO}", "signum": "signum", "powersgd": f"powersgd:rank={RANK},start_iter=0",
              "adacomp": "adacomp"}
#: (step, rank) of the NaN gradients of each skip run
BAD = {"one bad step": {(4, 1)}, "two bad steps in a row": {(4, 1), (5, 0)}}
#: the contract's specs: every stateful compressor of the registry (PowerSGD compressing from its first step)
STATEFUL = {n: SKIP_SPECS.get(n, n) for n in registry.names() if registry.get_class(n).stateful}
STATEFUL["dgc>natural"] = f"dgc:ratio={DGC_RATIO}>natural"


# -------------------------------------------------------------------------------- helpers
def _grad(rank: int, step: int, bad: set[tuple[int, int]] = frozenset()) -> torch.Tensor:  # type: ignore[assignment]
    g = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1000 * step + rank), dtype=torch.float64)
    if (step, rank) in bad:
        g[3, 5] = math.nan
    return g


def _engine(spec: Any, nonfinite: str = "skip", strategy: str = "collective") -> Synchronizer:
    return Synchronizer(spec, params=[("w", SHAPE, torch.float64), ("b", (8, 16), torch.float64)],
                        min_numel=MIN_NUMEL, nonfinite=nonfinite, strategy=strategy)


def _step(engine: Synchronizer, rank: int, step: int, bad: set = frozenset()) -> torch.Tensor:  # type: ignore[assignment]
    """One step of both keys; the average of ``w``."""
    w = _grad(rank, step, bad)
    b = torch.randn(8, 16, generator=torch.Generator().manual_seed(77 + step), dtype=torch.float64)
    engine.sync(["w", "b"], [w, b], step=step)
    return w


def _frozen(obj: Any) -> Any:
    """A float64 copy of ``obj``'s values (tensors cloned in float64; containers rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(torch.float64, copy=True)
    if isinstance(obj, dict):
        return {k: _frozen(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_frozen(v) for v in obj]
    return obj


def _diff(a: Any, b: Any, where: str = "") -> str | None:
    """Where ``a`` (frozen) and ``b`` differ by value, or None."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape:
            return f"{where}: {type(b).__name__}"
        bb = b.detach().to(torch.float64)
        same = torch.equal(torch.isnan(a), torch.isnan(bb)) and torch.equal(a.nan_to_num(), bb.nan_to_num())
        return None if same else f"{where}: changed by {float((a - bb).abs().nan_to_num().max()):.3g}"
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return f"{where}: keys {sorted(a)} -> {sorted(b) if isinstance(b, dict) else type(b).__name__}"
        return next((d for k in a if (d := _diff(a[k], b[k], f"{where}[{k!r}]"))), None)
    if isinstance(a, list):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return f"{where}: {a!r} -> {b!r}"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _diff(x, y, f"{where}[{i}]"))), None)
    return None if a == b else f"{where}: {a!r} -> {b!r}"


class _LiveSignum(Signum):
    """A plugin-like Signum (not registered) whose ``state_dict`` follows torch's convention: the live buffers
    themselves (Signum updates them in place); it does not declare ``state_dict_copies``."""

    state_dict_copies = False

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": dict(self.buffers)}


# ---------------------------------------------------------------------- 1. the contract
@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_state_dict_and_the_snapshot_are_the_callers_own(group, name: str) -> None:  # noqa: ANN001
    engine = _engine(STATEFUL[name])
    for step in range(2):
        _step(engine, 0, step)
    state, snapshot = engine.compressor.state_dict(), engine._snapshot_state()
    assert snapshot is not None, f"{name}: no snapshot of a stateful compressor"
    engine.guard.kept = None  # the next step's snapshot would reuse its buffers (by design): detached here
    before, snap_before = _frozen(state), _frozen(snapshot)
    for step in range(2, 5):
        _step(engine, 0, step)
    assert _diff(before, engine.compressor.state_dict()) is not None, f"{name}: the live state did not move"
    assert (d := _diff(before, state)) is None, f"{name}: state_dict(){d} by later steps (a live buffer)"
    assert (d := _diff(snap_before, snapshot)) is None, f"{name}: the engine's snapshot{d} by later steps"


def test_every_builtin_stateful_compressor_declares_its_copies() -> None:
    """What lets the snapshot take no second copy; a new stateful compressor either clones in ``state_dict``
    and says so, or is deep-copied (the default, ``Compressor.state_dict_copies = False``)."""
    missing = [n for n in STATEFUL if not registry.create(STATEFUL[n]).state_dict_copies]
    assert not missing, f"stateful compressors without state_dict_copies: {missing}"


# ---------------------------------------------------------------------- 2. one copy
@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_the_snapshot_copies_the_state_once(group, name: str) -> None:  # noqa: ANN001
    engine = _engine(STATEFUL[name])
    for step in range(2):
        _step(engine, 0, step)
    with Copies() as copies:
        snapshot = engine._snapshot_state()
    held = tensor_bytes(snapshot)
    assert copies.bytes == held, (f"{name}: the snapshot copied {copies.bytes} bytes for a state of {held} "
                                  f"({copies.bytes / max(held, 1):.1f} copies)")


def test_a_compressor_with_live_state_dict_tensors_is_copied_whole_and_its_skipped_step_leaves_no_trace(
        group) -> None:  # noqa: ANN001
    engine = _engine(_LiveSignum())
    _step(engine, 0, 0)
    snapshot = engine._snapshot_state()
    frozen = _frozen(snapshot)
    _step(engine, 0, 1)
    assert (d := _diff(frozen, snapshot)) is None, f"the snapshot of live tensors{d}"
    # skip on one rank: w's average is sign(m), m = beta m + (1 - beta) g, the bad steps left out
    engine = _engine(_LiveSignum())
    bad = {(3, 0), (4, 0)}
    m = torch.zeros(SHAPE, dtype=torch.float64)
    for step in range(7):
        got = _step(engine, 0, step, bad)
        if (step, 0) in bad:
            assert engine.last_step_skipped and not bool(got.any()), step
            continue
        m = BETA * m + (1 - BETA) * _grad(0, step)
        assert torch.equal(got, torch.where(m >= 0, 1.0, -1.0).double()), f"step {step}"


# ------------------------------------------------------------------ 3. skip on 2 workers
def _workers(rank: int, world: int) -> dict:
    out: dict = {}
    for run, bad in BAD.items():
        for name, spec in SKIP_SPECS.items():
            engine = _engine(spec)
            steps = []
            for step in range(STEPS):
                w = _step(engine, rank, step, bad)
                steps.append((w.clone(), engine.last_step_skipped))
            out[(run, name)] = steps
    engine = _engine("topk:ratio=0.1", strategy="ps")
    state = engine.strategies["ps"].state_dict()
    frozen = _frozen(state)
    for step in range(3):
        _step(engine, rank, step)
    out["ps"] = (_diff(frozen, state), _diff(frozen, engine.strategies["ps"].state_dict()))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_workers, 2)


def _finite(step: int, bad: set) -> bool:
    return not any(s == step for s, _ in bad)


def _dgc(gs: Callable[[int], list[torch.Tensor]], world: int, keep: Callable[[int], bool]) -> list:
    """DGC by the definition (no clipping, no warm-up; references.dgc_run). A step left out: None."""
    return dgc_run(gs, STEPS, keep, DGC_RATIO, BETA)


def _signum(gs: Callable[[int], list[torch.Tensor]], world: int, keep: Callable[[int], bool]) -> list:
    """The majority vote of the ranks' momentum signs (references.signum_run)."""
    return signum_run(gs, STEPS, keep, BETA)


def _powersgd(gs: Callable[[int], list[torch.Tensor]], world: int, keep: Callable[[int], bool]) -> list:
    """Rank-2 PowerSGD with error feedback (references.powersgd_run), the first Q drawn from the shared seed of
    step 0 and key ``w`` (seed 0)."""
    gen = torch.Generator().manual_seed(derive_seed("shared", 0, 0, "w"))
    return powersgd_run(gs, STEPS, keep, torch.randn(SHAPE[1], RANK, generator=gen, dtype=torch.float64))


def _wire_scale(s: torch.Tensor) -> torch.Tensor:
    """An fp64 scale as AdaComp sends it: the upper 32 bits of its fp64 value, rounded to nearest."""
    bits = s.reshape(1).view(torch.int64)
    return (((bits + (1 << 31)) >> 32) << 32).view(torch.float64).reshape(())


def _adacomp(gs: Callable[[int], list[torch.Tensor]], world: int, keep: Callable[[int], bool]) -> list:
    """AdaComp (Chen et al. 2018) by its definition: G <- G + dW, H = G + dW; per bin of L_T = 500 consecutive
    entries gmax = max |G|; entry k is sent iff |H_k| >= gmax of its bin and G_k != 0, as sign(G_k) s with s the
    mean |G_k| over the sent entries (sent as its fp64 upper word); G_k <- G_k - sign(G_k) s there."""
    d, size = SHAPE[0] * SHAPE[1], 500
    res = [torch.zeros(d, dtype=torch.float64) for _ in range(world)]
    out: list = []
    for step in range(STEPS):
        if not keep(step):
            out.append(None)
            continue
        total = torch.zeros(d, dtype=torch.float64)
        for r, g in enumerate(gs(step)):
            dw = g.reshape(-1)
            res[r] = res[r] + dw
            h = res[r] + dw
            gmax = torch.cat([res[r][a:a + size].abs().max().expand(min(size, d - a)) for a in range(0, d, size)])
            idx = torch.nonzero((h.abs() >= gmax) & (res[r] != 0)).reshape(-1)
            s = _wire_scale(res[r][idx].abs().mean())
            q = torch.where(res[r][idx] < 0, -s, s)
            total[idx] += q
            res[r][idx] -= q
        out.append((total / world).reshape(SHAPE))
    return out


REFERENCES = {"dgc": _dgc, "signum": _signum, "powersgd": _powersgd, "adacomp": _adacomp}


@pytest.mark.parametrize("run", sorted(BAD))
@pytest.mark.parametrize("name", sorted(SKIP_SPECS))
def test_skip_equals_the_reference_without_the_bad_steps(results: list[dict], name: str, run: str) -> None:
    bad = BAD[run]
    want = REFERENCES[name](lambda step: [_grad(r, step) for r in range(2)], 2, lambda step: _finite(step, bad))
    for rank, res in enumerate(results):
        for step, ((got, skipped), ref) in enumerate(zip(res[(run, name)], want)):
            if ref is None:
                assert skipped and not bool(got.any()), f"{name} {run} rank {rank} step {step}: not dropped"
                continue
            assert not skipped, f"{name} {run} rank {rank} step {step}: dropped"
            err = float((got - ref).abs().max())
            assert torch.allclose(got, ref, rtol=1e-9, atol=1e-12 * float(ref.abs().max())), (
                f"{name} {run} rank {rank} step {step}: differs from the float64 reference without the bad "
                f"steps by {err:.3g} (max {float(ref.abs().max()):.3g})")


def test_the_ps_strategys_state_dict_is_the_callers_own(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        taken, live = res["ps"]
        assert live is not None, f"rank {rank}: the roots were not assigned (the test checks nothing)"
        assert taken is None, f"rank {rank}: ps state_dict(){taken} by later steps"
