"""An algorithm's load with ``scaler=`` is all or nothing across its two parts, the engine's state and the
scaler's (``loss_scaler``): one process, a one-rank gloo group, about 5 s.

``postlocalsgd`` (top-k with error feedback, so the engine holds residuals) under ``torch.amp.GradScaler("cpu")``
(``growth_interval=2``, so the scale and the growth tracker move) is saved after step 1 and stepped on to
step 3; the step-1 state, broken in one place, is loaded into it:

* a scaler field of the wrong kind (``_growth_tracker`` a string or negative, ``growth_factor`` a string or
  <= 1, ``backoff_factor`` >= 1, ``growth_interval`` 0 or a float) is refused with ``ValueError`` naming
  ``loss_scaler``, the field and its value, "nothing was loaded"; the algorithm's and the scaler's states are
  then those before the load, and the algorithm steps as its twin that never saw the load;
* an exchange state the engine refuses (a residual under a key no parameter builds) leaves the scaler as it
  was (its scale, growth tracker), though the state's ``loss_scaler`` differs;
* the unbroken state loads (steps, residuals and scale back to step 1's).
* two saved ranks' scaler states that differ (scale, growth count), folded onto one rank by the algorithm's
  reshard rule, pass the checks and load: the smallest scale, the growth count restarted, the engine's
  state the fold's; the next step goes on from there.
* LSGD, which captures the training loss from ``backward()``, elects on the unscaled loss under a scaler
  (the root of ``scaler.scale(loss).backward()`` divided by its scale).

Planted: ``AlgorithmScale.check_state`` without the per-field checks (as merged): ``_growth_tracker='x'`` raised
``TypeError`` (``fill_`` of a str) from ``scaler.load_state_dict``, which runs after the algorithm's part has
loaded; ``growth_factor='2'``, ``growth_interval=0`` and the
factors out of range loaded without a word (a string factor then fails the next ``scaler.update``).
Planted in ``algorithms/base.py:_fold_scaler``: the largest scale in place of the smallest: the fold case failed
on the loaded scaler's state.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from amp_helpers import HAS_CPU_SCALER, Probe, cpu_scaler
from distributed import one_rank_module
from state_diff import diff

import gradpress.algorithms as algorithms

group = one_rank_module
SHAPE = (16, 32)
pytestmark = pytest.mark.skipif(not HAS_CPU_SCALER, reason="this torch has no torch.amp.GradScaler for CPU")


def _grad(step: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(100 + step))


def _build() -> tuple[Probe, algorithms.Algorithm, Any]:
    model = Probe(SHAPE)
    scaler = cpu_scaler(2.0 ** 10)
    algo = algorithms.create("postlocalsgd:switch=8,period=2", model, torch.optim.SGD(model.parameters(), lr=0.1),
                             compressor="topk:ratio=0.05", min_numel=64, scaler=scaler)
    return model, algo, scaler


def _step(model: Probe, algo: algorithms.Algorithm, scaler: Any, step: int) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    scaler.scale(model(_grad(step))).backward()
    algo.step()
    return model.w.detach().clone()


def _twins() -> tuple[tuple[Probe, algorithms.Algorithm, Any], tuple[Probe, algorithms.Algorithm, Any], dict]:
    a, b = _build(), _build()
    saved = None
    for step in range(4):
        _step(*a, step)
        _step(*b, step)
        if step == 1:
            saved = copy.deepcopy(a[1].state_dict())
    assert saved is not None
    return a, b, saved


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("_growth_tracker", "x", "an integer >= 0"), ("_growth_tracker", -1, "an integer >= 0"),
    ("growth_factor", "2", "a finite number > 1"), ("growth_factor", 1.0, "a finite number > 1"),
    ("growth_factor", math.inf, "a finite number > 1"), ("backoff_factor", 1.0, "a number in (0, 1)"),
    ("growth_interval", 0, "an integer > 0"), ("growth_interval", 2.0, "an integer > 0"),
])
def test_a_bad_scaler_field_is_refused_before_anything_loads(group, field: str, value: Any,  # noqa: ANN001
                                                             allowed: str) -> None:
    (ma, a, sa), (mb, b, sb), saved = _twins()
    before, scaler_before = copy.deepcopy(a.state_dict()), dict(sa.state_dict())
    assert saved["steps"] != before["steps"] and saved["loss_scaler"] != scaler_before, "no test: nothing moved"
    saved["loss_scaler"][field] = value
    with pytest.raises(ValueError) as info:
        a.load_state_dict(saved)
    message = str(info.value)
    for fragment in (f"'loss_scaler'[{field!r}]", allowed, repr(value), "nothing was loaded"):
        assert fragment in message, (fragment, message)
    assert diff(before, a.state_dict(), "algorithm") is None
    assert sa.state_dict() == scaler_before
    for step in (4, 5):
        assert torch.equal(_step(ma, a, sa, step), _step(mb, b, sb, step)), step
        assert sa.state_dict() == sb.state_dict()


def test_a_refused_exchange_state_leaves_the_scaler_as_it_was(group) -> None:  # noqa: ANN001
    (_, a, sa), _, saved = _twins()
    scaler_before = dict(sa.state_dict())
    assert saved["loss_scaler"] != scaler_before
    saved["exchange"]["feedback"]["residuals"]["wx"] = torch.zeros(SHAPE)
    with pytest.raises(ValueError, match=r"\['wx'\].*never exchanges.*nothing was loaded"):
        a.load_state_dict(saved)
    assert sa.state_dict() == scaler_before


def test_the_unbroken_state_loads_whole(group) -> None:  # noqa: ANN001
    (_, a, sa), _, saved = _twins()
    a.load_state_dict(saved)
    assert sa.state_dict() == saved["loss_scaler"]
    assert diff(saved, a.state_dict(), timing=False) is None


def test_ranks_scaler_states_folded_onto_another_world_load_with_the_smallest_scale(group) -> None:  # noqa: ANN001
    """Two saved ranks whose scales and growth counts differ (a local overflow on one), folded onto one rank
    (``gradpress.exchange.reshard.fold``, the algorithm's rule): the fold passes the load's checks and the
    scaler takes the smallest saved scale with its growth count restarted; the engine's state is the fold's."""
    from gradpress.exchange.reshard import fold

    (_, a, sa), _, saved = _twins()
    other = copy.deepcopy(saved)
    other["loss_scaler"]["scale"] = saved["loss_scaler"]["scale"] / 2
    other["loss_scaler"]["_growth_tracker"] = 1
    folded = fold([saved, other], 0, 1)
    (mb, b, sb) = _build()
    b.load_state_dict(folded)
    want = {**saved["loss_scaler"], "scale": saved["loss_scaler"]["scale"] / 2, "_growth_tracker": 0}
    assert sb.state_dict() == want, (sb.state_dict(), want)
    assert diff(folded["exchange"]["feedback"], b.state_dict()["exchange"]["feedback"]) is None
    _step(mb, b, sb, 4)
    assert sb.get_scale() == want["scale"]  # a finite step, one of growth_interval=2: stepped on from the fold
    assert sb.state_dict()["_growth_tracker"] == 1


def test_lsgd_elects_on_the_unscaled_loss_it_captures_from_backward(group) -> None:  # noqa: ANN001
    """LSGD captures the training loss from ``backward()`` (``gradpress train`` calls ``step()`` without it);
    under a scaler the loop's backward is ``scaler.scale(loss).backward()``, whose root is the *scaled* loss.
    The running loss it elects on is the loss itself: after 2 steps (``tau=2``) the gathered loss is the
    float64 mean of the 2 steps' losses, whatever the scale (ranks whose scales differ after a local overflow
    compare the same quantity). Planted (as merged): the captured root taken as it is: 1024 times the mean."""
    model = Probe(SHAPE)
    with torch.no_grad():
        model.w.fill_(0.5)
    scaler = cpu_scaler(2.0 ** 10)
    algo = algorithms.create("lsgd:tau=2", model, torch.optim.SGD(model.parameters(), lr=0.1), min_numel=64,
                             scaler=scaler)
    losses = []
    for step in range(2):
        model.zero_grad(set_to_none=True)
        loss = model(_grad(step))
        losses.append(float(loss.detach().double()))
        scaler.scale(loss).backward()
        algo.step()
    want = (losses[0] + losses[1]) / 2
    got = float(algo.last_losses[0])
    assert abs(got - want) <= 1e-6 * abs(want), (got, want, scaler.get_scale())
    algo.close()
