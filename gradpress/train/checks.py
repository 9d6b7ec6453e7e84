"""The rules of the options every command shares (``train``, ``compare``,
every ``bench``): counts of local workers, seeds, output directories, and
the integer and choice checks :mod:`gradpress.train.validate` applies to
each field of a :class:`~gradpress.train.config.TrainConfig`.

Invariant: a value that breaks a rule raises ``ValueError`` naming the
field (or flag: ``name``), the value and what is allowed, before any data,
model or worker; nothing is created on disk by a check.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from gradpress.train.cpus import usable_cpus

__all__ = ["SEED_MAX", "check_nproc", "check_out", "check_seed", "nproc_max", "planned_world", "probe_writable"]

#: the largest --seed: numpy's global generator (seeded from it) takes 32-bit seeds
SEED_MAX = 2**32 - 1


def _int(name: str, value: Any, low: int | None = None, optional: bool = False, high: int | None = None) -> int | None:
    if value is None and optional:
        return None
    allowed = "" if low is None else f" >= {low}"
    if high is not None:
        allowed = f" from {low} to {high}"
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer{allowed}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be an integer{allowed}, got {value!r}")
    return int(value)


def nproc_max() -> int:
    """The most local workers one command starts on this machine: max(64, 8 x its usable cores,
    :func:`usable_cpus`). More is a typo (``--nproc 4000`` forked 4000 workers), not a run anyone wants."""
    return max(64, 8 * usable_cpus())


def check_nproc(value: Any, name: str = "nproc") -> int:
    """The rule of every count of local workers (train and compare ``--nproc``, ``bench plan --nproc``, bench
    e2e's nodes x workers per node): an integer from 1 to :func:`nproc_max`; ValueError naming ``name``."""
    n = _int(name, value, 1)
    cap = nproc_max()
    if n > cap:
        raise ValueError(f"{name} must be an integer from 1 to {cap} (local workers on one machine: at most "
                         f"max(64, 8 x {usable_cpus()} cores)), got {n}")
    return n


def planned_world(nproc: int | None) -> int | None:
    """The number of workers a run will have: ``nproc`` (local workers), else
    the ``WORLD_SIZE`` of a launcher such as torchrun, else None (unknown)."""
    if nproc is not None:
        return nproc
    env_world = os.environ.get("WORLD_SIZE", "")
    return int(env_world) if env_world.isdigit() else None


def check_seed(value: Any, name: str = "seed") -> int:
    """The rule every ``--seed`` follows (train, compare, every bench): an integer from 0 to
    :data:`SEED_MAX`; ValueError naming ``name``, the value and the range otherwise."""
    return _int(name, value, 0, high=SEED_MAX)


def check_out(out: str, field: str = "out") -> None:
    """Fail (ValueError, one line) unless ``out`` is a directory this process
    can create and write in: checked before any data, model or worker. Nothing
    is created: a probe file is written and removed in ``out``, or in its
    nearest existing ancestor. ``field`` names the option in the message."""
    path = os.path.abspath(out)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{field}: {out!r} exists and is not a directory")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{field}: cannot create {out!r}: {existing!r} is a file, not a directory")
    probe_writable(existing, field, repr(out))


def probe_writable(directory: str, field: str, shown: str) -> None:
    """ValueError naming ``field`` unless a file can be created in
    ``directory`` (a probe file, written and removed: permissions, a
    read-only mount, a full disk all show)."""
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".gradpress-probe-")
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise ValueError(f"{field}: cannot write to {shown}: {exc.strerror or exc} (in {directory!r})") from None


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return value
