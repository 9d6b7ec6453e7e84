"""Ranks that disagree on whether the DDP hook follows a loss scaler fail, naming the ranks (2 gloo workers, one
launch, about 5 s).

Rank 0 with a scaler and rank 1 without keep their residuals in different scales (rank 0's in the loss scale,
rank 1's in the scale of its last step, fed back off by new/old at every change), and the average is silently
wrong. Now:

* ``register(scaler=)`` on rank 0 only: registration fails on every rank (the cross-rank agreement of the
  configuration carries whether a scaler is attached), naming rank 1 and ``scaler``;
* an unbound ``make_hook`` with ``attach_scaler`` on rank 0 only: ``bind`` fails on every rank alike;
* ``attach_scaler`` after ``register`` (the hook is bound) is refused at once on the rank that calls it, saying
  what to do instead (no other rank could learn of it without a collective, and none is sent at any step);
  attaching before binding on every rank (``make_hook``, ``attach_scaler``, ``bind``) trains and follows;
* detaching after binding is refused the same way; replacing one scaler by another is not;
* ``nonfinite='skip'`` with a scaler attached before an unbound hook binds is refused on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from distributed import run_workers
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress

SPEC = "topk:ratio=0.1"
MIN_NUMEL = 16

pytestmark = pytest.mark.slow


class _Scripted:
    """A scaler's reading side (``get_scale``): runs on a torch without a CPU ``GradScaler``."""

    def __init__(self, scale: float = 4.0) -> None:
        self.scale = scale

    def get_scale(self) -> float:
        return self.scale


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(8, 8)


def _step(ddp: DDP, rank: int) -> None:
    ddp(torch.full((2, 8), float(rank + 1))).sum().backward()


def _outcome(fn) -> str:  # noqa: ANN001
    try:
        fn()
        return "ok"
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _register_on_rank0_only(rank: int) -> str:
    scaler = _Scripted() if rank == 0 else None
    return _outcome(lambda: gradpress.ddp.register(DDP(_model()), SPEC, min_numel=MIN_NUMEL, scaler=scaler).close())


def _bind_on_rank0_only(rank: int) -> str:
    state, _ = gradpress.ddp.make_hook(SPEC, min_numel=MIN_NUMEL)
    if rank == 0:
        state.attach_scaler(_Scripted())
    try:
        return _outcome(lambda: state.bind(_model()))
    finally:
        state.close()


def _attach_after_register(rank: int) -> dict:
    """On rank 0 only: refused there at once (rank 1 never knew: both then train without one)."""
    ddp = DDP(_model())
    hook = gradpress.ddp.register(ddp, SPEC, min_numel=MIN_NUMEL)
    attach = _outcome(lambda: hook.attach_scaler(_Scripted())) if rank == 0 else "not called"
    first = _outcome(lambda: _step(ddp, rank))
    out = {"attach": attach, "first": first, "scaler": hook.scaler}
    hook.close()
    return out


def _attach_on_both(rank: int) -> dict:
    ddp = DDP(_model())
    state, comm_hook = gradpress.ddp.make_hook(SPEC, min_numel=MIN_NUMEL)
    state.attach_scaler(_Scripted(8.0))
    state.bind(ddp)
    ddp.register_comm_hook(state, comm_hook)
    hook = state
    steps = [_outcome(lambda: _step(ddp, rank)) for _ in range(2)]
    out = {"steps": steps, "loss_scale": hook.loss_scale}
    out["replace"] = _outcome(lambda: hook.attach_scaler(_Scripted(8.0)))  # another scaler: still one attached
    out["detach_late"] = _outcome(lambda: hook.attach_scaler(None))
    out["after"] = _outcome(lambda: _step(ddp, rank))
    hook.close()
    ddp2 = DDP(_model())
    hook2 = gradpress.ddp.register(ddp2, SPEC, min_numel=MIN_NUMEL)
    _step(ddp2, rank)
    out["attach_late"] = _outcome(lambda: hook2.attach_scaler(_Scripted()))
    hook2.close()
    return out


def _skip_unbound(rank: int) -> str:
    state, _ = gradpress.ddp.make_hook(SPEC, min_numel=MIN_NUMEL, nonfinite="skip")
    try:
        return _outcome(lambda: (state.attach_scaler(_Scripted()), state.bind(_model())))
    finally:
        state.close()


def _workers(rank: int, world: int) -> dict:
    return {"register": _register_on_rank0_only(rank), "bind": _bind_on_rank0_only(rank),
            "attach": _attach_after_register(rank), "both": _attach_on_both(rank), "skip": _skip_unbound(rank)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_workers, 2)


@pytest.mark.parametrize("case", ["register", "bind"])
def test_a_scaler_on_some_ranks_only_fails_at_registration_on_every_rank(results: list[dict], case: str) -> None:
    for rank, res in enumerate(results):
        msg = res[case]
        assert msg.startswith("ValueError"), (rank, msg)
        assert "rank 1" in msg and "scaler" in msg and "every rank" in msg, (rank, msg)
    assert results[0][case] == results[1][case]


def test_attach_scaler_after_register_is_refused_at_once(results: list[dict]) -> None:
    msg = results[0]["attach"]["attach"]
    assert msg.startswith("ValueError") and "bound" in msg and "register(model, spec, scaler=scaler)" in msg, msg
    assert "attach it before the hook binds" in msg, msg
    for rank, res in enumerate(results):
        assert res["attach"]["first"] == "ok" and res["attach"]["scaler"] is None, (rank, res["attach"])


def test_attach_scaler_on_every_rank_follows_and_late_changes_are_refused(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        both = res["both"]
        assert both["steps"] == ["ok", "ok"] and both["loss_scale"] == 8.0, (rank, both)
        assert both["replace"] == "ok" and both["after"] == "ok", (rank, both)
        for late in ("detach_late", "attach_late"):
            msg = both[late]
            assert msg.startswith("ValueError") and "after binding" in msg and "attach_scaler" in msg, (rank, late, msg)


def test_skip_with_a_scaler_attached_before_binding_is_refused(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        msg = res["skip"]
        assert msg.startswith("ValueError") and "nonfinite='skip'" in msg and "propagate" in msg, (rank, msg)
