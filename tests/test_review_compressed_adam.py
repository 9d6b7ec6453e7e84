"""Review of 1-bit Adam and 0/1 Adam edge cases (session 14, reviewer C).

A freeze at step 0 leaves no exact-Adam step to estimate the variance from:
1-bit Adam then masks every momentum (``v == 0`` everywhere) and no
parameter ever moves; 0/1 Adam enters its local phase without an anchor and
crashes at its first synchronization. Both are refused at parsing, naming
the field, the value and what is allowed."""

from __future__ import annotations

import pytest

import gradpress.algorithms as algorithms


@pytest.mark.parametrize("spec,field", [("onebit_adam:freeze_step=0", "freeze_step"),
                                        ("zeroone_adam:var_freeze_step=0", "var_freeze_step")])
def test_freeze_at_step_zero_is_refused(spec: str, field: str) -> None:
    with pytest.raises(ValueError, match=f"parameter '{field}' got 0; allowed: integer >= 1"):
        algorithms.parse(spec)


@pytest.mark.parametrize("spec", ["onebit_adam:freeze_step=1", "zeroone_adam:var_freeze_step=1"])
def test_freeze_after_one_step_is_allowed(spec: str) -> None:
    algorithms.parse(spec)
