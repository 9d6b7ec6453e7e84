"""A failed SGP load while gossip rounds are in flight (``overlap=1``) leaves it stepping as its twin, and never
drops a message a peer still waits for; one launch of 2 gloo workers, about 30 s (a 2 s wait included).

SGP's messages of round t are posted (sends and receives) at step t and absorbed at step t + overlap. A load
takes its backup through ``state_dict()``, which receives the rounds in flight (decoded, kept in the
backup), then replaces the in-flight rounds with the state's (and a failed one puts the backup's back). The
rank's own sends of those rounds belong to its peers' rounds: gloo sends an unbound buffer only once the peer
has posted its receive, and top-k messages (variable size) post the data receive only when the peer waits
for the round. So a load that dropped its sends before the peer's receive was posted lost the message: the
peer's next wait for it failed at the p2p timeout ("waiting for the message from peer rank 0 ... failed").

Each rank runs ``a`` and its twin ``b`` (same model, data, seed) for 3 steps, ``a``'s state saved after its
first; that state, broken in its extra state, is loaded into ``a``, first by rank 0 at once and by rank 1 two
seconds later (its receive of rank 0's round, a ``threshold`` message of variable size, posted only then, by
its ``state_dict()``), then broken in other ways: an in-flight round's weights missing (read after the rounds
in flight were cleared), ``x[0]`` of shape (1, 6) (``copy_`` broadcast it into (8, 6): it loaded), an
in-flight value of another shape (it loaded, and the next step's absorption failed part-way), an edge copy
list one short (``zip`` stopped early: it loaded, the last copy kept its old value). Every load: ``ValueError``
naming the extra state and the entry, "nothing was loaded", ``a``'s ``state_dict()`` and parameters as before;
then the next 2 steps of ``a`` and ``b`` are bit-identical (parameters and states). The twins exchange on their
own groups (``process_group``), so ``a``'s messages never meet ``b``'s.

Planted: ``SGP._load_backup`` not finishing the pending sends (the code before: ``load_extra_state`` dropped
them): rank 0's message of the round in flight never reaches rank 1, whose ``state_dict()`` waits for it
("Timed out waiting 20000ms for recv operation"), and rank 0 then fails sending round 2 to it ("rank 0 sending
to peer rank 1 ... in gossip round 2 failed within the 0:00:20 timeout"): both workers crash. Each ``_like``
check of ``SGP.load_extra_state`` removed: ``x_row`` or ``in_copy_short`` loads ("the broken state loaded"),
``values_shape`` loads and the next step crashes ("The size of tensor a (3) must match the size of tensor b
(2)"); the offsets' agreement check removed: ``weights`` fails as a bare KeyError, not naming the round.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from distributed import checkpoint, run_workers

import gradpress.algorithms as algorithms

WORLD = 2
F64 = torch.float64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(F64)


def _step(model: nn.Module, opt: torch.optim.Optimizer, algo: Any, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(5, 6, generator=g, dtype=F64)
    opt.zero_grad(set_to_none=True)
    ((model(x) - torch.sin(x[:, :3])) ** 2).mean().backward()
    algo.step()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(k in ("compress_s", "comm_s") or _same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _weights(extra: dict) -> None:
    extra["inflight"][-1]["weights"] = {}  # read after the rounds in flight were replaced


def _x_row(extra: dict) -> None:
    extra["x"][0] = extra["x"][0][:1].clone()  # (1, 6): copy_ broadcast it into x's (8, 6)


def _values_shape(extra: dict) -> None:
    values = extra["inflight"][-1]["values"]["1"]
    values[-1] = values[-1][:-1].clone()  # the absorb's add_ failed at the next step, mid-absorption


def _in_copy_short(extra: dict) -> None:
    extra["in_copy"]["1"] = extra["in_copy"]["1"][:-1]  # zip() stopped early: the last copy kept its value


#: case: how the saved extra state is broken, and what the error names
CASES: dict[str, Any] = {"weights": _weights, "x_row": _x_row, "values_shape": _values_shape,
                         "in_copy_short": _in_copy_short}
NAMED = {"weights": "inflight round 0: offsets [1], values of ['1'], weights of []",
         "x_row": "x[0]: shape (1, 6) torch.float64, expected shape (8, 6) torch.float64",
         "values_shape": "inflight round 0 values['1'][3]: shape (2,)", "in_copy_short": "in_copy['1']: 1 entries, expected 2 tensors"}


def _worker(rank: int, world: int) -> dict[str, Any]:
    objs = []
    for _ in range(2):
        group = dist.new_group(list(range(world)))
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        objs.append((model, opt, algorithms.create("sgp:overlap=1", model, opt, compressor="threshold:tau=0.01",
                                                   min_numel=1, process_group=group, timeout=20)))
    (ma, oa, a), (mb, ob, b) = objs
    saved = None
    for step in range(3):
        _step(ma, oa, a, rank, step)
        _step(mb, ob, b, rank, step)
        if step == 0:
            saved = checkpoint(algo=a)["algo"]
    assert saved is not None and saved["extra"]["inflight"], "no round in flight: no test"
    assert a.inflight and a._pending_sends, "no round in flight in the live algorithm: no test"
    if rank == 1:  # rank 0 is done with its load before this rank waits for (so posts its receive of) its round
        time.sleep(2.0)
    before, params = checkpoint(algo=a)["algo"], _params(ma)  # state_dict() receives the rounds in flight
    out: dict[str, Any] = {"loads": {}}
    for name, corrupt in CASES.items():  # the first one races the peer's receive
        broken = copy.deepcopy(saved)
        corrupt(broken["extra"])
        try:
            a.load_state_dict(broken)
            error = None
        except ValueError as exc:
            error = str(exc)
        out["loads"][name] = (error, _same(before, checkpoint(algo=a)["algo"]), _same(params, _params(ma)))
    out["twin"] = []
    for step in (3, 4):
        _step(ma, oa, a, rank, step)
        _step(mb, ob, b, rank, step)
        out["twin"].append((_same(_params(ma), _params(mb)), _same(a.state_dict(), b.state_dict())))
    a.close()
    b.close()
    return out


def test_a_failed_load_with_rounds_in_flight_steps_as_its_twin_and_loses_no_message() -> None:
    results = run_workers(_worker, WORLD)
    for rank, res in enumerate(results):
        for name, (error, state, params) in res["loads"].items():
            assert error is not None, (rank, name, "the broken state loaded")
            assert "extra" in error and NAMED[name] in error and "nothing was loaded" in error, (rank, name, error)
            assert state and params, (rank, name, state, params)
        for step, (params, state) in enumerate(res["twin"], start=3):
            assert params and state, (rank, step, params, state)
