"""What differs between the torch releases gradpress supports, in one place.

gradpress asks for ``torch>=2.2``. The suite runs on 2.13.0 in CI; it was
also run whole on 2.2.2 (docs/testing.md, "Older torch releases"), which
lacks the features below (2.13.0 has them all). Each helper detects the
feature, never a version number, and gives an older release the closest
behaviour:

* ``torch.serialization.safe_globals``: allow-listing classes for
  ``torch.load(weights_only=True)``. Without it nothing extra is allowed, so
  only a checkpoint that needs no extra class loads (today's formats need
  none; the numpy RNG state of a ``gradpress-train/1`` file does).
* ``DistributedDataParallel(init_sync=...)``: without it DDP always
  broadcasts rank 0's parameters at construction; :func:`ddp_kwargs` drops
  the keyword (replicas start equal either way; only construction is slower).
* ``DistributedDataParallel(bucket_cap_mb=None)``: 2.2.2 takes only a
  number; :func:`ddp_kwargs` leaves None (the default) out.
* ``_KinetoEvent.start_ns``: the older profiler gives microseconds.
* On 2.2.2, ``ProcessGroupGloo``'s destructor joins its worker threads
  while holding the GIL; a thread that still holds the last reference to a
  finished collective needs the GIL to free its tensors, so destroying a
  group right after a collective hung for good in the suite (py-spy: main
  thread in ``~ProcessGroupGloo`` -> ``thread::join``, the worker in
  ``~AsyncWork`` -> ``gil_scoped_acquire``). :func:`destroy_process_group`
  lets the threads finish first: a mitigation (a wait, on every release,
  not a detected feature), after which the 2.2.2 suite ran without a hang.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["allows_globals", "safe_globals", "ddp_kwargs", "event_start_ns", "destroy_process_group"]


def allows_globals() -> bool:
    """Whether this torch can allow-list classes for ``weights_only`` loads
    (``torch.serialization.safe_globals``)."""
    return hasattr(torch.serialization, "safe_globals")


@contextlib.contextmanager
def safe_globals(objects: Iterable[Any]) -> Iterator[None]:
    """``torch.serialization.safe_globals(objects)`` where the torch has it
    (:func:`allows_globals`), else nothing allowed beyond ``weights_only``'s
    own types."""
    if not allows_globals():
        yield
        return
    with torch.serialization.safe_globals(list(objects)):
        yield


def _ddp_parameters() -> frozenset[str]:
    return frozenset(inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters)


def ddp_kwargs(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``options`` for ``DistributedDataParallel`` less ``bucket_cap_mb=None``
    (DDP's default; 2.2.2 multiplies it without checking) and, where this
    torch's DDP does not take it, ``init_sync`` (its absence only costs
    time); any other unknown keyword is kept, so DDP names it."""
    known = _ddp_parameters()
    return {k: v for k, v in dict(options or {}).items()
            if not (k == "bucket_cap_mb" and v is None) and (k in known or k != "init_sync")}


def event_start_ns(event: Any) -> int:
    """A profiler event's start in nanoseconds (microseconds x 1000 where the
    event has no ``start_ns``)."""
    start = getattr(event, "start_ns", None)
    return int(start()) if start is not None else int(event.start_us()) * 1000


def destroy_process_group(settle_s: float = 0.05) -> None:
    """``dist.destroy_process_group()`` after a short wait that lets gloo's
    worker threads drop their last references to finished collectives (on
    torch 2.2 a destructor that joins them under the GIL can otherwise
    wait forever; see the module docstring):
    :func:`gradpress.transport.groups.destroy_all`, which the exit also uses."""
    from gradpress.transport.groups import destroy_all

    destroy_all(settle_s)
