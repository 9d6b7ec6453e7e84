"""The commit rule of error feedback's store (``exchange/feedback.py``, its
module docstring): a staged residual is kept only when the step is good on
every rank *and* the residual is finite; otherwise the old residual stays
(zeros when there was none). One process, no workers, well under a second.

Written for bugs planted by hand (docs/testing.md, "plants2" session) that
the ``feedback`` group's tests did not notice: a residual committed on a
dropped step, a non-finite residual kept, and a dropped step that resets
the residual to zero instead of keeping the old one. The expected residuals
are the float64 values the test staged itself.
"""

from __future__ import annotations

import pytest
import torch

from gradpress.exchange.feedback import Feedback

pytestmark = pytest.mark.mutants

F64 = torch.float64
OLD = torch.tensor([1.5, -2.0, 0.25, 3.0], dtype=F64)
NEW = torch.tensor([-4.0, 0.5, 7.0, -0.125], dtype=F64)


def _with_old() -> Feedback:
    fb = Feedback()
    fb.stage("w", OLD.clone())
    fb.commit(True)
    assert torch.equal(fb.residuals["w"], OLD)
    return fb


@pytest.mark.parametrize("verdict", [False, torch.tensor(False)], ids=["bool", "tensor"])
def test_a_dropped_step_keeps_the_old_residual(verdict: bool | torch.Tensor) -> None:
    """``commit(False)``: the staged residual is dropped, the old one stays as
    it was (neither the new one nor zeros), and the next step compensates with
    it: ``p = e_old + g``."""
    fb = _with_old()
    fb.stage("w", NEW.clone())
    fb.commit(verdict)
    assert torch.equal(fb.residuals["w"], OLD)
    g = torch.tensor([0.5, 0.5, -1.0, 2.0], dtype=F64)
    assert torch.equal(fb.compensate("w", g), g + OLD)
    fb.stage("w", NEW.clone())  # a good step afterwards replaces it
    fb.commit(True)
    assert torch.equal(fb.residuals["w"], NEW)


def test_a_step_dropped_before_any_residual_leaves_zeros() -> None:
    fb = Feedback()
    fb.stage("w", NEW.clone())
    fb.commit(False)
    assert torch.equal(fb.residuals["w"], torch.zeros_like(NEW))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_residual_is_never_kept(bad: float) -> None:
    """A good step whose residual holds a NaN or an infinity keeps the old
    residual; another key's finite residual of the same commit is kept."""
    fb = _with_old()
    fb.stage("v", OLD.clone() * 2)
    fb.commit(True)
    poisoned = NEW.clone()
    poisoned[2] = bad
    fb.stage("w", poisoned)
    fb.stage("v", NEW.clone())
    fb.commit(True)
    assert torch.equal(fb.residuals["w"], OLD)
    assert torch.equal(fb.residuals["v"], NEW)
    fresh = Feedback()  # and none before: zeros, never the non-finite one
    fresh.stage("w", poisoned.clone())
    fresh.commit(True)
    assert torch.equal(fresh.residuals["w"], torch.zeros_like(NEW))
