"""Where ``hierarchical``'s hosts come from: the number of ranks per host
(from the environment when not given) and the check that it divides the
group, shared by the strategy and by ``gradpress train``'s check before any
worker starts; and what a host's leader is to the compressor
(:func:`unit_contexts`)."""

from __future__ import annotations

import dataclasses
import os

from gradpress.compress.context import Context

__all__ = ["ENV_VARS", "check_divides", "resolved_workers_per_host", "unit_contexts", "workers_per_host_from_env"]

ENV_VARS = ("GRADPRESS_WORKERS_PER_HOST", "LOCAL_WORLD_SIZE")


def workers_per_host_from_env(local_world: int | None = None) -> int:
    """L from ``GRADPRESS_WORKERS_PER_HOST``, else ``LOCAL_WORLD_SIZE``, else 1. ``local_world``: the
    ``LOCAL_WORLD_SIZE`` of workers about to start, in place of this process's (a launcher's check)."""
    for var in ENV_VARS:
        if var == "LOCAL_WORLD_SIZE" and local_world is not None:
            return local_world
        text = os.environ.get(var, "").strip()
        if text:
            try:
                value = int(text)
            except ValueError:
                raise ValueError(f"environment {var}={text!r}: allowed: a positive integer (workers per host)") from None
            if value < 1:
                raise ValueError(f"environment {var}={text!r}: allowed: a positive integer (workers per host)")
            return value
    return 1


def resolved_workers_per_host(given: int, world: int, local_world: int | None = None) -> int:
    """The ranks per host a group of ``world`` ranks builds for ``workers_per_host=given``, as
    ``Hierarchical`` does: one host for a world of one, else ``given``, else the environment's
    (:func:`workers_per_host_from_env`)."""
    if world <= 1:
        return 1
    return given or workers_per_host_from_env(local_world)


def check_divides(world: int, per: int) -> None:
    """The ranks' refusal of a host size that does not divide the world (also run before workers start)."""
    if world % per:
        raise ValueError(f"strategy 'hierarchical': workers_per_host={per} does not divide the group's "
                         f"{world} ranks; allowed: a divisor of {world}")


def unit_contexts(ctxs: list[Context], host: int, hosts: int, per: int) -> list[Context]:
    """The leader's encode contexts: one of ``hosts`` compressing units (``rank`` its host's index,
    ``world_size`` H, as the leaders' group numbers them), encoding the mean of its host's ``per`` workers
    (``unit_workers`` L); every other field (key, step, seed, loss scale) as the call's. PowerSGD divides
    Q's sum over the leaders by H; DGC clips the host mean to clip sqrt(H) (its module docstring)."""
    return [dataclasses.replace(c, rank=host, world_size=hosts, unit_workers=per) for c in ctxs]
