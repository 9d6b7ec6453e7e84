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
