"""Where ``hierarchical``'s hosts come from: the number of ranks per host
(from the environment when not given) and the check that it divides the
group, shared by the strategy and by ``gradpress train``'s check before any
worker starts."""

from __future__ import annotations

import os

__all__ = ["ENV_VARS", "check_divides", "workers_per_host_from_env"]

ENV_VARS = ("GRADPRESS_WORKERS_PER_HOST", "LOCAL_WORLD_SIZE")


def workers_per_host_from_env() -> int:
    """L from ``GRADPRESS_WORKERS_PER_HOST``, else ``LOCAL_WORLD_SIZE``, else 1."""
    for var in ENV_VARS:
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


def check_divides(world: int, per: int) -> None:
    """The ranks' refusal of a host size that does not divide the world (also run before workers start)."""
    if world % per:
        raise ValueError(f"strategy 'hierarchical': workers_per_host={per} does not divide the group's "
                         f"{world} ranks; allowed: a divisor of {world}")
