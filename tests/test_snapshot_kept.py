"""The per-step snapshot of ``nonfinite='skip'`` (and of ``propagate`` while a loss scaler is attached) is copied
into buffers kept from step to step: one process, a one-rank gloo group, about 5 s.

1. ``copy_into``: a tensor goes into the kept one at its place when shape, dtype, device and strides match (the
   same storage, ``copy_``), into a new one otherwise (the kept one left as it was); entries the live state no
   longer has are dropped; plain values are copies (changing the live ones later leaves them).
2. The engine (DGC, Signum, PowerSGD, AdaComp, a composition; ``skip``): the snapshot of step 3 is in the
   storage of step 2's, equal to ``state_dict()`` taken before step 3 (the same keys, tensors bitwise, plain
   values such as DGC's quality meter: every entry the restore's ``load_state_dict`` reads), and the snapshot
   copies each byte
   of the state once and allocates nothing (no ``aten.clone``).
3. Freed: with ``propagate``, the kept buffers exist while ``keep_on_propagate`` (a scaler attached) and are
   gone after the first step without it.
4. Restored exactly: DGC and Signum with ``skip``, a NaN in one tensor at steps 3 and 4 (two restores in a row
   from the kept buffers, which the next snapshot overwrites; the other tensor's state moves at those steps,
   Signum's in place): every other step's averages equal the float64 references by the definition without
   those steps (``references.dgc_run``, ``signum_run``), the dropped ones are zeros.

Planted: ``copy_into`` cloning always (main's fresh copy): 2 fails (another storage); ``copy_into`` copying into
a kept tensor of another shape: 1 fails; the release in ``StepGuard.begin_call`` removed: 3 fails; the restore
put back the kept buffers uncopied (``load_state_dict`` taking the snapshot's tensors as its own): 4 fails;
DGC's ``live_state`` without ``quality`` (a restore would reset the quality meter): 2 fails for dgc and
dgc>natural (it passed when 2 compared the tensors zipped in order, which stops at the shorter list).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from copy_count import Copies
from distributed import one_rank_module
from references import dgc_run, signum_run

from gradpress.exchange.engine import Synchronizer
from gradpress.exchange.state import copy_into

group = one_rank_module  # the module's one-process gloo group

SHAPE = (16, 32)
STATEFUL = {"dgc": "dgc:ratio=0.05", "signum": "signum", "powersgd": "powersgd:rank=2,start_iter=0",
            "adacomp": "adacomp", "dgc>natural": "dgc:ratio=0.05>natural"}


def _grad(step: int, bad: frozenset[int] = frozenset()) -> torch.Tensor:
    g = torch.randn(SHAPE, generator=torch.Generator().manual_seed(900 + step), dtype=torch.float64)
    if step in bad:
        g[2, 3] = math.nan
    return g


def _engine(spec: str, mode: str = "skip") -> Synchronizer:
    return Synchronizer(spec, params=[("w", SHAPE, torch.float64)], min_numel=1, nonfinite=mode)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _differs(kept: Any, state: Any, path: str = "") -> str | None:
    """Where the kept copy differs from ``state_dict()`` (keys, lengths, tensors bitwise, plain values), or None:
    the snapshot must hold every entry the restore's ``load_state_dict`` reads, numbers included."""
    if isinstance(state, torch.Tensor):
        ok = isinstance(kept, torch.Tensor) and kept.dtype == state.dtype and torch.equal(kept, state)
        return None if ok else f"{path}: the kept copy differs from state_dict()"
    if isinstance(state, dict):
        if not isinstance(kept, dict) or set(kept) != set(state):
            return f"{path}: keys {sorted(kept) if isinstance(kept, dict) else kept!r} vs state_dict()'s {sorted(state)}"
        return next((d for k in state if (d := _differs(kept[k], state[k], f"{path}/{k}")) is not None), None)
    if isinstance(state, (list, tuple)):
        if type(kept) is not type(state) or len(kept) != len(state):
            return f"{path}: {kept!r} vs state_dict()'s {state!r}"
        return next((d for i, (a, b) in enumerate(zip(kept, state)) if (d := _differs(a, b, f"{path}/{i}")) is not None),
                    None)
    return None if kept == state else f"{path}: {kept!r} vs state_dict()'s {state!r}"


# ---------------------------------------------------------------------- 1. copy_into
def test_copy_into_reuses_matching_buffers_and_reallocates_others() -> None:
    live = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.float16), "c": torch.zeros(3),
            "n": [1, 2], "gone": None}
    kept = copy_into(live, None)
    assert all(k.data_ptr() != v.data_ptr() for k, v in zip(_tensors(kept), _tensors(live)))
    first = {k: v for k, v in kept.items() if isinstance(v, torch.Tensor)}
    live2 = {"a": live["a"] + 1, "b": torch.full((5,), 2.0, dtype=torch.float16),  # another shape
             "c": torch.ones(3, dtype=torch.float64), "n": [3]}  # another dtype; "gone" is gone
    again = copy_into(live2, kept)
    assert again["a"].data_ptr() == first["a"].data_ptr() and torch.equal(again["a"], live2["a"])
    assert again["a"].data_ptr() != live2["a"].data_ptr()
    for key in ("b", "c"):
        assert again[key].data_ptr() != first[key].data_ptr(), key
        assert again[key].dtype == live2[key].dtype and torch.equal(again[key], live2[key]), key
    assert torch.equal(first["b"], torch.ones(4, dtype=torch.float16)) and torch.equal(first["c"], torch.zeros(3))
    assert set(again) == {"a", "b", "c", "n"} and again["n"] == [3]
    live2["n"].append(4)
    assert again["n"] == [3]
    strided = torch.arange(6.0).reshape(3, 2).t()  # same shape as "a", other strides
    assert copy_into(strided, first["a"]).data_ptr() != first["a"].data_ptr()


# ---------------------------------------------------------------------- 2. reused, no allocation
@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_the_next_steps_snapshot_is_copied_into_the_same_buffers(group, name: str) -> None:  # noqa: ANN001
    engine = _engine(STATEFUL[name])
    for step in range(2):
        engine.sync(["w"], [_grad(step)], step=step)
    held = _tensors(engine.guard.kept)
    assert held, f"{name}: no kept buffers after two skip steps"
    ptrs = [t.data_ptr() for t in held]
    before = engine.compressor.state_dict()
    with Copies() as copies:
        snapshot = engine._snapshot_state()
    assert snapshot is not None
    now = _tensors(snapshot["compressor"])
    assert [t.data_ptr() for t in now] == ptrs, f"{name}: the snapshot moved to other buffers"
    assert _differs(snapshot["compressor"], before) is None, f"{name}: {_differs(snapshot['compressor'], before)}"
    nbytes = sum(t.numel() * t.element_size() for t in now)
    assert copies.bytes == nbytes and copies.clone_bytes == 0, (name, copies.bytes, copies.clone_bytes, nbytes)


# ---------------------------------------------------------------------- 3. freed
def test_the_kept_buffers_go_when_the_mode_takes_no_copy(group) -> None:  # noqa: ANN001
    engine = _engine(STATEFUL["dgc"], mode="propagate")
    engine.guard.keep_on_propagate = True  # what the DDP hook sets while a scaler is attached
    for step in range(2):
        engine.sync(["w"], [_grad(step)], step=step)
    assert _tensors(engine.guard.kept)
    engine.guard.keep_on_propagate = False
    engine.sync(["w"], [_grad(2)], step=2)
    assert engine.guard.kept is None


# ---------------------------------------------------------------------- 4. restored exactly
B_SHAPE = (8, 16)


def _b(step: int) -> torch.Tensor:
    return torch.randn(B_SHAPE, generator=torch.Generator().manual_seed(300 + step), dtype=torch.float64)


@pytest.mark.parametrize("spec", ["dgc:ratio=0.05", "signum"])
def test_two_dropped_steps_in_a_row_restore_the_state_exactly(group, spec: str) -> None:  # noqa: ANN001
    """A NaN in ``w`` at steps 3 and 4; ``b`` is finite, so its state moves (Signum: in place) at the dropped
    steps and must be put back from the kept buffers each time."""
    bad = frozenset({3, 4})
    steps = 8
    engine = Synchronizer(spec, params=[("w", SHAPE, torch.float64), ("b", B_SHAPE, torch.float64)], min_numel=1,
                          nonfinite="skip")
    got = []
    for step in range(steps):
        w, b = _grad(step, bad), _b(step)
        engine.sync(["w", "b"], [w, b], step=step)
        got.append((w, b))
    keep = lambda s: s not in bad  # noqa: E731
    if spec == "signum":
        refs = [signum_run(lambda s: [_grad(s)], steps, keep, 0.9), signum_run(lambda s: [_b(s)], steps, keep, 0.9)]
    else:  # DGC's default momentum
        refs = [dgc_run(lambda s: [_grad(s)], steps, keep, 0.05, 0.9), dgc_run(lambda s: [_b(s)], steps, keep, 0.05, 0.9)]
    for step in range(steps):
        for name, avg, ref in zip("wb", got[step], (refs[0][step], refs[1][step])):
            if ref is None:
                assert (avg == 0).all(), (spec, step, name)
            else:
                assert torch.allclose(avg, ref, rtol=0, atol=1e-12), (spec, step, name, (avg - ref).abs().max().item())
