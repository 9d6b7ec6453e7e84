"""``SyncGuard`` (gradpress/algorithms/sync_guard.py), the ``nonfinite`` protocol local SGD, DiLoCo, Streaming
DiLoCo, SCAFFOLD and ``ddp_step`` share around a synchronization, in one process (no worker, well under a
second): with ``skip`` a state tensor or buffer newly non-finite on this rank makes the first element of the
outgoing deltas NaN, for the parameters ``idx`` and the buffers it covers only, and a dropped synchronization
puts back the covered state and buffers (and averages nothing), one that went through averages what it is
given and refreshes the covered copy; with ``raise`` one flag per covered tensor rides under
``STATE_FLAGS_KEY`` and the check names the tensor; with ``propagate`` nothing is touched. The algorithms'
own runs through it are tests/test_skip_restart.py's."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from gradpress.algorithms.alarm import STATE_FLAGS_KEY, StateAlarm
from gradpress.algorithms.restart import LocalCopy
from gradpress.algorithms.sync_guard import SyncGuard

F64 = torch.float64


class FakeAlgo(SimpleNamespace):
    """What the guard reads of an algorithm: ``restart``, ``alarm``, ``engine.last_step_skipped`` and
    ``average_plain`` (recorded, not averaged)."""

    def average_plain(self, tensors: list[torch.Tensor]) -> None:
        self.averaged.append(tensors)


def _setup(mode: str) -> tuple[FakeAlgo, nn.Module, torch.optim.Optimizer]:
    """Two linear layers and a BatchNorm, one momentum SGD step taken (finite), the copy taken there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)).to(F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3, dtype=F64)).sum().backward()
    opt.step()
    algo = FakeAlgo(engine=SimpleNamespace(nonfinite=mode, last_step_skipped=False), optimizer=opt, model=model,
                    named=list(model.named_parameters()), averaged=[])
    algo.restart = LocalCopy.for_skip(algo)  # type: ignore[arg-type]
    algo.alarm = StateAlarm.for_raise(algo)  # type: ignore[arg-type]
    return algo, model, opt


def _momentum(opt: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
    return opt.state[p]["momentum_buffer"]


def _deltas(model: nn.Module) -> list[torch.Tensor]:
    return [torch.full_like(p, 0.5) for p in model.parameters()]


@pytest.mark.parametrize(("idx", "buffers", "dropped"), [
    (None, True, True), ([0], False, True), ([1, 2, 3], False, False), ([], True, True), ([], False, False)])
def test_skip_flags_only_what_the_synchronization_covers(idx: list[int] | None, buffers: bool, dropped: bool) -> None:
    """Parameter 0's momentum and the BatchNorm running variance go Inf after the copy: the deltas' first
    element becomes NaN exactly when the guard covers one of them, and nothing else changes."""
    algo, model, opt = _setup("skip")
    params = list(model.parameters())
    _momentum(opt, params[0])[0, 0] = math.inf
    model[1].running_var[1] = math.inf
    deltas = _deltas(model)
    guard = SyncGuard.before(algo, deltas, idx, buffers)  # type: ignore[arg-type]
    want = [torch.full_like(p, 0.5) for p in params]
    if dropped:
        want[0][0, 0] = math.nan
    for n, (d, w) in enumerate(zip(deltas, want)):
        assert torch.equal(d.isnan(), w.isnan()) and torch.equal(d.nan_to_num(), w.nan_to_num()), f"delta {n}"
    assert guard.flags is None and guard.riding(["a"], deltas[:1]) == (["a"], deltas[:1]) and guard.extra == []


@pytest.mark.parametrize(("idx", "buffers"), [(None, True), ([1], False), ([], True)])
def test_skip_settle_restores_a_dropped_synchronization_and_refreshes_one_that_went_through(
        idx: list[int] | None, buffers: bool) -> None:
    """Dropped: the covered parameters' momenta and (with ``buffers``) the buffers go back to the copy, the
    others keep their values, nothing is averaged. Went through: the given tensors are averaged, and the copy of
    what is covered is refreshed (a later drop restores the new values)."""
    algo, model, opt = _setup("skip")
    params = list(model.parameters())
    copied = [_momentum(opt, p).clone() for p in params]
    copied_var = model[1].running_var.clone()
    for p in params:
        _momentum(opt, p).add_(1.0)
    model[1].running_var.add_(1.0)
    moved = [_momentum(opt, p).clone() for p in params]
    guard = SyncGuard.before(algo, _deltas(model), idx, buffers)  # type: ignore[arg-type]
    algo.engine.last_step_skipped = True
    assert guard.check("step 3") is True
    assert guard.settle([model[1].running_var]) is False
    covered = set(range(len(params)) if idx is None else idx)
    for i, p in enumerate(params):
        assert torch.equal(_momentum(opt, p), copied[i] if i in covered else moved[i]), f"momentum {i}"
    assert torch.equal(model[1].running_var, copied_var if buffers else copied_var + 1.0)
    assert algo.averaged == []

    for p in params:
        _momentum(opt, p).fill_(7.0)
    model[1].running_var.fill_(3.0)
    algo.engine.last_step_skipped = False
    assert guard.check("step 6") is False
    plain = [model[1].running_var]
    assert guard.settle(plain) is True
    assert algo.averaged == [plain]
    for p in params:  # the copy refreshed where covered: restoring now gives 7 there, the old copy elsewhere
        _momentum(opt, p).fill_(-1.0)
    model[1].running_var.fill_(-1.0)
    algo.restart.restore()
    for i, p in enumerate(params):
        assert torch.equal(_momentum(opt, p), torch.full_like(p, 7.0) if i in covered else copied[i]), f"copy {i}"
    assert torch.equal(model[1].running_var, torch.full_like(copied_var, 3.0) if buffers else copied_var)


def test_raise_flags_ride_and_the_check_names_the_tensor() -> None:
    """One flag per covered parameter's state and per floating buffer (BatchNorm: running mean and variance),
    in the deltas' dtype, riding after the keys under STATE_FLAGS_KEY; averaged flags above 0 raise the
    ``FloatingPointError`` naming that tensor and the step; all zero: no error, and the check says the exchange
    went through."""
    algo, model, opt = _setup("raise")
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    _momentum(opt, params[2])[0] = math.inf
    deltas = _deltas(model)
    guard = SyncGuard.before(algo, deltas, [1, 2], buffers=True)  # type: ignore[arg-type]
    assert guard.flags is not None and guard.flags.dtype == F64
    assert guard.flags.tolist() == [0.0, 1.0, 0.0, 0.0]  # params 1 and 2, then running_mean, running_var
    assert all(torch.equal(d, torch.full_like(d, 0.5)) for d in deltas)  # raise flags, it does not touch deltas
    keys, tensors = guard.riding(["k0", "k1"], deltas[:2])
    assert keys == ["k0", "k1", STATE_FLAGS_KEY] and tensors[2] is guard.flags and tensors[:2] == deltas[:2]
    assert guard.extra == [(STATE_FLAGS_KEY, guard.flags)]
    with pytest.raises(FloatingPointError, match=rf"optimizer state of '{names[2]}' at step 9 on at least one"):
        guard.check("step 9")
    guard.flags.zero_()
    assert guard.check("step 9") is False
    quiet = SyncGuard.before(algo, deltas, [0, 1], buffers=False)  # type: ignore[arg-type]
    assert quiet.flags is not None and quiet.flags.tolist() == [0.0, 0.0]


def test_propagate_touches_nothing() -> None:
    """Neither copy nor alarm: deltas, keys and state as they were; settle averages what it is given."""
    algo, model, opt = _setup("propagate")
    params = list(model.parameters())
    _momentum(opt, params[0])[0, 0] = math.inf
    deltas = _deltas(model)
    guard = SyncGuard.before(algo, deltas)  # type: ignore[arg-type]
    assert all(torch.equal(d, torch.full_like(d, 0.5)) for d in deltas)
    assert guard.riding(["a"], deltas[:1]) == (["a"], deltas[:1]) and guard.extra == []
    assert guard.check("step 1") is False
    assert guard.settle(deltas) is True and algo.averaged == [deltas]
