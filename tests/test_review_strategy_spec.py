"""Review: one strategy spelled two ways (defaults written out, parameters
in another order, a number written another way) is one configuration: for
the ranks that must agree on it and for a resumed run's exchange state.
A real difference is still refused."""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers

from gradpress.exchange.agree import agree
from gradpress.exchange.engine import Synchronizer

PARAMS = [("w", [64, 40], torch.float32)]


@pytest.mark.parametrize("spec,canonical,key", [
    ("hierarchical", "hierarchical:workers_per_host=0,outer=collective,chunk=262144", "hierarchical"),
    ("hierarchical:chunk=262144", "hierarchical:workers_per_host=0,outer=collective,chunk=262144", "hierarchical"),
    (" hierarchical:chunk=2.62144e5 , outer=ring", "hierarchical:workers_per_host=0,outer=ring,chunk=262144",
     "hierarchical:outer=ring"),
    ("hierarchical:outer=ring,chunk=0,workers_per_host=2", "hierarchical:workers_per_host=2,outer=ring,chunk=0",
     "hierarchical:chunk=0,outer=ring,workers_per_host=2"),
    ("ring:", "ring", "ring"), ("collective", "collective", "collective"), ("auto", "auto", "auto"),
])
def test_canonical_forms_of_a_strategy_spec(spec, canonical, key):
    from gradpress.exchange.base import canonical_strategy, strategy_key

    assert canonical_strategy(spec) == canonical
    assert strategy_key(spec) == key


def test_canonical_form_refuses_a_bad_spec_naming_the_parameter():
    from gradpress.exchange.base import canonical_strategy

    with pytest.raises(ValueError, match=r"strategy 'hierarchical': parameter 'chunk' got -1; allowed: chunk >= 0"):
        canonical_strategy("hierarchical:chunk=-1")
    with pytest.raises(ValueError, match=r"unknown strategy 'rung'; allowed: .*ring"):
        canonical_strategy("rung")


def _two_spellings(rank: int, world: int) -> dict:
    """Rank 0 and rank 1 name the same strategy differently; they must agree.
    Then resume checks on an exchange state named as an earlier version
    named it (the parameters as given, sorted)."""
    spec = ["hierarchical:workers_per_host=1", "hierarchical:chunk=262144.0,workers_per_host=1,outer=collective"][rank]
    engine = Synchronizer("topk:ratio=0.1", params=PARAMS, strategy=spec, error_feedback=True, min_numel=16)
    agree(engine.config(), None, None)  # raised "configuration differs between ranks" when named as spelled
    ts = [torch.full((64, 40), float(rank + 1)) + torch.arange(2560.0).view(64, 40) / 100]
    engine.sync(["w"], ts, step=0)
    out: dict = {"name": engine.strategy_name}

    legacy = "hierarchical:chunk=262144,workers_per_host=1"  # how the previous code named rank 1's spec... sorted
    state = engine.state_dict()
    state["config"]["strategy"] = legacy
    state["strategies"] = {legacy: state["strategies"][engine.strategy_name]}
    engine.load_state_dict(state)
    out["legacy_loaded"] = True

    state["strategies"] = {legacy: dict(state["strategies"][legacy], outer="ring")}
    try:
        engine.load_state_dict(state)  # the legacy entry is this strategy's: it is checked, not skipped
    except ValueError as exc:
        out["legacy_checked"] = str(exc)

    other = engine.state_dict()
    other["config"]["strategy"] = "hierarchical:chunk=0,workers_per_host=1"
    try:
        engine.load_state_dict(other)
    except ValueError as exc:
        out["other_refused"] = str(exc)
    return out


def test_ranks_and_resumes_agree_on_one_strategy_spelled_two_ways():
    results = run_workers(_two_spellings, 2)
    for r in results:
        assert r["name"] == "hierarchical:workers_per_host=1"
        assert r["legacy_loaded"]
        assert "checkpoint has outer='ring'" in r["legacy_checked"]
        assert ("strategy: checkpoint has 'hierarchical:chunk=0,workers_per_host=1', "
                "this run has 'hierarchical:workers_per_host=1'") in r["other_refused"]
