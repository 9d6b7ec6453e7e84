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


# ------------------------------------------- the host layout resolved (hierarchical's workers_per_host=0)
@pytest.fixture
def layout_env(monkeypatch):
    """Set the host-layout environment of this test alone (GRADPRESS_WORKERS_PER_HOST, LOCAL_WORLD_SIZE)."""
    from gradpress.exchange.strategies.hierarchical_layout import ENV_VARS

    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)

    def put(**env: str) -> None:
        for var, value in env.items():
            monkeypatch.setenv(var, value)

    return put


@pytest.mark.parametrize("env,world,local_world,per", [
    ({"GRADPRESS_WORKERS_PER_HOST": "2"}, 4, None, 2),
    ({"LOCAL_WORLD_SIZE": "2"}, 4, None, 2),
    ({"GRADPRESS_WORKERS_PER_HOST": "4", "LOCAL_WORLD_SIZE": "2"}, 8, None, 4),  # the strategy's own order
    ({}, 4, None, 1),  # no environment: one rank per host
    ({}, 4, 2, 2),  # a launcher about to start 2 local workers (their LOCAL_WORLD_SIZE)
    ({"LOCAL_WORLD_SIZE": "2"}, 1, None, 1),  # a world of one is one host
])
def test_resolved_form_writes_the_host_layout_out(layout_env, env, world, local_world, per):
    """`hierarchical:workers_per_host=2` and `hierarchical` under GRADPRESS_WORKERS_PER_HOST=2 or
    LOCAL_WORLD_SIZE=2 run one layout; their canonical forms and keys differ (workers_per_host=2 against 0), so a
    resume compared them as two configurations. The resolved form writes the layout the strategy would build."""
    from gradpress.exchange.base import canonical_strategy, resolved_strategy, same_strategy

    layout_env(**env)
    expected = f"hierarchical:workers_per_host={per},outer=collective,chunk=262144"
    assert resolved_strategy("hierarchical", world, local_world) == expected
    assert resolved_strategy(f"hierarchical:chunk=262144,workers_per_host={per}", world, local_world) == expected
    assert same_strategy(f"hierarchical:workers_per_host={per}", "hierarchical", world, local_world)
    assert same_strategy("hierarchical", f"hierarchical:workers_per_host={per}", world, local_world)
    if world > 1:  # another layout is another configuration
        assert not same_strategy(f"hierarchical:workers_per_host={2 * per}", "hierarchical", world, local_world)
    assert not same_strategy("hierarchical:outer=ring", "hierarchical", world, local_world)
    assert canonical_strategy("hierarchical") == "hierarchical:workers_per_host=0,outer=collective,chunk=262144"
    assert resolved_strategy("ring:", world) == "ring" and resolved_strategy("collective", world) == "collective"


def _resume_with_the_layout_spelled_another_way(rank: int, world: int) -> dict:
    """An engine saved under one spelling of the layout; one built under the other spelling loads the state and
    continues exactly as the first one does; a real change of layout is refused."""
    import os

    def build(spec: str, env: dict) -> Synchronizer:
        for var in ("GRADPRESS_WORKERS_PER_HOST", "LOCAL_WORLD_SIZE"):
            os.environ.pop(var, None)
        os.environ.update(env)
        return Synchronizer("topk:ratio=0.1", params=PARAMS, strategy=spec, error_feedback=True, min_numel=16)

    def grads(step: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(100 * step + rank)
        return [torch.randn(64, 40, generator=gen, dtype=torch.float32)]

    out: dict = {}
    for (saved, saved_env), (given, given_env) in [
        (("hierarchical:workers_per_host=2", {}), ("hierarchical", {"LOCAL_WORLD_SIZE": "2"})),
        (("hierarchical", {"GRADPRESS_WORKERS_PER_HOST": "1"}), ("hierarchical:workers_per_host=1", {})),
    ]:
        first = build(saved, saved_env)
        for step in range(2):
            first.sync(["w"], grads(step), step=step)
        state = first.state_dict()
        expected = grads(2)
        first.sync(["w"], expected, step=2)  # in place: the average the saved run goes on to
        second = build(given, given_env)
        try:
            second.load_state_dict(state)
            resumed = grads(2)
            second.sync(["w"], resumed, step=2)
            out[given] = torch.equal(resumed[0], expected[0]) and not torch.equal(resumed[0], grads(2)[0])
        except ValueError as exc:
            out[given] = str(exc)
    third = build("hierarchical", {"GRADPRESS_WORKERS_PER_HOST": "1"})  # 1 rank per host; the state was saved at 2
    first = build("hierarchical:workers_per_host=2", {})
    try:
        third.load_state_dict(first.state_dict())
    except ValueError as exc:
        out["other_layout"] = str(exc)
    return out


def test_a_resume_compares_the_resolved_host_layout():
    for r in run_workers(_resume_with_the_layout_spelled_another_way, 2):
        assert r["hierarchical"] is True, r  # saved as workers_per_host=2, resumed from LOCAL_WORLD_SIZE=2
        assert r["hierarchical:workers_per_host=1"] is True, r  # saved from GRADPRESS_WORKERS_PER_HOST=1
        assert ("strategy: checkpoint has 'hierarchical:workers_per_host=2', this run has 'hierarchical'"
                in r["other_layout"]), r
