"""gradpress/exchange/nonfinite.py's StepGuard in one process (the `guards` group's tests of it), with a
stand-in state (a counter the step's calls advance), a stand-in feedback store (records what it was asked to
commit) and the real stats counter; every expectation is what the module's docstring says each mode does:

* the state's copy is taken once per step, at its first call, under ``skip`` and under ``propagate`` while
  ``keep_on_propagate`` is set (a loss scaler attached), never under ``raise``, never for a call encoded
  ahead; it is put back at the step's end only when some call of the step saw a NaN/Inf;
* ``propagate`` drops nothing (no tensor zeroed); ``skip`` zeroes the bad call and says so; ``raise`` names
  the bad tensors and the step;
* the step's residuals are committed unless some call was bad; the step is counted in ``nonfinite_steps``
  (and ``skipped_steps`` under skip) and ``last_skipped`` is True only under skip after a bad step.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from gradpress.exchange.nonfinite import StepGuard, local_flags, nonfinite_gradient_error, zeroer
from gradpress.exchange.stats import ExchangeStats

pytestmark = pytest.mark.mutants


class _State:
    """What the compressor and strategies keep: a counter each call advances."""

    def __init__(self) -> None:
        self.value = 0
        self.copies = 0
        self.restored: list[int] = []

    def snapshot(self) -> dict[str, Any]:
        self.copies += 1
        return {"value": self.value}

    def restore(self, saved: dict[str, Any]) -> None:
        self.restored.append(saved["value"])
        self.value = saved["value"]


class _Feedback:
    def __init__(self) -> None:
        self.commits: list[bool] = []

    def commit(self, step_ok: torch.Tensor | bool = True) -> None:
        self.commits.append(bool(step_ok))


def _guard(mode: str, keep: bool = False) -> tuple[StepGuard, _State, _Feedback, ExchangeStats]:
    state, stats = _State(), ExchangeStats(count_skipped=mode == "skip")
    mode = "".join(list(mode))  # a new string, as read from a command line or a config file (not the literal)
    guard = StepGuard(mode, state.snapshot, state.restore, stats)
    if keep:  # else the default: no scaler attached
        guard.keep_on_propagate = True
    return guard, state, _Feedback(), stats


def _call(guard: StepGuard, state: _State, bad: list[bool], step: int = 1,
          snapshot: bool = True) -> tuple[bool, list[torch.Tensor]]:
    """One call of two tensors, flags ``bad`` summed over ranks; returns (dropped, its tensors)."""
    guard.begin_call(snapshot=snapshot)
    state.value += 1  # the call moves the state
    tensors = [torch.ones(3), torch.full((2,), 2.0)]
    dropped = guard.observe(torch.tensor(bad), ["a", "b"], step, zeroer(tensors, None))
    return dropped, tensors


@pytest.mark.parametrize("mode,keep,copies", [("skip", False, True), ("propagate", True, True),
                                              ("propagate", False, False), ("raise", False, False)])
def test_the_state_is_copied_once_per_step_in_the_modes_that_put_it_back(mode, keep, copies) -> None:
    guard, state, feedback, _ = _guard(mode, keep)
    for step in (1, 2):
        _call(guard, state, [False, False], step)
        _call(guard, state, [False, False], step)
        guard.end_step(feedback)
    assert state.copies == (2 if copies else 0)  # one per step, at its first call
    assert state.restored == [] and state.value == 4  # nothing bad: the state moves on
    assert feedback.commits == [True, True]


def test_a_call_encoded_ahead_takes_no_copy() -> None:
    guard, state, feedback, _ = _guard("skip")
    _call(guard, state, [False, True], snapshot=False)
    guard.end_step(feedback)
    assert state.copies == 0 and state.restored == [] and state.value == 1


@pytest.mark.parametrize("mode,keep", [("skip", False), ("propagate", True)])
def test_a_bad_call_puts_the_steps_state_back_and_keeps_the_residuals(mode, keep) -> None:
    guard, state, feedback, stats = _guard(mode, keep)
    state.value = 10
    _call(guard, state, [False, False], step=3)
    dropped, tensors = _call(guard, state, [False, True], step=3)  # the step's second call is bad somewhere
    _call(guard, state, [False, False], step=3)
    guard.end_step(feedback)
    assert state.restored == [10] and state.value == 10  # as at the step's start
    assert feedback.commits == [False]
    assert guard.last_skipped is (mode == "skip")
    counted = stats.snapshot()
    assert counted["nonfinite_steps"] == 1 and counted["skipped_steps"] == (1 if mode == "skip" else 0)
    if mode == "skip":
        assert dropped and all(bool((t == 0).all()) for t in tensors)
    else:
        assert not dropped and [t.tolist() for t in tensors] == [[1.0] * 3, [2.0] * 2]  # the engine fills NaN
    # the next step is clean: a fresh copy, the state moves on, residuals committed, nothing skipped
    _call(guard, state, [False, False], step=4)
    guard.end_step(feedback)
    assert state.copies == 2 and state.restored == [10] and state.value == 11
    assert feedback.commits == [False, True] and guard.last_skipped is False
    assert stats.snapshot()["nonfinite_steps"] == 1


def test_without_keep_on_propagate_a_bad_step_moves_the_state_and_drops_only_the_residuals() -> None:
    guard, state, feedback, stats = _guard("propagate", keep=False)
    dropped, _ = _call(guard, state, [True, False])
    guard.end_step(feedback)
    assert not dropped and state.copies == 0 and state.restored == [] and state.value == 1
    assert feedback.commits == [False] and guard.last_skipped is False
    assert stats.snapshot()["nonfinite_steps"] == 1


def test_a_step_without_calls_commits_and_is_not_skipped() -> None:
    guard, state, feedback, stats = _guard("skip")
    _call(guard, state, [True, True])
    guard.end_step(feedback)
    assert guard.last_skipped is True
    guard.end_step(feedback)  # a step whose calls noted nothing
    assert feedback.commits == [False, True] and guard.last_skipped is False
    assert stats.snapshot()["skipped_steps"] == 1


def test_raise_names_the_bad_tensors_and_the_step() -> None:
    guard, state, feedback, _ = _guard("raise")
    with pytest.raises(FloatingPointError) as info:
        _call(guard, state, [True, False], step=7)
    assert str(info.value) == str(nonfinite_gradient_error(["a"], "step 7"))
    assert "'a' at step 7" in str(info.value) and "'b'" not in str(info.value)
    tensors = [torch.ones(2), torch.tensor([1.0, math.inf]), torch.tensor([math.nan])]
    with pytest.raises(FloatingPointError, match=r"in 'y', 'z' at step 2 on at least one rank"):
        guard.observe_dense(torch.tensor(True), ["x", "y", "z"], tensors, 2, zeroer(tensors, None))


@pytest.mark.parametrize("mode", ["propagate", "skip", "raise"])
def test_an_overflowed_average_is_a_bad_step_in_every_mode(mode) -> None:
    guard, state, feedback, stats = _guard(mode, keep=True)
    guard.begin_call()
    flat = torch.ones(4)
    tensors = [flat[:2], flat[2:]]
    if mode == "raise":
        with pytest.raises(FloatingPointError, match=r"non-finite average \(NaN/Inf\) of finite gradients in 'q' "
                                                     r"at step 5: the exchange overflowed"):
            guard.observe_results(torch.tensor([False, True]), ["p", "q"], 5, zeroer(tensors, flat))
        return
    dropped = guard.observe_results(torch.tensor([False, True]), ["p", "q"], 5, zeroer(tensors, flat))
    assert dropped is (mode == "skip")
    assert flat.tolist() == ([0.0] * 4 if mode == "skip" else [1.0] * 4)
    assert not guard.observe_results(torch.tensor([False, False]), ["p", "q"], 5, zeroer(tensors, flat))
    guard.end_step(feedback)
    assert feedback.commits == [False] and stats.snapshot()["nonfinite_steps"] == 1


def test_dense_calls_skip_only_when_a_tensor_is_bad() -> None:
    guard, state, feedback, _ = _guard("skip")
    guard.begin_call()
    good = [torch.ones(2)]
    guard.observe_dense(torch.tensor(False), ["g"], good, 1, zeroer(good, None))
    assert good[0].tolist() == [1.0, 1.0]
    guard.end_step(feedback)
    assert feedback.commits == [True] and not guard.last_skipped
    guard.begin_call()
    bad = [torch.ones(2), torch.tensor([math.inf])]
    guard.observe_dense(StepGuard.any_bad(bad), ["g", "h"], bad, 2, zeroer(bad, None))
    assert [t.tolist() for t in bad] == [[0.0, 0.0], [0.0]]
    guard.end_step(feedback)
    assert feedback.commits == [True, False] and guard.last_skipped
    guard, state, feedback, stats = _guard("propagate", keep=True)  # the NaN travels as in plain DDP
    guard.begin_call()
    bad = [torch.ones(2), torch.tensor([math.inf])]
    guard.observe_dense(StepGuard.any_bad(bad), ["g", "h"], bad, 2, zeroer(bad, None))
    assert [t.tolist() for t in bad] == [[1.0, 1.0], [math.inf]]
    guard.end_step(feedback)
    assert feedback.commits == [False] and not guard.last_skipped and stats.snapshot()["nonfinite_steps"] == 1


def test_local_flags_and_the_zeroer() -> None:
    tensors = [torch.tensor([1.0, math.nan], dtype=torch.float16), torch.ones(2),
               torch.tensor([-math.inf])]
    flags = local_flags(tensors, None)
    assert flags.tolist() == [1.0, 0.0, 1.0] and flags.dtype == torch.float16  # the first tensor's dtype
    flat = torch.zeros(5, dtype=torch.bfloat16)
    assert local_flags(tensors, flat).dtype == torch.bfloat16  # the buffer's
    ints = [torch.ones(2, dtype=torch.int64)]
    assert local_flags(ints, None).dtype == torch.float32  # not floating: float32
    one = local_flags([torch.tensor([math.nan, 1.0], dtype=torch.float64)], None)  # a call of one tensor
    assert one.tolist() == [1.0] and one.dtype == torch.float64
    assert StepGuard.not_finite(torch.tensor([1.0, math.nan])).item() is True
    assert StepGuard.not_finite(torch.ones(3)).item() is False
    flat = torch.ones(4)
    other = torch.ones(2)
    zeroer([other], flat)()  # the buffer is zeroed, not the tensors handed beside it
    assert flat.tolist() == [0.0] * 4 and other.tolist() == [1.0, 1.0]
