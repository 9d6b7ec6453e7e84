"""An emulated cluster on one machine: hosts in network namespaces behind a
bridge, each link shaped with ``tc tbf`` in both directions.

``EmulatedCluster(nodes, bandwidth)`` is the API (see :mod:`gradpress.cluster.netns`);
``gradpress cluster`` is the command line; ``docs/cluster.md`` explains both.
"""

from gradpress.cluster.bulk import measure_goodput, transfer
from gradpress.cluster.netns import (
    DEFAULT_PREFIX,
    ClusterError,
    ClusterInterrupted,
    EmulatedCluster,
    RunResult,
    Support,
    check_support,
    cleanup_stale,
    default_burst,
    worst_exit_code,
)
from gradpress.cluster.units import format_rate, parse_rate, parse_size, parse_time

__all__ = [
    "DEFAULT_PREFIX",
    "ClusterError",
    "ClusterInterrupted",
    "EmulatedCluster",
    "RunResult",
    "Support",
    "check_support",
    "cleanup_stale",
    "default_burst",
    "format_rate",
    "measure_goodput",
    "parse_rate",
    "parse_size",
    "parse_time",
    "transfer",
    "worst_exit_code",
]
