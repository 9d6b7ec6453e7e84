"""The DDP hook's communication thread: it averages the queued buckets
(:class:`gradpress.ddp.buckets.Job`) through the owner's engine and completes
their Futures.

Invariant: one thread takes the jobs first in, first out and makes one
engine call at a time, so every rank issues its collectives in the order DDP
handed over the buckets; every job's Future completes exactly once (with the
bucket's buffer, or with the exception). With coalescing, a step's buckets
are held until its last one arrives and averaged in one engine call; held
buckets of a step whose backward ended before its last bucket came fail with
a ``RuntimeError``. A ``nonfinite='raise'`` error is kept in ``deferred``
(set before the Futures complete, their buffers zeroed) for the training
thread to raise as itself when backward ends. A stop is queued once, behind
the jobs already queued; the wait for the thread to end is bounded (the exit
shares one :data:`CLOSE_WAIT_S` among every hook still open).
"""

from __future__ import annotations

import queue
import threading
from typing import Protocol

import torch

from gradpress.ddp.buckets import Job
from gradpress.exchange import Synchronizer

__all__ = ["CommThread", "CLOSE_WAIT_S"]

#: the longest wait for a hook's thread to finish its queued jobs when the hook closes; at interpreter exit, for
#: every hook still open together (a stuck peer holds the exit that long once, not once per hook)
CLOSE_WAIT_S = 5.0


class Owner(Protocol):
    """What the thread reads from its hook state, at each job."""

    @property
    def engine(self) -> Synchronizer: ...

    @property
    def coalescing(self) -> bool: ...

    def follow_scale(self, step: int) -> None: ...


class CommThread:
    """The thread (``thread``, started at once) that works through the jobs
    of ``put`` with ``owner``'s engine; ``stop`` ends it."""

    def __init__(self, owner: Owner) -> None:
        self._owner = owner
        self.deferred: FloatingPointError | None = None  # nonfinite='raise': read by the training thread
        self._held: list[Job] = []  # buckets of the current step waiting for its last one
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._stopping = False
        self.thread = threading.Thread(target=self._worker, name="gradpress-comm", daemon=True)
        self.thread.start()

    def put(self, job: Job) -> None:
        """Queue ``job`` (its keys set) behind those already queued."""
        self._queue.put(job)

    def take_deferred(self) -> FloatingPointError | None:
        """The deferred ``nonfinite='raise'`` error, if any; cleared."""
        error, self.deferred = self.deferred, None
        return error

    def request_stop(self) -> None:
        """Queue the thread's end behind the jobs queued before (once); does not wait."""
        if not self._stopping and self.thread.is_alive():
            self._stopping = True
            self._queue.put(None)

    def stop(self, timeout: float = CLOSE_WAIT_S) -> bool:
        """End the thread once the jobs queued before are done, waiting at most ``timeout`` seconds; whether it
        ended (False: a job still in flight, a collective a peer never joined)."""
        self.request_stop()
        self.thread.join(timeout=max(0.0, timeout))
        return not self.thread.is_alive()

    def _worker(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                coalesce = self._owner.coalescing
            except BaseException as exc:  # noqa: BLE001 - forwarded to the training thread
                job.future.set_exception(exc)
                continue
            if not coalesce:
                self._run([job])
            elif not job.is_last:
                # a step whose backward never ended (the step count only moves at the last bucket, so a
                # new backward shows as the same parameters arriving again)
                if self._held and (self._held[0].step != job.step
                                   or not {id(p) for p in job.params}.isdisjoint(id(p) for h in self._held for p in h.params)):
                    self._fail(self._held, RuntimeError("gradpress hook: a backward ended before DDP handed over "
                                                        "its last bucket; its buckets were not averaged"))
                    self._held = []
                self._held.append(job)
            else:
                jobs, self._held = [*self._held, job], []
                self._run(jobs)

    def _run(self, jobs: list[Job]) -> None:
        """Average ``jobs`` (one bucket, or every bucket of a step) in one
        engine call and complete their Futures."""
        try:
            for job in jobs:
                if job.event is not None:
                    torch.cuda.current_stream(job.buffer.device).wait_event(job.event)
            engine = self._owner.engine
            self._owner.follow_scale(jobs[0].step)  # a loss scaler's change, before the step's first bucket
            if len(jobs) == 1:
                job = jobs[0]
                engine.sync(job.keys, job.grads, step=job.step, flat=job.buffer, end_of_step=job.is_last,
                            used=job.used)
            else:
                used = None if any(job.used is None for job in jobs) else [u for job in jobs for u in job.used]
                engine.sync([k for job in jobs for k in job.keys], [g for job in jobs for g in job.grads],
                            step=jobs[-1].step, flat=None, end_of_step=jobs[-1].is_last, used=used)
            for job in jobs:
                if job.buffer.is_cuda:
                    torch.cuda.current_stream(job.buffer.device).synchronize()
                job.future.set_result(job.buffer)
        except FloatingPointError as exc:  # nonfinite='raise': raised as itself when backward ends
            self.deferred = exc  # before the Futures complete: backward's end reads it as soon as they do
            for job in jobs:
                job.buffer.zero_()
                job.future.set_result(job.buffer)
        except BaseException as exc:  # noqa: BLE001 - forwarded to the training thread
            self._fail(jobs, exc)

    @staticmethod
    def _fail(jobs: list[Job], exc: BaseException) -> None:
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(exc)
