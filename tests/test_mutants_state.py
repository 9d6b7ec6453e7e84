"""Checkpoint and state-dict details that the end-to-end resume tests do not
reach: written for survivors of ``make mutants`` (``state`` group:
train/checkpoint.py, ddp/state_format.py, algorithms/base.py,
train/optim.py). Single process, no workers: each test is a fraction of a
second.
"""

from __future__ import annotations

import pytest
import torch

from gradpress.train import checkpoint

pytestmark = pytest.mark.mutants


# ------------------------------------------------------------------ RNG state
@pytest.mark.parametrize("device,restored", [("cpu", False), ("cuda", True)])
def test_cuda_rng_state_is_restored_exactly_on_cuda(monkeypatch, device, restored):
    """Invariant (checkpoint module doc): a CUDA run restores its CUDA RNG
    state; a run on CPU resuming a checkpoint written on CUDA ignores it
    (and never touches CUDA). ``torch.cuda.set_rng_state`` is replaced by a
    recorder, so this runs without a GPU."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, dev: calls.append((state, dev)))
    cuda_state = torch.arange(16, dtype=torch.uint8)
    state = {**checkpoint.rng_state(torch.device("cpu")), "cuda": cuda_state}
    dev = torch.device(device)
    checkpoint.set_rng_state(state, dev)
    if restored:
        assert len(calls) == 1 and torch.equal(calls[0][0], cuda_state) and calls[0][1] == dev
    else:
        assert calls == []


# ------------------------------------------------------- algorithm state dicts
def _format_refusals(rank: int, world: int) -> dict:
    import gradpress.algorithms as algorithms

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    algo = algorithms.create("localsgd:period=2", model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(4, 3)).sum().backward()
    algo.step()
    good = algo.state_dict()
    refused = {}
    for name, state in {"later format": {**good, "format": "gradpress-algorithm/2"},
                        "other format": {**good, "format": "zzz/1"},
                        "no format": {k: v for k, v in good.items() if k != "format"},
                        "not a mapping": [good]}.items():
        try:
            algo.load_state_dict({**state, "steps": 99} if isinstance(state, dict) else state)
        except ValueError as exc:
            refused[name] = str(exc)
        except Exception as exc:  # noqa: BLE001 - reported: the test wants a ValueError
            refused[name] = f"not a ValueError: {type(exc).__name__}: {exc}"
    engine_good = algo.engine.state_dict()
    engine_refused = {}
    for name, state in {"later format": {**engine_good, "format": "gradpress-exchange/9"},
                        "no format": {k: v for k, v in engine_good.items() if k != "format"},
                        "not a mapping": [engine_good]}.items():
        try:
            algo.engine.load_state_dict(state)
        except ValueError as exc:
            engine_refused[name] = str(exc)
    steps_after = algo.state_dict()["steps"]
    algo.load_state_dict({**good, "steps": 5})
    return {"refused": refused, "steps_after": steps_after, "steps_good": good["steps"],
            "reloaded": algo.state_dict()["steps"], "format": good["format"], "engine_refused": engine_refused,
            "engine_format": engine_good["format"]}


def test_algorithm_state_of_another_format_is_refused_naming_it():
    """Invariant (``Algorithm.load_state_dict``): only a state dict of format
    ``gradpress-algorithm/1`` loads; any other format (a later one included),
    none, or not a mapping is a ValueError naming what was found and what is
    allowed, and the algorithm's state is left as it was."""
    from distributed import run_workers

    res = run_workers(_format_refusals, 1)[0]
    assert res["format"] == "gradpress-algorithm/1"
    found = {"later format": "'gradpress-algorithm/2'", "other format": "'zzz/1'", "no format": "None",
             "not a mapping": "a list"}
    assert set(res["refused"]) == set(found), res["refused"]
    for name, message in res["refused"].items():
        assert message.startswith("not a gradpress algorithm state dict"), (name, message)
        assert found[name] in message and "allowed: 'gradpress-algorithm/1'" in message, (name, message)
    assert res["steps_after"] == res["steps_good"] == 1 and res["reloaded"] == 5
    engine = {"later format": "'gradpress-exchange/9'", "no format": "None", "not a mapping": "a list"}
    assert set(res["engine_refused"]) == set(engine), res["engine_refused"]
    for name, message in res["engine_refused"].items():
        assert message.startswith("not a gradpress exchange state dict"), (name, message)
        assert engine[name] in message and f"allowed: {res['engine_format']!r}" in message, (name, message)


# ------------------------------------------------------------------ upgrade_layout
def _memory_order(r: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """By the definition (state_format module doc): before the layout change, element ``i`` of the flat
    residual was the one at memory position ``i`` of ``p``; the element at index ``idx`` of ``p`` sits at
    memory position ``sum(idx * stride)``. In float64, one index at a time."""
    flat, out = r.double().reshape(-1), torch.empty(p.shape, dtype=torch.float64)
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in p.shape]).tolist():
        out[tuple(idx)] = flat[sum(i * s for i, s in zip(idx, p.stride()))]
    return out


@pytest.mark.parametrize("name", ["conv.weight", "enc/conv.weight", "tag#v2.weight"])
def test_an_old_worker_residual_is_re_indexed_whatever_the_parameter_is_named(name):
    """A channels_last parameter's worker residual in a state from before the layout change is re-indexed,
    also for a parameter named with '/' or '#' (``nn.ModuleDict({"enc/conv": ...})``): the name is the whole
    key of a worker residual; a parameter named like its last part is not touched. As the hook loads it: its
    keys first made today's (``upgrade_keys``: the name escaped), then the layout."""
    from gradpress.ddp.state_format import upgrade_layout
    from gradpress.exchange.keys import escape, upgrade_keys

    p = torch.empty(3, 4, 2, 2).to(memory_format=torch.channels_last)
    other = torch.empty(3, 4, 2, 2).to(memory_format=torch.channels_last)
    r = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape)
    untouched = -torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape)
    state = {"feedback": {"residuals": {name: r, "conv.weight#0": untouched}}}
    params = {name: p} if name == "conv.weight" else {name: p, "other": other}
    fixed = upgrade_layout(upgrade_keys(state, list(params)), params)["feedback"]["residuals"]
    torch.testing.assert_close(fixed[escape(name)].double(), _memory_order(r, p), rtol=0, atol=0)
    if name != "conv.weight":  # conv.weight is no parameter here: its partition residual is kept as it was
        assert torch.equal(fixed["conv.weight#0"], untouched)


# ------------------------------------------------------------- resume checks
@pytest.mark.parametrize("split", ["labels:k=2", "dirichlet:alpha=0.5"])
def test_a_checkpoints_own_split_is_the_one_a_resume_must_match(tmp_path, split):
    """``check_resume``: a setting added after a checkpoint format takes its
    default (``split``: ``iid``) only where the checkpoint lacks it; a
    checkpoint that records a split resumes with that split and refuses
    another, ``iid`` included, naming both (the ``plants5`` session planted
    the defaults over the checkpoint's values: every non-IID run's resume
    refused, and its resume under ``iid`` accepted)."""
    from gradpress import train

    cfg = train.make_config({"workload": "digits-mlp", "out": str(tmp_path), "split": split})
    state = {"format": checkpoint.FORMAT, "config": checkpoint.compat(cfg, 2)}
    assert state["config"]["split"] == split
    checkpoint.check_resume(state, cfg, 2)
    iid = train.make_config({"workload": "digits-mlp", "out": str(tmp_path)})
    with pytest.raises(ValueError, match=f"split: checkpoint has '{split}', this run has 'iid'"):
        checkpoint.check_resume(state, iid, 2)
