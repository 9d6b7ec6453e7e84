"""``owner`` (:mod:`gradpress.exchange.feedback`, as algorithms/presence.py
uses it): written for a survivor of ``make mutants`` (``algobase`` group,
algorithms/presence.py, where ``owner`` was); the ``feedback`` group runs
it too. In one process.

``owner`` maps a residual store key to the parameter key it belongs to:
the key without its namespace (declared with
:func:`gradpress.exchange.feedback.namespace`: ``ring``, ``root``,
``host``; the worker's own residuals have none) and without the partition
suffixes the engine and the parameter server append (``#k``, ``#ps``,
``#k#ps``). The store keys here are built as the exchange builds them
(``Feedback.key``, ``f"{key}#{k}"``, ``f"{key}#ps"`` from the escaped name,
:func:`gradpress.exchange.keys.escape`); the expected owner is the parameter
key they were built from. Parameter names may hold '/' and '#':
``nn.ModuleDict({"enc/x": ...})`` names its parameters ``enc/x.weight``.

Also ``sync_agreeing``'s invariant (one gloo process): a parameter no rank
has gets no residual from the exchange it takes part in.
"""

from __future__ import annotations

import pytest
import torch

from gradpress.exchange.feedback import Feedback, escape, owner
from gradpress.exchange.strategies.hierarchical import HOST
from gradpress.exchange.strategies.ps import ROOT
from gradpress.exchange.strategies.ring import RING

pytestmark = pytest.mark.mutants

NAMES = ["fc.weight", "heads.enc/x.weight", "a/b/c.bias", "grad:heads.enc/x.weight", "tag#v2.weight", "b.weight"]


def _store_keys(name: str) -> list[str]:
    suffixes = ["", "#0", "#3", "#ps", "#1#ps"]
    return [Feedback.key(ns, escape(name) + s) for ns in ("", RING, ROOT, HOST) for s in suffixes]


@pytest.mark.parametrize("name", NAMES)
def test_owner_strips_only_the_namespace_and_the_partition_suffixes(name: str) -> None:
    for key in _store_keys(name):
        assert owner(key) == name, key


def test_the_names_of_a_module_dict_with_slashes_are_what_owner_keeps() -> None:
    model = torch.nn.ModuleDict({"enc/x": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
    names = [n for n, _ in model.named_parameters()]
    assert "enc/x.weight" in names
    for name in names:
        for key in _store_keys(name):
            assert owner(key) == name, key


def _first_compressed_step_without_the_side_head(rank: int, world: int) -> dict:
    from test_algorithms import batch
    from test_review_adam_none_grad import B1, B2, EPS, LR, Net

    import gradpress.algorithms as algorithms

    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=LR, betas=(B1, B2), eps=EPS)
    algo = algorithms.create("onebit_adam:freeze_step=2", net, opt, compressor="efsignsgd", min_numel=64)
    before = {}
    for step in range(3):  # t = 1, 2 exact (the side head used), t = 3 the first compressed one (no side head)
        before = {k: v.clone() for k, v in algo.engine.feedback.residuals.items()}
        opt.zero_grad(set_to_none=True)
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(net(x, step < 2)[:, :3], y).backward()
        algo.step()
    return {"before": before, "after": dict(algo.engine.feedback.residuals)}


def test_a_parameter_no_rank_has_gets_no_residual_from_the_exchange() -> None:
    """``sync_agreeing``'s invariant: a parameter that no rank has is exchanged too, but its residuals are put
    back as they were; one that had none before has none after. 1-bit Adam's first compressed step (t = 3)
    exchanges the side head's momentum (not zero: t = 1 and 2 used it) with no gradient on the one rank."""
    from distributed import run_workers

    (r,) = run_workers(_first_compressed_step_without_the_side_head, 1)
    side = {k for k in r["after"] if owner(k).startswith("side.")}
    assert side == {k for k in r["before"] if owner(k).startswith("side.")} == set(), sorted(r["after"])
    assert {"body.0.weight", "body.2.weight"} <= set(r["after"]), sorted(r["after"])  # the step was compressed
