"""Background: after a failure every later job fails at once, inline ones
(:meth:`Background.run`, staleness 0) included (review H)."""

from __future__ import annotations

import pytest

from gradpress.exchange.background import Background, BackgroundError


def _boom() -> None:
    raise RuntimeError("Connection reset by peer")


def test_inline_job_after_a_thread_failure_fails_without_running() -> None:
    bg = Background("rank 0")
    ticket = bg.submit("of step 1", _boom)
    with pytest.raises(BackgroundError):
        bg.wait(ticket)
    called: list[int] = []
    with pytest.raises(BackgroundError, match="of step 2 failed.*earlier background job failed.*reset"):
        bg.run("of step 2", lambda: called.append(1))
    assert called == []  # no collective issued on a sequence that lost a step
    bg.close()


def test_jobs_after_an_inline_failure_fail_without_running() -> None:
    bg = Background("rank 0")
    with pytest.raises(BackgroundError, match="of step 1 failed.*reset"):
        bg.run("of step 1", _boom)
    called: list[int] = []
    with pytest.raises(BackgroundError, match="of step 2 failed.*earlier background job failed"):
        bg.run("of step 2", lambda: called.append(1))
    with pytest.raises(BackgroundError, match="of step 3 failed.*earlier background job failed"):
        bg.wait(bg.submit("of step 3", lambda: called.append(3)))
    assert called == []
    bg.close()  # the failure was raised already: close does not raise it again


def test_an_inline_job_runs_after_the_jobs_in_flight_and_the_timing_adds_up() -> None:
    """``run``: "Run fn now on the calling thread, after the jobs in flight": every rank issues its collectives
    in one order, so an inline exchange must not overtake the thread's (an inline job that skipped the wait
    ran first here). ``timing``: hidden = busy - waited, never below 0; overlap = hidden / busy."""
    import threading

    bg = Background("rank 0")
    order: list[str] = []
    gate = threading.Event()
    bg.submit("of step 1", lambda: (gate.wait(5.0), order.append("thread")))
    timer = threading.Timer(0.2, gate.set)
    timer.start()
    bg.run("of step 2", lambda: order.append("inline"))
    timer.join()
    assert order == ["thread", "inline"]
    assert bg.in_flight == 0
    bg.close()
    t = bg.timing()
    assert t["exchange_s"] == pytest.approx(bg.busy_s)
    assert t["hidden_s"] == pytest.approx(max(0.0, bg.busy_s - bg.wait_s))
    assert t["overlap"] == pytest.approx(t["hidden_s"] / bg.busy_s)
    assert t["exposed_s"] == pytest.approx(min(bg.wait_s, bg.busy_s))
