"""A keyword that ``gradpress.algorithms.create`` does not know names both what it takes: the algorithm's
parameters and the options every algorithm shares. Before, a typo such as ``compresor="topk"`` (or
``scaler=`` before the algorithms took it) said "unknown parameter 'compresor'; allowed parameters:
period, ..." and listed only the spec's parameters, so the message hid that ``compressor=`` exists. And
``create("ddp", ...)``, the name ``gradpress train --algorithm`` takes, said only "unknown algorithm 'ddp'";
it now points to ``gradpress.ddp.register``. One one-process gloo group for the module; 35 s on the shared
2 cores at load 10, most of it the first construction."""
from __future__ import annotations

import inspect

import pytest
import torch
from distributed import one_rank_module

import gradpress.algorithms as algorithms
from gradpress.algorithms.base import Algorithm

one_rank = one_rank_module  # the module-scoped one-process group (tests/distributed.py)


def shared_options() -> list[str]:
    """The keyword-only arguments of ``Algorithm.__init__``, read from its signature (not from the code's
    list), in their order: what every algorithm accepts besides its ``PARAMS``."""
    return [n for n, p in inspect.signature(Algorithm.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY]


def model_and_adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)  # Adam: every algorithm accepts it


@pytest.mark.parametrize("name", algorithms.names())
def test_a_misspelled_option_names_the_parameters_the_options_and_the_near_miss(one_rank, name: str) -> None:  # noqa: ANN001
    params = ", ".join(p.name for p in algorithms.get_class(name).PARAMS) or "none"
    options = ", ".join(shared_options())
    model, opt = model_and_adam()
    with pytest.raises(ValueError) as exc:
        algorithms.create(name, model, opt, compresor="topk:ratio=0.1")
    assert (f"algorithm {name!r}: unknown parameter or option 'compresor' (did you mean 'compressor'?); "
            f"allowed parameters: {params}; allowed options: {options}") in str(exc.value), str(exc.value)


def test_a_scaler_given_to_an_algorithm_that_cannot_follow_it_is_refused_naming_why(one_rank) -> None:  # noqa: ANN001
    """``scaler=`` is a shared option (tests/test_review_ampalgo.py runs it); an algorithm that cannot follow a
    loss scaler refuses it by name with its reason, not as an unknown option."""
    assert "scaler" in shared_options()
    model, opt = model_and_adam()
    with pytest.raises(ValueError) as exc:
        algorithms.create("comprex", model, opt, scaler=torch.amp.GradScaler("cpu"))
    message = str(exc.value)
    assert "algorithm 'comprex': scaler= is not supported: the gradient exchange of step t is applied at step " \
           "t + s" in message, message
    assert "unknown" not in message, message


def test_every_shared_option_is_accepted(one_rank) -> None:  # noqa: ANN001
    """The listed options are the ones construction takes: each given its default value builds."""
    defaults = {n: p.default for n, p in inspect.signature(Algorithm.__init__).parameters.items()
                if p.kind is p.KEYWORD_ONLY}
    model, opt = model_and_adam()
    algo = algorithms.create("localsgd:period=2", model, opt, **defaults)
    try:
        assert algo.spec() == "localsgd:period=2,optimizer_state=auto"
    finally:
        algo.close()


def test_ddp_is_pointed_to_the_hook() -> None:
    model, opt = model_and_adam()
    for call in (lambda: algorithms.create("ddp", model, opt), lambda: algorithms.parse("ddp")):
        with pytest.raises(ValueError) as exc:
            call()
        message = str(exc.value)
        assert message.startswith("algorithm 'ddp' is not built by gradpress.algorithms: it is "
                                  "DistributedDataParallel with the gradpress hook, "
                                  "gradpress.ddp.register(DistributedDataParallel(model), compressor)"), message
        assert f"allowed here: {', '.join(algorithms.names())}" in message, message
