"""An emulated cluster on one Linux machine: network namespaces, a bridge, tbf.

Topology (one run)::

      node 0 netns            hub netns (the "switch")             node 1 netns
    [eth0 10.77.0.1] ==veth== [port0]--switch0 (bridge)--[port1] ==veth== [eth0 10.77.0.2]
     tbf: node->switch         tbf: switch->node  tbf: switch->node       tbf: node->switch

A node may host several workers (``workers_per_node``): rank ``r`` runs in
node ``r // workers_per_node``, as torchrun numbers ranks host by host. They
talk to each other inside the node over its loopback (the kernel routes a
node's own address through ``lo``): unshaped by default, or shaped with
``intra_bandwidth`` (one tbf on ``lo``: all traffic inside the node, both
directions, shares that rate, as a host's shared memory bus does).

Every node gets its own full-duplex link: the egress qdisc of the node-side
veth end (``eth0`` in the node's namespace) shapes node->switch traffic, the
egress qdisc of the switch-side end (``port<i>`` in the hub namespace) shapes
switch->node traffic. Both are ``tc tbf`` with the same rate, so each
direction of each link carries at most ``bandwidth`` independently, as with
hosts behind a non-blocking switch. There is no delay emulation: ``netem`` is
not available on the machines this project targets.

This module is :class:`EmulatedCluster` itself: its settings, names and
lifecycle (start, close, signals) and :func:`check_support`. The links are
built and removed in :mod:`gradpress.cluster.links`, processes run through
:mod:`gradpress.cluster.processes`, the host checks and stale cleanup are in
:mod:`gradpress.cluster.host`, the result and error types in
:mod:`gradpress.cluster.outcomes`; their public names are importable from here.

Invariants (see also :mod:`gradpress.cluster.links`):

- Namespace names are ``<prefix>-<pid>-<seq>-hub`` and ``<prefix>-<pid>-<seq>-n<i>``,
  unique per process and per cluster in it; interface names (``eth0``,
  ``port<i>``, ``switch0``) live inside those namespaces and cannot collide.
- ``close()`` (and leaving the ``with`` block, on success, error, Ctrl-C or
  SIGTERM) kills every process started in the nodes and deletes every
  namespace, which destroys the veths and the bridge; unless ``keep=True``.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from gradpress.cluster.host import (
    DEFAULT_PREFIX,
    _check_prefix,
    _is_root,
    _netns_list,
    _preflight,
    cleanup_stale,
)
from gradpress.cluster.links import ETH_HEADER, MTU, LinksMixin, default_burst
from gradpress.cluster.outcomes import ClusterError, ClusterInterrupted, RunResult, Support, worst_exit_code
from gradpress.cluster.processes import ProcessesMixin
from gradpress.cluster.units import parse_rate, parse_size, parse_time

__all__ = [
    "EmulatedCluster",
    "ClusterError",
    "ClusterInterrupted",
    "RunResult",
    "Support",
    "check_support",
    "cleanup_stale",
    "worst_exit_code",
    "DEFAULT_PREFIX",
]

MAX_NODES = 250
MAX_WORKERS_PER_NODE = 64
_SEQ = itertools.count()


def check_support(probe: bool = True) -> Support:
    """Report whether an emulated cluster can run here: root, ``ip`` and ``tc``,
    and (with ``probe``) whether the kernel really builds a 1-node cluster
    (namespaces, a bridge, a veth pair, tbf). Never raises."""
    reasons: list[str] = []
    root = _is_root()
    try:
        _preflight()
    except ClusterError as exc:
        reasons.append(str(exc))
        return Support(False, root, tuple(reasons))
    if probe:
        try:
            with EmulatedCluster(1, "1mbit", prefix="gpprobe", handle_signals=False):
                pass
        except ClusterError as exc:
            reasons.append(str(exc))
    return Support(not reasons, root, tuple(reasons))


class EmulatedCluster(LinksMixin, ProcessesMixin):
    """N emulated hosts behind a switch, each with its own shaped full-duplex link.

    Use as a context manager::

        with EmulatedCluster(2, "50mbit") as c:
            c.exec(1, ["ping", "-c1", c.address(0)])
            result = c.run(["python3", "train.py"])   # rank i runs in node i
            print(result.codes, result.exit_code)

    Args:
        nodes: number of hosts (1..250).
        bandwidth: link rate per direction, tc syntax (``"100mbit"``) or bits/s.
        burst: tbf bucket size (tc size syntax or bytes); default :func:`default_burst`.
        queue_latency: tbf ``latency``: the longest a packet may wait in the
            link's queue (sets the queue length; it is NOT a link delay).
        workers_per_node: ranks per node (1..64); rank r runs in node
            r // workers_per_node with LOCAL_RANK r % workers_per_node.
        intra_bandwidth: rate of the traffic between a node's own workers
            (tc syntax); None: unshaped (loopback speed).
        prefix: namespace name prefix; names are ``<prefix>-<pid>-<seq>-...``.
        subnet: first three octets of the /24 on the node links.
        master_port: ``MASTER_PORT`` given to :meth:`run`.
        logs: directory for per-rank logs (default: a temp dir, kept on failure).
        keep: leave the namespaces up on exit (remove later with
            :func:`cleanup_stale` or ``gradpress cluster --cleanup``).
        handle_signals: in the main thread, turn SIGTERM/SIGHUP into
            :class:`ClusterInterrupted` while the cluster is up so teardown runs.
    """

    def __init__(
        self,
        nodes: int,
        bandwidth: str | int,
        *,
        burst: str | int | None = None,
        queue_latency: str | float = "5ms",
        workers_per_node: int = 1,
        intra_bandwidth: str | int | None = None,
        prefix: str = DEFAULT_PREFIX,
        subnet: str = "10.77.0",
        master_port: int = 29500,
        logs: str | os.PathLike | None = None,
        keep: bool = False,
        handle_signals: bool = True,
    ) -> None:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes={nodes!r} is not allowed: expected an integer 1..{MAX_NODES}")
        self.rate_bits = parse_rate(bandwidth, "bandwidth")
        self.burst_bytes = default_burst(self.rate_bits) if burst is None else parse_size(burst, "burst")
        if self.burst_bytes < MTU + ETH_HEADER:
            raise ValueError(f"burst={burst!r} ({self.burst_bytes} bytes) is too small: a full frame is "
                             f"{MTU + ETH_HEADER} bytes; allowed >= {MTU + ETH_HEADER} bytes")
        self.queue_latency_s = (float(queue_latency) if isinstance(queue_latency, (int, float))
                                and not isinstance(queue_latency, bool) else parse_time(queue_latency, "queue_latency"))
        if not 0 < self.queue_latency_s <= 60:
            raise ValueError(f"queue_latency={queue_latency!r} is out of range: allowed > 0 .. 60 s")
        if isinstance(workers_per_node, bool) or not isinstance(workers_per_node, int) \
                or not 1 <= workers_per_node <= MAX_WORKERS_PER_NODE:
            raise ValueError(f"workers_per_node={workers_per_node!r} is not allowed: expected an integer "
                             f"1..{MAX_WORKERS_PER_NODE}")
        self.workers_per_node = workers_per_node
        self.intra_rate_bits = None if intra_bandwidth is None else parse_rate(intra_bandwidth, "intra_bandwidth")
        _check_prefix(prefix)
        if not re.fullmatch(r"(25[0-5]|2[0-4]\d|1?\d?\d)\.(25[0-5]|2[0-4]\d|1?\d?\d)\.(25[0-5]|2[0-4]\d|1?\d?\d)", subnet):
            raise ValueError(f"subnet={subnet!r} is not allowed: expected three octets like '10.77.0'")
        if isinstance(master_port, bool) or not isinstance(master_port, int) or not 1 <= master_port <= 65535:
            raise ValueError(f"master_port={master_port!r} is not allowed: expected an integer 1..65535")
        self.nodes = nodes
        self.prefix = prefix
        self.subnet = subnet
        self.master_port = master_port
        self.keep = keep
        self.handle_signals = handle_signals
        self.tag = f"{prefix}-{os.getpid()}-{next(_SEQ)}"
        self.hub = f"{self.tag}-hub"
        self._logs_arg = Path(logs) if logs is not None else None
        self.log_dir: Path | None = None
        self._own_log_dir = False
        self._keep_logs = False
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._up = False
        self._closed = False
        self._old_handlers: dict[int, Any] = {}
        self._ip = self._tc = ""

    # -- names -----------------------------------------------------------------
    def namespace(self, i: int) -> str:
        """Name of node ``i``'s network namespace."""
        self._check_node(i)
        return f"{self.tag}-n{i}"

    @property
    def namespaces(self) -> list[str]:
        """All namespaces of this cluster: the nodes, then the hub."""
        return [self.namespace(i) for i in range(self.nodes)] + [self.hub]

    def address(self, i: int) -> str:
        """IPv4 address of node ``i`` (``<subnet>.<i+1>``)."""
        self._check_node(i)
        return f"{self.subnet}.{i + 1}"

    def interface(self, i: int) -> str:
        """Name of node ``i``'s network interface inside its namespace (``GLOO_SOCKET_IFNAME``)."""
        self._check_node(i)
        return "eth0"

    @property
    def world(self) -> int:
        """Ranks of a :meth:`run`: nodes x workers per node."""
        return self.nodes * self.workers_per_node

    def node_of(self, rank: int) -> int:
        """The node rank ``rank`` runs in (ranks are numbered node by node)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ValueError(f"rank={rank!r} is not allowed: expected an integer 0..{self.world - 1}")
        return rank // self.workers_per_node

    def switch_port(self, i: int) -> str:
        """Name of the switch-side end of node ``i``'s link (in the hub namespace)."""
        self._check_node(i)
        return f"port{i}"

    def _check_node(self, i: int) -> None:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.nodes:
            raise ValueError(f"node={i!r} is not allowed: expected an integer 0..{self.nodes - 1}")

    # -- lifecycle -------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(raising=exc[0] is None)

    def start(self) -> EmulatedCluster:
        """Build the namespaces, bridge, veths and qdiscs (idempotent)."""
        if self._up:
            return self
        if self._closed:
            raise ClusterError("this cluster was closed; create a new EmulatedCluster")
        self._ip, self._tc = _preflight()
        taken = sorted(set(self.namespaces) & set(_netns_list(self._ip)))
        if taken:
            raise ClusterError(f"network namespace name(s) already taken: {', '.join(taken)}; another run "
                               f"(or a --keep run) uses them: pick another --prefix or remove them with "
                               f"`gradpress cluster --cleanup --prefix {self.prefix}` / `ip netns del NAME`")
        self._install_signals()
        atexit.register(self.close)
        self._up = True
        try:
            self._build()
        except BaseException:
            self.close(raising=False)
            raise
        return self

    def close(self, raising: bool = False) -> None:
        """Kill every process started in the nodes and delete the namespaces
        (idempotent). Unless ``keep``. With ``raising``, a failed deletion
        raises ``ClusterError``; otherwise it is reported on stderr."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        saved = self._ignore_signals()
        try:
            errors = [] if self.keep else self._teardown()
        finally:
            self._restore_signals(saved)
            self._uninstall_signals()
        if self.keep and self._created:
            print(f"gradpress cluster: kept namespaces {', '.join(self._created)}; remove with "
                  f"`gradpress cluster --cleanup --prefix {self.prefix}`", file=sys.stderr)
        if errors:
            msg = "could not remove: " + "; ".join(errors)
            if raising:
                raise ClusterError(msg)
            print(f"gradpress cluster: {msg}", file=sys.stderr)

    # -- signals ---------------------------------------------------------------
    def _main_thread(self) -> bool:
        return threading.current_thread() is threading.main_thread()

    def _install_signals(self) -> None:
        if not self.handle_signals or not self._main_thread():
            return

        def handler(signum: int, frame: object) -> None:
            raise ClusterInterrupted(signum)

        for s in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[s] = signal.signal(s, handler)

    def _uninstall_signals(self) -> None:
        for s, h in self._old_handlers.items():
            signal.signal(s, h)
        self._old_handlers.clear()

    def _ignore_signals(self) -> dict[int, Any]:
        """Teardown must not be interrupted by a second Ctrl-C or SIGTERM."""
        if not self._main_thread():
            return {}
        return {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    @staticmethod
    def _restore_signals(saved: dict[int, Any]) -> None:
        for s, h in saved.items():
            signal.signal(s, h)

    def __repr__(self) -> str:
        state = "up" if self._up else ("closed" if self._closed else "down")
        per = f", workers_per_node={self.workers_per_node}" if self.workers_per_node > 1 else ""
        return f"EmulatedCluster(nodes={self.nodes}{per}, bandwidth={self.rate_bits}bit, tag={self.tag!r}, {state})"
