"""Review (rev2): how 1-bit Adam and 0/1 Adam agree on which parameters
have a gradient (tests/test_review_adam_none_grad.py has the rule).

* The agreement costs no collective of its own: on a compressed step the
  per-parameter flags ride in the engine's exchange (its plain allreduce),
  on an exact step in the gradients' allreduce, and a rank that has every
  gradient reads nothing back (it knows the answer: every parameter is
  present somewhere). Before, a compressed step added one allreduce and
  one host read (``agree_present``), and every exact step a host read.
* 0/1 Adam's local phase: a parameter that no rank stepped since the last
  synchronization is left alone by the synchronization (its parameter,
  ``m`` and every residual), as torch's Adam leaves a parameter without a
  gradient; it was exchanged as a zero change, so its ``m`` was
  overwritten and the residuals moved it. The flags of what each rank
  stepped are part of the saved state (resume stays bit-identical).

2 gloo workers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from distributed import checkpoint, restore, run_workers
from test_algorithms import batch
from test_review_adam_none_grad import B1, B2, EPS, LR, Net, _side_slice, flat

import gradpress.algorithms as algorithms

WORLD = 2
STEPS = 8
#: 0-based steps on which no rank uses the side head / rank 1 does not
NONE_EVERYWHERE = {1, 4, 5, 7}
NONE_ON_RANK1 = {2, 6}
#: 0/1 Adam: exact steps t = 1, 2, then local steps; H = 1 at t = 3, then 2: synchronizations at t = 3, 4, 6, 8.
#: t = 5 and 6 (the interval closed at t = 6) have no side gradient on any rank; in the last interval only
#: rank 0 has one, at t = 7 (not at t = 8: the synchronization must remember it)
LOCAL = ("zeroone_adam:var_update_scaler=1000,var_freeze_step=2,local_step_scaler=1,"
         "local_step_clipper=2")
SYNCED = (3, 4, 6, 8)
#: every parameter has its gradient on every rank
ONEBIT = "onebit_adam:freeze_step=2"  # t = 1, 2 exact, then compressed
#: t = 1, 2, 4 exact (T_v doubling every update), t = 3, 5 compressed, then local steps (H = 1: each synchronizes)
ZEROONE = "zeroone_adam:var_update_scaler=1,var_freeze_step=5,local_step_scaler=1000,local_step_clipper=1"
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "isend", "irecv", "send", "recv",
               "reduce_scatter_tensor", "all_to_all_single")


def uses_side(rank: int, step: int, schedule: bool) -> bool:
    return not schedule or (step not in NONE_EVERYWHERE and not (rank == 1 and step in NONE_ON_RANK1))


def _make(spec: str, compressor: str = "efsignsgd") -> tuple[Net, torch.optim.Optimizer, algorithms.Algorithm]:
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=LR, betas=(B1, B2), eps=EPS)
    return net, opt, algorithms.create(spec, net, opt, compressor=compressor, min_numel=64)


def _step(rank: int, step: int, net: Net, opt: torch.optim.Optimizer, algo: algorithms.Algorithm,
          schedule: bool = True) -> None:
    opt.zero_grad(set_to_none=True)
    x, y = batch(rank, step)
    torch.nn.functional.mse_loss(net(x, uses_side(rank, step, schedule)), y).backward()
    algo.step()


def _snap(net: Net, algo: algorithms.Algorithm) -> dict:
    res = algo.engine.feedback.residuals  # type: ignore[union-attr]
    return {"params": flat(list(net.parameters())), "m": flat(algo.exp_avg), "v": flat(algo.exp_avg_sq),
            "side_res": {k: v.clone() for k, v in res.items() if "side" in k}}


def _local(rank: int) -> list[dict]:
    net, opt, algo = _make(LOCAL)
    out = []
    for step in range(STEPS):
        _step(rank, step, net, opt, algo)
        out.append(_snap(net, algo))
    return out


def _resume(rank: int, first: int) -> dict:
    net, opt, algo = _make(LOCAL)
    for step in range(first):
        _step(rank, step, net, opt, algo)
    saved = checkpoint(algo=algo, model=net)
    cont = []
    for step in range(first, STEPS):
        _step(rank, step, net, opt, algo)
        cont.append(_snap(net, algo))
    net2, opt2, algo2 = _make(LOCAL)
    restore(saved, model=net2, algo=algo2)
    resumed = []
    for step in range(first, STEPS):
        _step(rank, step, net2, opt2, algo2)
        resumed.append(_snap(net2, algo2))
    return {"cont": cont, "resumed": resumed}


class _Counter:
    """Counts the collectives and the host reads (``tolist``, ``item``) made
    outside the engine's ``sync`` (the step's own exchange)."""

    def __init__(self, algo: algorithms.Algorithm) -> None:
        self.algo, self.inside = algo, 0
        self.collectives = self.reads = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[_Counter]:
        engine = self.algo.engine
        assert engine is not None
        sync = engine.sync

        def counted_sync(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.inside += 1
            try:
                return sync(*args, **kwargs)
            finally:
                self.inside -= 1

        def wrap(fn, kind: str):  # noqa: ANN001, ANN202
            def inner(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                if not self.inside:
                    setattr(self, kind, getattr(self, kind) + 1)
                return fn(*args, **kwargs)
            return inner

        saved_dist = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
        saved_tensor = {n: getattr(torch.Tensor, n) for n in ("tolist", "item")}
        engine.sync = counted_sync  # type: ignore[method-assign]
        for name, fn in saved_dist.items():
            setattr(dist, name, wrap(fn, "collectives"))
        for name, fn in saved_tensor.items():
            setattr(torch.Tensor, name, wrap(fn, "reads"))
        try:
            yield self
        finally:
            del engine.sync
            for name, fn in saved_dist.items():
                setattr(dist, name, fn)
            for name, fn in saved_tensor.items():
                setattr(torch.Tensor, name, fn)


def _counts(rank: int, spec: str) -> list[dict]:
    """Per step (every rank has every gradient): what the step did outside the engine's sync."""
    net, opt, algo = _make(spec)
    out = []
    for step in range(STEPS):
        counter = _Counter(algo)
        exact_before = algo._exchanges  # noqa: SLF001
        syncs = algo.engine.stats["steps"]  # type: ignore[union-attr]
        with counter.installed():
            _step(rank, step, net, opt, algo, schedule=False)
        out.append({"collectives": counter.collectives, "reads": counter.reads,
                    "exchanges": algo._exchanges - exact_before,  # noqa: SLF001
                    "engine_syncs": algo.engine.stats["steps"] - syncs})  # type: ignore[union-attr]
    return out


def _worker(rank: int, world: int) -> dict:
    return {"local": _local(rank), "resume": _resume(rank, 5),
            "onebit": _counts(rank, ONEBIT), "zeroone": _counts(rank, ZEROONE)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


def test_zeroone_synchronization_leaves_a_parameter_no_rank_stepped_alone(results: list[dict]) -> None:
    """The interval t = 5, 6 has no side gradient on any rank: the
    synchronization at t = 6 leaves the side head's parameters, m, v and
    every residual as the one at t = 4 left them (it moved them by the
    residuals and zeroed m); the rest moved; replicas identical."""
    side = _side_slice()
    for res in results:
        run = res["local"]
        before, after = run[3], run[5]  # after the synchronizations at t = 4 and t = 6
        assert before["side_res"], "the side head has residuals to leave alone"
        assert torch.equal(after["params"][side], before["params"][side])
        assert torch.equal(after["m"][side], before["m"][side])
        assert torch.equal(after["v"][side], before["v"][side])
        assert after["side_res"].keys() == before["side_res"].keys()
        for k in before["side_res"]:
            assert torch.equal(after["side_res"][k], before["side_res"][k]), k
        assert not torch.equal(after["params"][:side.start], before["params"][:side.start])
        # t = 7: only rank 0 steps the side head (t = 8: no rank); the synchronization at t = 8 moves it everywhere
        assert not torch.equal(run[7]["params"][side], run[5]["params"][side])
        assert not torch.equal(run[7]["side_res"]["side.weight"], run[5]["side_res"]["side.weight"])
    for t in SYNCED:
        a, b = results[0]["local"][t - 1], results[1]["local"][t - 1]
        assert torch.equal(a["params"], b["params"]) and torch.equal(a["m"], b["m"]), t


def test_zeroone_resume_inside_an_interval_is_bit_identical(results: list[dict]) -> None:
    """Saved after t = 5 (inside the interval no rank steps the side head
    in), loaded into fresh objects: the same parameters, m and residuals."""
    for res in results:
        for a, b in zip(res["resume"]["cont"], res["resume"]["resumed"]):
            assert torch.equal(a["params"], b["params"]) and torch.equal(a["m"], b["m"])
            assert a["side_res"].keys() == b["side_res"].keys()
            for k in a["side_res"]:
                assert torch.equal(a["side_res"][k], b["side_res"][k]), k


@pytest.mark.parametrize("key", ["onebit", "zeroone"])
def test_agreement_costs_no_collective_and_no_host_read(results: list[dict], key: str) -> None:
    """Every rank has every gradient: a step that exchanges through the
    engine issues no collective besides the engine's own, an exact step
    exactly one (the gradients' allreduce, which carries the flags), and
    neither reads a tensor back to the host outside the engine."""
    for res in results:
        for t, c in enumerate(res[key], 1):
            assert c["reads"] == 0, (t, c)
            if c["engine_syncs"]:
                assert c["collectives"] == 0, (t, c)
            else:  # an exact step: one plain average of the gradients
                assert c["collectives"] == 1 and c["exchanges"] == 1, (t, c)
    kinds = [(c["engine_syncs"] > 0) for c in results[0][key]]
    assert any(kinds) and not all(kinds)  # both kinds of step ran
