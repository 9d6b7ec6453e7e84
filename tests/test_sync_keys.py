"""``Algorithm.sync(tensors, keys)`` refuses an engine key that ``exchanged_params()`` does not register and that
is not one of the library's helper keys (under ``gradpress/``: the presence flags, the ``nonfinite='raise'``
flags, local SGD's state-missing flags), naming the key, the algorithm and ``exchanged_params``, before any
collective. Before, such a key (a typo such as ``control.w`` for ``control:w``, or a tensor the author forgot to
register) silently got the engine's default plan and was left out of the ranks' agreement check. One process,
a gloo world of one (in this process), under a second."""

from __future__ import annotations

import pytest
import torch
from distributed import one_rank_module

import gradpress.algorithms as algorithms
from gradpress.algorithms.alarm import STATE_FLAGS_KEY
from gradpress.algorithms.presence import PRESENT_KEY

one_rank = one_rank_module  # the module-scoped one-process group (tests/distributed.py)


def _algo(spec: str):  # noqa: ANN202
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return algorithms.create(spec, model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize(("spec", "key"), [("localsgd:period=2", "no-such-key"),
                                           ("scaffold:period=2", "control.weight"),
                                           ("diloco:period=2,select=model", "weight")])
def test_an_unregistered_key_is_refused_naming_it(one_rank, spec: str, key: str) -> None:  # noqa: ANN001
    """``diloco:select=model`` registers only ``diloco/model``: its parameter names are unknown keys there."""
    algo = _algo(spec)
    before = algo.stats["exchanges"]
    tensors = [torch.zeros(2, 3), torch.zeros(2)]
    with pytest.raises(ValueError) as exc:
        algo.sync(tensors, keys=[key, "bias" if key != "bias" else "weight"])
    msg = str(exc.value)
    name = spec.split(":")[0]
    assert msg.startswith(f"algorithm {name!r}: sync key {key!r} is not registered by exchanged_params()"), msg
    assert "allowed: a key exchanged_params() returns" in msg and "'gradpress/'" in msg, msg
    assert algo.stats["exchanges"] == before  # refused before anything was exchanged


def test_registered_and_helper_keys_still_sync(one_rank) -> None:  # noqa: ANN001
    """The parameters' names (given or by default), the registered extra keys and the helper keys go through."""
    algo = _algo("scaffold:period=2")
    w, b = torch.ones(2, 3), torch.full((2,), 2.0)
    algo.sync([w, b])
    algo.sync([w, b, torch.zeros(2, 3), torch.ones(2), torch.tensor([1.0, 0.0])],
              keys=["weight", "bias", "control:weight", "control:bias", PRESENT_KEY])
    algo.sync([w, torch.zeros(3)], keys=["weight", STATE_FLAGS_KEY])
    assert algo.stats["exchanges"] == 3
    assert torch.equal(w, torch.ones(2, 3)) and torch.equal(b, torch.full((2,), 2.0))  # a world of one: as sent


def test_the_helper_keys_are_under_the_helper_prefix() -> None:
    """Every flag key the library rides unregistered is under ``HELPER_PREFIX`` (else its own callers would be
    refused)."""
    from gradpress.algorithms.exchange_helpers import HELPER_PREFIX
    from gradpress.algorithms.localsgd import STATE_MISSING_KEY

    for key in (PRESENT_KEY, STATE_FLAGS_KEY, STATE_MISSING_KEY):
        assert key.startswith(HELPER_PREFIX), key
