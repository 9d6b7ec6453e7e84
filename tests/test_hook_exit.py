"""At interpreter exit the DDP hooks still open get one deadline for their communication threads in all, not
one each: with several hooks whose threads are stuck on a peer that stopped answering, the exit waited the
hook's close timeout (5 s) once per hook (the exit's convention: :mod:`gradpress.exchange.background` gives all
its threads :data:`~gradpress.exchange.background.EXIT_WAIT_S` together).

Measured by what the exit asks of the threads, not by wall-clock speed: each hook's thread is replaced by a
stand-in that never ends and records the timeout of every ``join``, on a fake clock that a ``join`` moves on
by its timeout (what a stuck thread costs)."""

from __future__ import annotations

import types
import weakref

import pytest

import gradpress.ddp.hook as hookmod
from gradpress.ddp.hook import GradpressHook


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class _StuckThread:
    """A communication thread stuck in a collective: alive for ever; a join waits its whole timeout."""

    def __init__(self, clock: _Clock, log: list[tuple[str, int, float | None]], index: int) -> None:
        self._clock, self._log, self._index = clock, log, index

    def is_alive(self) -> bool:
        return True

    def join(self, timeout: float | None = None) -> None:
        assert timeout is not None, "a join without timeout at exit waits for ever on a stuck peer"
        self._log.append(("join", self._index, timeout))
        self._clock.now += max(0.0, timeout)


def _hooks(monkeypatch: pytest.MonkeyPatch, n: int) -> tuple[list[GradpressHook], _Clock, list, list]:
    monkeypatch.setattr(hookmod, "_OPEN_HOOKS", weakref.WeakSet())  # only this test's hooks are open
    clock, log = _Clock(), []
    monkeypatch.setattr(hookmod, "time", types.SimpleNamespace(monotonic=clock.monotonic), raising=False)
    hooks = [GradpressHook(lambda named: None) for _ in range(n)]  # unbound: no group needed
    real = []
    for i, hook in enumerate(hooks):
        comm = hook._comm
        real.append(comm.thread)
        queue_put = comm._queue.put

        def put(item, *args, _i=i, _put=queue_put, **kwargs):  # noqa: ANN001,ANN002,ANN003,ANN202
            if item is None:
                log.append(("stop", _i, None))
            return _put(item, *args, **kwargs)

        comm._queue.put = put  # records the stop sentinel queued for each thread, in order with the joins
        stuck = _StuckThread(clock, log, i)
        comm.thread = stuck
        hook._thread = stuck
    return hooks, clock, log, real


def test_exit_gives_the_hooks_threads_one_deadline_in_all(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradpress.ddp.comm_thread import CLOSE_WAIT_S

    hooks, clock, log, real = _hooks(monkeypatch, 3)
    try:
        t0 = clock.now
        ended = hookmod._close_open_hooks()
        joins = [timeout for kind, _, timeout in log if kind == "join"]
        assert ended is False  # stuck threads did not end, and the exit says so (the groups then stay)
        assert len(joins) == 3, log  # every hook's thread was waited for...
        assert sum(joins) == pytest.approx(CLOSE_WAIT_S), joins  # ...within one deadline: before, 5 s each
        assert clock.now - t0 == pytest.approx(CLOSE_WAIT_S)
        assert joins[0] == pytest.approx(CLOSE_WAIT_S) and joins[1:] == [0.0, 0.0], joins
        # every thread is told to stop before the first wait, so their queued jobs end side by side
        assert [kind for kind, _, _ in log] == ["stop"] * 3 + ["join"] * 3, log
        assert sorted(i for kind, i, _ in log if kind == "stop") == [0, 1, 2], log
        assert not list(hookmod._OPEN_HOOKS)
    finally:
        for thread in real:
            thread.join(10.0)  # the real threads got their stop above and end at once
            assert not thread.is_alive()


def test_a_hook_closed_by_hand_keeps_its_own_timeout_and_is_stopped_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradpress.ddp.comm_thread import CLOSE_WAIT_S

    (hook,), clock, log, real = _hooks(monkeypatch, 1)
    try:
        hook.close()
        hook.close()  # idempotent: one stop queued, not one per call
        assert [kind for kind, _, _ in log] == ["stop", "join", "join"], log
        assert log[1][2] == pytest.approx(CLOSE_WAIT_S)
    finally:
        real[0].join(10.0)
        assert not real[0].is_alive()


def test_a_hook_whose_thread_ended_costs_the_exit_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing real (idle) hooks: the exit reports that every thread ended."""
    monkeypatch.setattr(hookmod, "_OPEN_HOOKS", weakref.WeakSet())
    hooks = [GradpressHook(lambda named: None) for _ in range(2)]
    threads = [hook._thread for hook in hooks]
    assert hookmod._close_open_hooks() is True
    assert not any(t.is_alive() for t in threads)
