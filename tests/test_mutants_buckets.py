"""``ddp/buckets.py``'s watch for an unused compressed parameter: written for
survivors of ``make mutants`` (``hook`` group, ddp/buckets.py). In one
process, no DDP: an :class:`UnusedWatch` over two parameters, neither of
which gets a gradient (no backward), a plan that compresses the first.

* the watch gives its warning once: asked again, and also after watching
  is started again (``bind`` to the same bare module once more calls
  ``start`` again), it gives none (the module's invariant: "gives the text
  of :func:`unused_warning` once").
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gradpress.ddp.buckets import Job, UnusedWatch

pytestmark = pytest.mark.mutants


def _job(params: list[torch.nn.Parameter], step: int) -> Job:
    job = Job(None, None, None, params, step, True, None, None)
    job.keys = ["w", "b"]
    return job


def test_the_watch_warns_once_even_when_started_again() -> None:
    w, b = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4))
    plan = {"w": SimpleNamespace(compressed=True), "b": SimpleNamespace(compressed=False)}
    watch = UnusedWatch()
    watch.start([w, b], 0)
    first = watch.check(_job([w, b], 1), plan)
    assert first is not None and "w (4x4)" in first and "b (4)" not in first, first
    assert watch.warned
    assert watch.check(_job([w, b], 2), plan) is None
    watch.start([w, b], 3)  # the state bound again to the same bare module
    assert watch.check(_job([w, b], 3), plan) is None, "the watch warned a second time"
