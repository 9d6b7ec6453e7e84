"""``gradpress train`` refuses, before any worker starts, what an
algorithm's construction would refuse knowing only the configuration
(``Algorithm.preflight``), with the message the workers would give; found
by a fuzz of the command line, where these were refused 5-11 s later, by
the workers."""

from __future__ import annotations

import re

import pytest
import torch
from distributed import run_workers

import gradpress.algorithms as algorithms
from gradpress.train.config import make_config

REFUSED = {  # overrides -> what the message must say
    "onebit with SGD": ({"algorithm": "onebit_adam:freeze_step=3", "optimizer": "sgd"}, "must be torch.optim.Adam"),
    "zeroone with momentum": ({"algorithm": "zeroone_adam", "optimizer": "momentum"}, "must be torch.optim.Adam"),
    "gossip skip": ({"algorithm": "sgp", "nonfinite": "skip"}, "nonfinite='skip' is not supported"),
    "gossip raise": ({"algorithm": "choco", "nonfinite": "raise"}, "nonfinite='raise' is not supported"),
    "gossip strategy": ({"algorithm": "choco", "strategy": "ring"}, "strategy 'ring' does not apply"),
    "exact gossip compressed": ({"algorithm": "dpsgd", "compressor": "topk:ratio=0.1"}, "gossips exact parameters"),
    "sgp peers": ({"algorithm": "sgp:peers=9"}, "parameter 'peers' got 9"),
    "lsgd groups": ({"algorithm": "lsgd:groups=3"}, "parameter 'groups' got 3; allowed: a divisor of the world size 2"),
    "lsgd average": ({"algorithm": "lsgd:average=true", "compressor": "topk:ratio=0.1"}, "'average' is true"),
    # skip and raise were accepted and did nothing: a worker with one Inf gradient stayed NaN for good
    # (the pull keeps its NaN, it never leads), no step was skipped, nothing raised (tests/test_skip_restart.py)
    "lsgd skip": ({"algorithm": "lsgd", "nonfinite": "skip"}, "algorithm 'lsgd': nonfinite='skip' is not supported"),
    "lsgd raise": ({"algorithm": "lsgd:tau=2", "nonfinite": "raise", "compressor": "topk:ratio=0.1"},
                   "algorithm 'lsgd': nonfinite='raise' is not supported"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_before_workers_start(case: str, tmp_path) -> None:  # noqa: ANN001
    overrides, says = REFUSED[case]
    with pytest.raises(ValueError, match=re.escape(says)):
        make_config(None, workload="digits-mlp", nproc=2, out=str(tmp_path), **overrides)


def test_world_size_checks_wait_for_a_known_world(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    make_config(None, workload="digits-mlp", out=str(tmp_path), algorithm="sgp:peers=9")  # torchrun decides later
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun: the world is known
    with pytest.raises(ValueError, match="parameter 'peers' got 9"):
        make_config(None, workload="digits-mlp", out=str(tmp_path), algorithm="sgp:peers=9")


@pytest.mark.parametrize("spec", [n for n in algorithms.names() if n != "ddp"])
def test_defaults_pass(spec: str, tmp_path) -> None:  # noqa: ANN001
    optimizer = "adam" if spec.endswith("adam") else "momentum"
    make_config(None, workload="digits-mlp", nproc=4, out=str(tmp_path), algorithm=spec, optimizer=optimizer)


def _built(rank: int, world: int, cases: dict) -> dict:
    """Each refused case built on the workers, as a run would: the error text."""
    out = {}
    for name, (overrides, _) in cases.items():
        model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        opt_name = overrides.get("optimizer", "momentum")
        opt = torch.optim.Adam(model.parameters()) if opt_name == "adam" else torch.optim.SGD(model.parameters(), lr=0.1)
        kw = {k: overrides[k] for k in ("compressor", "strategy", "nonfinite") if k in overrides}
        try:
            algorithms.create(overrides["algorithm"], model, opt, **kw)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


def test_the_workers_give_the_same_message(tmp_path) -> None:  # noqa: ANN001
    built = run_workers(_built, 2, REFUSED)[0]
    for case, (overrides, _) in REFUSED.items():
        with pytest.raises(ValueError) as before:
            make_config(None, workload="digits-mlp", nproc=2, out=str(tmp_path), **overrides)
        assert built[case] is not None and str(before.value) in built[case], (case, str(before.value), built[case])
