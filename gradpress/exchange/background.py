"""Exchanges that run behind compute: one background thread per user.

Comprex (Kim et al., "Comprex: compressed ring allreduce with asynchronous
exchange") hides communication behind computation: the compressed exchange
of step t runs while step t + 1's forward and backward pass runs, and its
result is applied one step late. :class:`Background` is the machinery: a
single daemon thread that runs submitted jobs (typically
``Synchronizer.sync`` on the caller's own process group) first in, first
out, and a :class:`Ticket` per job that the training thread waits on when
the result is due. gloo and NCCL collectives release the GIL, so the
training thread computes while the thread waits on the network.

Invariants:

* Jobs run one at a time, in submission order. Every rank submits the same
  jobs in the same order, so every rank issues the same collectives in the
  same order on the group the jobs use. While jobs are in flight nothing
  else may issue collectives on that group: call :meth:`Background.drain`
  first (a broadcast, an evaluation, a checkpoint).
* A job's failure is never lost and never a hang: the exception is kept on
  its ticket and raised in the training thread by :meth:`Background.wait`
  as :class:`BackgroundError` naming the job, the rank and the cause (a
  dead peer resets the connection at once; a stuck one trips the group's
  timeout). After a failure every later job fails at once with the same
  cause: a collective sequence that lost a step cannot continue.
* Timing, for the overlap figure: ``busy_s`` is the wall time jobs ran on
  the thread, ``wait_s`` the time the training thread spent blocked in
  :meth:`wait`; ``busy_s - wait_s`` of it was hidden behind compute. A job
  run inline (:meth:`run`, staleness 0) counts wholly as waited.
* At interpreter exit every thread still running (its owner never closed:
  a script that ends without ``algo.close()``) finishes the jobs in flight
  and stops, at most :data:`EXIT_WAIT_S` seconds in all: a daemon thread still
  inside a collective when the interpreter tore down made the process abort
  ("terminate called without an active exception", SIGABRT).
* A stop (the exit's, :meth:`Background.close`'s) ends the thread after the
  jobs queued, those submitted after the stop included (a job in flight on
  another thread may still submit: comprex on a pipelined hierarchical
  strategy); a submit after the thread ended starts it again.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gradpress.transport.groups import EXIT_STEPS

__all__ = ["Background", "BackgroundError", "Ticket", "EXIT_WAIT_S"]

#: the longest wait at interpreter exit for the background threads' jobs in flight, all threads together (a
#: stuck peer must not hold the exit for the group's whole timeout; past it the exit goes on as before)
EXIT_WAIT_S = 60.0


class BackgroundError(RuntimeError):
    """A background exchange failed (a dead or stuck peer, a bad tensor...)."""


@dataclass
class Ticket:
    """One submitted job: its name, its future and its run time on the thread."""

    name: str
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    busy_s: float = 0.0


class Background:
    """A FIFO of jobs run on one daemon thread; see the module doc.

    ``name`` labels the thread and the errors (``"comprex rank 0"``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Ticket, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None
        self._reported = False
        self._open: list[Ticket] = []
        self._lock = threading.Lock()
        #: guards starting the thread, queueing a job and the thread's end (no job queued behind a stop is lost)
        self._queueing = threading.Lock()
        self._ended = False  # the thread took its stop with nothing queued behind it and returned
        self.busy_s = 0.0
        self.wait_s = 0.0
        self.jobs = 0

    # ------------------------------------------------------------------ jobs
    def submit(self, name: str, fn: Callable[[], Any]) -> Ticket:
        """Queue ``fn`` (run on the thread after every earlier job)."""
        ticket = Ticket(name)
        with self._queueing:
            if self._thread is None or self._ended:
                # daemon: a thread blocked on a dead peer never keeps the process alive at exit
                self._thread = threading.Thread(target=self._loop, name=f"gradpress-{self.name}", daemon=True)
                self._ended = False
                self._thread.start()
                _RUNNING.add(self)
            self._open.append(ticket)
            self._jobs.put((ticket, fn))
        return ticket

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` now on the calling thread, after the jobs in flight
        (staleness 0: nothing is hidden, the whole time counts as waited).
        After a failure (inline or on the thread) it fails at once, like
        :meth:`submit`'s later jobs: ``fn`` is not called."""
        self.drain()
        if self._failed is not None:
            raise self._error(name, RuntimeError(f"an earlier background job failed: {self._failed}"))
        t0 = time.perf_counter()
        try:
            return fn()
        except Exception as exc:
            self._failed, self._reported = exc, True
            raise self._error(name, exc) from exc
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self.busy_s += dt
                self.wait_s += dt
                self.jobs += 1

    def wait(self, ticket: Ticket) -> Any:
        """Block until ``ticket``'s job is done; its result, or
        :class:`BackgroundError` with the cause."""
        t0 = time.perf_counter()
        try:
            return ticket.future.result()
        except Exception as exc:
            self._reported = True
            raise self._error(ticket.name, exc) from exc
        finally:
            with self._lock:
                self.wait_s += time.perf_counter() - t0
            if ticket in self._open:
                self._open.remove(ticket)

    def drain(self) -> None:
        """Wait for every job in flight (their results stay on their tickets)."""
        for ticket in list(self._open):
            self.wait(ticket)

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not yet waited for."""
        return len(self._open)

    def close(self) -> None:
        """Wait for the jobs in flight, then stop the thread. Idempotent; a
        failure already raised by :meth:`wait` is not raised again (a
        ``finally: close()`` must not mask it), one never reported is."""
        already = self._reported
        try:
            self.drain()
        except BackgroundError:
            if not already:
                raise
        finally:
            self._stop(5.0)

    def _stop(self, timeout: float) -> bool:
        """Queue the thread's end after the jobs queued, wait at most ``timeout`` seconds for it; whether it
        ended (False: a job still in flight)."""
        thread = self._thread
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout=max(0.0, timeout))
            with self._queueing:
                if self._thread is thread:  # not one a submit started after this one ended
                    self._thread = None
                    _RUNNING.discard(self)
            return not thread.is_alive()
        _RUNNING.discard(self)
        return True

    # ----------------------------------------------------------------- thread
    def _loop(self) -> None:
        stopping = False
        while True:
            if stopping:  # asked to stop: it ends once nothing is queued (checked under the submit's lock)
                with self._queueing:
                    if self._jobs.empty():
                        self._ended = True
                        return
            item = self._jobs.get()
            if item is None:
                # jobs submitted behind the stop (another thread's job in flight, at exit) still run
                stopping = True
                continue
            ticket, fn = item
            if self._failed is not None:  # the collective sequence is broken: fail fast, never block
                ticket.future.set_exception(RuntimeError(f"an earlier background job failed: {self._failed}"))
                continue
            t0 = time.perf_counter()
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - delivered to the training thread by wait()
                self._failed = exc
                ticket.future.set_exception(exc)
            else:
                ticket.future.set_result(result)
            finally:
                ticket.busy_s = time.perf_counter() - t0
                with self._lock:
                    self.busy_s += ticket.busy_s
                    self.jobs += 1

    def _error(self, name: str, exc: BaseException) -> BackgroundError:
        if isinstance(exc, BackgroundError):
            return exc
        return BackgroundError(
            f"{self.name}: the background exchange {name} failed ({type(exc).__name__}: {exc}); a peer that "
            "died or stopped answering within the group's timeout causes this; every rank stops here")

    # ------------------------------------------------------------------ stats
    def timing(self) -> dict[str, float]:
        """``exchange_s`` (busy), ``exposed_s`` (waited), ``hidden_s`` and
        ``overlap`` = hidden / exchange (0.0 before any job)."""
        with self._lock:
            busy, waited = self.busy_s, self.wait_s
        hidden = max(0.0, busy - waited)
        return {"exchange_s": busy, "exposed_s": min(waited, busy) if busy else waited, "hidden_s": hidden,
                "overlap": hidden / busy if busy > 0 else 0.0}


#: every Background whose thread runs (weakly: the running thread itself keeps its Background alive)
_RUNNING: weakref.WeakSet[Background] = weakref.WeakSet()


def _stop_running_threads() -> bool:
    """At interpreter exit (a step of :data:`gradpress.transport.groups.EXIT_STEPS`, which run before the
    teardown, daemon threads still alive): each thread still running finishes its jobs in flight (the peers
    run the same ones) and stops; results are dropped. One deadline, :data:`EXIT_WAIT_S` from now, for all of
    them: several threads stuck on one peer that stopped answering hold the exit that long once, not once per
    thread. One thread at a time, each told to stop only when its turn comes: a job in flight on one thread
    may still submit to another (comprex's exchange on a pipelined hierarchical strategy uses the strategy's
    wire thread), and a submit to a thread already stopped starts it again, where one queued behind its stop
    would never run. Returns whether every thread ended (False: a collective a peer never joined, whose group
    then stays)."""
    deadline = time.monotonic() + EXIT_WAIT_S
    return all([background._stop(deadline - time.monotonic()) for background in list(_RUNNING)])


EXIT_STEPS.append(_stop_running_threads)
