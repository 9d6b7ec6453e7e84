"""gradpress's own process groups, with a timeout.

Every integration (the DDP hook, the algorithms) talks on a group of its own
over the same ranks, so its collectives never interleave with DDP's or the
user's. A collective that a dead or stuck peer never joins fails after the
group's timeout instead of hanging: the caller's, else the base group's
(``new_group`` alone would fall back to 30 minutes).
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["own_group", "timeout_of", "device_of", "leave", "destroy_all", "EXIT_STEPS"]


def device_of(group: dist.ProcessGroup | None) -> torch.device:
    """The device collectives of ``group`` run on: CUDA for NCCL, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def timeout_of(group: dist.ProcessGroup | None, timeout: float | datetime.timedelta | None) -> datetime.timedelta | None:
    """``timeout`` as a timedelta (validated: an invalid one, infinite or
    beyond what a timedelta holds included, raises ValueError, never another
    error), else the timeout of ``group`` (None: the default group, as
    everywhere in torch; None where torch does not say)."""
    if timeout is not None:
        if isinstance(timeout, datetime.timedelta):
            return timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
        try:
            return datetime.timedelta(seconds=float(timeout))
        except OverflowError:  # inf, or more than timedelta.max
            raise ValueError(f"timeout must be a positive number of seconds or a timedelta, at most "
                             f"{datetime.timedelta.max.total_seconds():.0f} seconds, got {timeout!r}") from None
    try:
        device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
        base = group if group is not None else dist.group.WORLD  # None: the default group
        return base._get_backend(device).options._timeout  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - private API; fall back to torch's default
        return None


def own_group(base: dist.ProcessGroup | None,
              timeout: float | datetime.timedelta | None = None) -> tuple[dist.ProcessGroup, str | None]:
    """A new group over the ranks of ``base`` (default: the world), same
    backend, and the error message of an invalid ``timeout`` (None when
    valid). Collective: every rank of the world calls it, so a rank with a
    bad ``timeout`` still joins (with the base group's timeout) and reports
    its error through the caller's agreement step instead of leaving the
    others waiting."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call dist.init_process_group first (torchrun does)")
    base_group = base if base is not None else dist.group.WORLD
    try:
        chosen, error = timeout_of(base_group, timeout), None
    except ValueError as exc:
        chosen, error = timeout_of(base_group, None), str(exc)
    ranks = dist.get_process_group_ranks(base_group)
    global _CREATED
    _CREATED = True
    return dist.new_group(ranks=ranks, backend=dist.get_backend(base_group), timeout=chosen), error


def destroy_all(settle_s: float = 0.05) -> None:
    """``dist.destroy_process_group()`` (every group) after a garbage collection and a short wait that let
    gloo's worker threads drop their last references to finished collectives (on torch 2.2 a destructor that
    joins them under the GIL can otherwise wait forever; :mod:`gradpress.torch_compat`). A plain destroy at the
    end of a two-rank script with a second group aborted in 9 of 24 runs here, this one in none."""
    import gc
    import time

    gc.collect()
    time.sleep(settle_s)
    dist.destroy_process_group()


#: whether this process made a group of its own (:func:`own_group`): the exit then destroys the groups left
_CREATED = False
#: what must end before the groups go, run in order at exit (the background threads, the DDP hook's thread);
#: each returns whether its work ended (False: a job still in flight on a group)
EXIT_STEPS: list[Callable[[], bool]] = []


@atexit.register
def _at_exit() -> None:
    """At interpreter exit: every :data:`EXIT_STEPS` step, then, in a process where gradpress made a group of
    its own and the script did not destroy them, ``destroy_process_group()`` (all groups) while the
    interpreter is still whole. torch 2.13 with gloo aborted at the teardown ("terminate called without an
    active exception", exit -6) in 2-3 of 10 two-rank runs of a script with a second group (``new_group``)
    and no destroy, gradpress imported or not; with this, none in 20. Not when a step left a job in flight
    (a collective a peer never joined): destroying its group would wait for it (NCCL's destroy flushes the
    collectives in flight since torch 2.6; gloo's destructor on 2.2 joins the worker that runs it), up to the
    group's timeout, past the steps' bound; the teardown gets those groups. Never raises."""
    ended = all([step() for step in EXIT_STEPS])  # a list: every step runs
    if not ended or not _CREATED or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        destroy_all()
    except Exception:  # noqa: BLE001 - the exit goes on whatever a peer or the backend did
        pass


def leave(code: int) -> None:
    """End a worker process whose results are on disk, with exit ``code``,
    without interpreter teardown: torch's static destructors occasionally
    abort there ("terminate called without an active exception", exit -6),
    which would turn a finished run into a failed one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
