"""Review of 1-bit Adam and 0/1 Adam edge cases (session 14, reviewer C).

A freeze at step 0 leaves no exact-Adam step to estimate the variance from:
1-bit Adam then masks every momentum (``v == 0`` everywhere) and no
parameter ever moves; 0/1 Adam enters its local phase without an anchor and
crashes at its first synchronization. Both are refused at parsing, naming
the field, the value and what is allowed. A trainable parameter held by
the optimizer but not by the model is refused too: the algorithm never
calls ``optimizer.step()``, so it would silently never be trained."""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers, value_errors
from test_algorithms import make_model

import gradpress.algorithms as algorithms


@pytest.mark.parametrize("spec,field", [("onebit_adam:freeze_step=0", "freeze_step"),
                                        ("zeroone_adam:var_freeze_step=0", "var_freeze_step")])
def test_freeze_at_step_zero_is_refused(spec: str, field: str) -> None:
    with pytest.raises(ValueError, match=f"parameter '{field}' got 0; allowed: integer >= 1"):
        algorithms.parse(spec)


@pytest.mark.parametrize("spec", ["onebit_adam:freeze_step=1", "zeroone_adam:var_freeze_step=1"])
def test_freeze_after_one_step_is_allowed(spec: str) -> None:
    algorithms.parse(spec)


def _extra_param_worker(rank: int, world: int) -> dict:
    def build(case: str) -> object:
        model = make_model()
        extra = [torch.nn.Parameter(torch.ones(3, dtype=torch.float64))]  # a learnable loss weight, say
        if case == "frozen":
            extra[0].requires_grad_(False)  # never stepped by torch's Adam either: allowed
        opt = torch.optim.Adam(list(model.parameters()) + extra, lr=0.01)
        return algorithms.create("onebit_adam:freeze_step=2", model, opt)

    return value_errors(build, {"trainable": "trainable", "frozen": "frozen"})


def test_optimizer_parameter_outside_the_model_is_refused() -> None:
    """The algorithm steps the model's parameters itself and never calls
    ``optimizer.step()``: a trainable parameter that only the optimizer
    holds would silently never be trained, so construction refuses it."""
    for errors in run_workers(_extra_param_worker, 2):
        msg = errors["trainable"]
        assert msg is not None, "an optimizer parameter outside the model was silently never trained"
        for words in ("optimizer param_groups[0]", "shape (3,)", "not a trainable parameter of the model"):
            assert words in msg, (words, msg)
        assert errors["frozen"] is None
