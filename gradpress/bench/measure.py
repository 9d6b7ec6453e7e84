"""Timing and memory measurement for micro-benchmarks.

* :func:`time_call`: median wall time of ``repeats`` calls after ``warmup``
  calls; on CUDA the device is synchronized before starting and after each
  call, so the time covers the kernels, not just their launch.
* :func:`copy_roofline`: the memory-bandwidth roofline of this machine in the
  same run: a plain ``dst.copy_(x)`` of the benchmark tensor; bandwidth =
  (bytes read + bytes written) / median time.
* :func:`peak_extra_bytes`: the peak of live bytes allocated by a call, above
  what was live when it started. CUDA: ``torch.cuda.max_memory_allocated``
  after ``reset_peak_memory_stats``. CPU: ``torch.profiler`` with
  ``profile_memory=True`` records every allocation and free of PyTorch's CPU
  allocator (size and time); the running sum of those events, in time order,
  peaks at the answer. Python-level ``tracemalloc`` does not see tensor
  storage, and the process RSS is blurred by the C allocator's caching, so the
  profiler is the most direct real measurement available on CPU. It does not
  see scratch memory that kernels take outside PyTorch's allocator (e.g.
  ``std::vector`` buffers inside a sort), which is small next to tensors.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gradpress.torch_compat import event_start_ns

__all__ = ["sync", "time_call", "copy_roofline", "peak_extra_bytes"]


def sync(device: torch.device) -> None:
    """Wait for queued work on ``device`` (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 1) -> tuple[float, Any]:
    """``(median seconds, last result)`` of ``repeats`` timed calls of ``fn``."""
    result = None
    for _ in range(warmup):
        result = fn()
    times = []
    for _ in range(repeats):
        result = None  # free the previous result before the next call
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def copy_roofline(x: torch.Tensor, repeats: int, warmup: int = 1) -> tuple[float, float]:
    """``(GB/s counting bytes read + written, median seconds)`` of copying ``x``
    into a preallocated tensor of the same size."""
    dst = torch.empty_like(x)
    seconds, _ = time_call(lambda: dst.copy_(x), x.device, repeats, warmup)
    nbytes = 2 * x.numel() * x.element_size()
    return nbytes / seconds / 1e9, seconds


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence C-level stderr (the profiler backend logs its start and stop)."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def peak_extra_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak live bytes allocated during ``fn()`` above the level at its start
    (everything ``fn`` allocates counts, including what it returns)."""
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del result
        return max(0, int(peak))
    # the autograd profiler front end: same allocator events as torch.profiler,
    # without importing torch._dynamo (seconds on a small machine)
    with _quiet_stderr():
        with torch.autograd.profiler.profile(use_cpu=True, profile_memory=True) as prof:
            result = fn()
    del result
    events = [e for e in prof.kineto_results.events()
              if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")]
    live = peak = 0
    for e in sorted(events, key=event_start_ns):
        live += e.nbytes()
        peak = max(peak, live)
    return int(peak)
