"""The DDP hook's bookkeeping between DDP and the engine, checked in one
process without DDP or workers (about 2 s): bugs the ``plants3`` session
planted in ddp/buckets.py and ddp/comm_thread.py that the ``hook`` group's
tests did not notice.

* :class:`UsedTracker` (ddp/buckets.py's invariant): a parameter is used
  when it got a gradient in any backward since the last synced one,
  ``no_sync`` micro-batches included, and ``take`` forgets only the
  parameters of the bucket it answers for. A ``take`` that forgot every
  parameter (the first bucket of a step wiping the flags a ``no_sync``
  micro-batch left for the later buckets) went unnoticed: the 2-worker
  scenarios have one bucket per step where a parameter goes unused.
* :class:`CommThread` with coalescing (comm_thread.py's invariant): held
  buckets of a step whose backward ended before its last bucket came fail
  with a ``RuntimeError``; the next backward's buckets (the same parameters
  arriving again) are averaged in one engine call without them. Never
  failing them (the stale buckets averaged with the next step's) went
  unnoticed.
"""

from __future__ import annotations

import pytest
import torch

from gradpress.ddp.buckets import Job, UsedTracker
from gradpress.ddp.comm_thread import CommThread


def test_used_flags_remember_no_sync_micro_batches_until_each_bucket_is_taken() -> None:
    a, b, c = (torch.nn.Parameter(torch.ones(3)) for _ in range(3))
    tracker = UsedTracker([a, b, c])
    try:
        (a.sum() + b.sum()).backward()  # a no_sync micro-batch uses a and b
        c.sum().backward()  # the synced one uses c only
        # DDP hands the buckets in reverse order of the parameters: c's first
        assert tracker.take([c]) == [True]
        assert tracker.take([b]) == [True], "b got a gradient in the no_sync micro-batch of this step"
        assert tracker.take([a]) == [True], "a got a gradient in the no_sync micro-batch of this step"
        c.sum().backward()  # the next step uses c only
        assert tracker.take([c, b]) == [True, False]
        assert tracker.take([a]) == [False]
    finally:
        tracker.close()
    (a.sum() + b.sum() + c.sum()).backward()  # closed: nothing is noted any more
    assert tracker.take([a, b, c]) == [False, False, False]


class _Owner:
    """A hook state as the thread reads it: coalescing, and an engine that records each call."""

    coalescing = True

    def __init__(self) -> None:
        self.engine = self
        self.calls: list[tuple[list[str], int, bool]] = []

    def sync(self, keys, grads, *, step, flat, end_of_step, used):  # noqa: ANN001, ANN201
        self.calls.append((list(keys), step, end_of_step))

    def follow_scale(self, step: int) -> None:  # no loss scaler attached
        pass


def _job(key: str, param: torch.nn.Parameter, step: int, last: bool) -> Job:
    buffer = torch.zeros(param.numel())
    job = Job(buffer, [buffer.view(param.shape)], [key], [param], step, last, torch.futures.Future(), None)
    return job


def test_coalesced_buckets_of_a_backward_that_ended_early_fail_and_the_next_step_goes_alone() -> None:
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    owner = _Owner()
    comm = CommThread(owner)
    try:
        stale = _job("p", p, 0, False)  # its backward ended before DDP handed over q's bucket
        again, last = _job("p", p, 0, False), _job("q", q, 0, True)  # the next backward, whole
        for job in (stale, again, last):
            comm.put(job)
        assert last.future.wait() is last.buffer and again.future.wait() is again.buffer
        with pytest.raises(RuntimeError, match="a backward ended before DDP handed over its last bucket"):
            stale.future.wait()
        assert owner.calls == [(["p", "q"], 0, True)], owner.calls
    finally:
        assert comm.stop()
