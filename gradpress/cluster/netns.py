"""An emulated cluster on one Linux machine: network namespaces, a bridge, tbf.

Topology (one run)::

      node 0 netns            hub netns (the "switch")             node 1 netns
    [eth0 10.77.0.1] ==veth== [port0]--switch0 (bridge)--[port1] ==veth== [eth0 10.77.0.2]
     tbf: node->switch         tbf: switch->node  tbf: switch->node       tbf: node->switch

Every node gets its own full-duplex link: the egress qdisc of the node-side
veth end (``eth0`` in the node's namespace) shapes node->switch traffic, the
egress qdisc of the switch-side end (``port<i>`` in the hub namespace) shapes
switch->node traffic. Both are ``tc tbf`` with the same rate, so each
direction of each link carries at most ``bandwidth`` independently, as with
hosts behind a non-blocking switch. There is no delay emulation: ``netem`` is
not available on the machines this project targets.

Invariants:

- Everything lives in namespaces this run created; nothing is added to the
  root namespace (veth pairs are created directly inside the hub and node
  namespaces), and private addresses exist only on the node veths.
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
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

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

DEFAULT_PREFIX = "gpc"
MAX_NODES = 250
#: Ethernet frame overhead that tbf counts on top of the IP packet (header, no FCS).
ETH_HEADER = 14
MTU = 1500
MIN_QUEUE_FRAMES = 8

_PREFIX_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,15}$")
_SEQ = itertools.count()

_HINTS = {
    "netns": "network namespaces (CONFIG_NET_NS) and a writable /run/netns",
    "bridge": "Linux bridges (CONFIG_BRIDGE; try `modprobe bridge`)",
    "veth": "veth pairs (CONFIG_VETH; try `modprobe veth`)",
    "tbf": "the tbf qdisc (CONFIG_NET_SCH_TBF; try `modprobe sch_tbf`)",
}


class ClusterError(RuntimeError):
    """The emulated cluster cannot be built, used or removed."""


class ClusterInterrupted(KeyboardInterrupt):
    """Raised in the main thread when SIGTERM/SIGHUP arrives while a cluster is up
    (SIGINT raises the usual ``KeyboardInterrupt``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


@dataclass(frozen=True)
class Support:
    """Whether this machine can host an emulated cluster, and why not."""

    ok: bool
    is_root: bool
    reasons: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.ok:
            return "emulated cluster supported (root, iproute2, netns, bridge, veth, tbf)"
        return "emulated cluster not supported: " + "; ".join(self.reasons)


@dataclass
class RunResult:
    """Outcome of :meth:`EmulatedCluster.run`; also a list of exit codes (``codes``)."""

    codes: list[int]
    killed: set[int] = field(default_factory=set)   # ranks the cluster terminated after another rank failed
    timed_out: bool = False
    log_dir: Path | None = None
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        """The worst exit code, as a shell would report it (see :func:`worst_exit_code`)."""
        if self.timed_out:
            return 124
        return worst_exit_code(self.codes, ignore=self.killed)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(c == 0 for c in self.codes)

    def log(self, rank: int) -> Path | None:
        """Path of a rank's log file (None for a rank whose output was streamed)."""
        if self.log_dir is None:
            return None
        p = self.log_dir / f"rank{rank}.log"
        return p if p.exists() else None


def _shell_code(code: int) -> int:
    return 128 - code if code < 0 else code


def worst_exit_code(codes: Sequence[int], ignore: Sequence[int] | set[int] = ()) -> int:
    """0 if every rank succeeded; else the largest exit code (a death by signal
    ``s`` counts as ``128 + s``) among ranks not in ``ignore`` (ranks the
    cluster itself terminated because another one failed)."""
    bad = [_shell_code(c) for r, c in enumerate(codes) if c != 0 and r not in set(ignore)]
    if not bad:
        bad = [_shell_code(c) for c in codes if c != 0]
    return max(bad) if bad else 0


def _which(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in ("/usr/sbin", "/sbin", "/usr/bin", "/bin"):
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    return None


def _is_root() -> bool:
    return os.geteuid() == 0


def _preflight() -> tuple[str, str]:
    """Return paths of ``ip`` and ``tc`` or raise ``ClusterError`` saying what is missing."""
    if not _is_root():
        raise ClusterError("the emulated cluster needs root (euid 0) to create network namespaces, "
                           "veth pairs and tc qdiscs; run it as root or with sudo")
    ip, tc = _which("ip"), _which("tc")
    missing = [n for n, p in (("ip", ip), ("tc", tc)) if p is None]
    if missing:
        raise ClusterError(f"{' and '.join(missing)} not found in PATH: install iproute2 "
                           "(e.g. `apt-get install iproute2`)")
    return ip, tc  # type: ignore[return-value]


def _netns_list(ip: str) -> list[str]:
    out = subprocess.run([ip, "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_processes(ip: str, ns: str) -> None:
    out = subprocess.run([ip, "netns", "pids", ns], capture_output=True, text=True)
    for tok in out.stdout.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


def cleanup_stale(prefix: str = DEFAULT_PREFIX, *, include_alive: bool = False) -> list[str]:
    """Delete namespaces left by clusters whose owning process is gone (after a
    SIGKILL, or ``--keep``); with ``include_alive`` also those of live processes.
    Returns the names deleted."""
    _check_prefix(prefix)
    ip, _ = _preflight()
    pat = re.compile(rf"^{re.escape(prefix)}-(\d+)-(\d+)-(hub|n\d+)$")
    removed = []
    names = [n for n in _netns_list(ip) if pat.match(n)]
    etc = Path("/etc/netns")
    orphans = [p.name for p in etc.iterdir() if pat.match(p.name) and p.name not in names] if etc.is_dir() else []
    # nodes first, hub last (deleting a node's namespace destroys its veth pair)
    for ns in sorted(names, key=lambda n: n.endswith("-hub")) + orphans:
        pid = int(pat.match(ns).group(1))  # type: ignore[union-attr]
        if not include_alive and pid != os.getpid() and _pid_alive(pid):
            continue
        if ns in names:
            _kill_netns_processes(ip, ns)
            if subprocess.run([ip, "netns", "del", ns], capture_output=True).returncode != 0:
                continue
            removed.append(ns)
        shutil.rmtree(etc / ns, ignore_errors=True)
    return removed


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


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise ValueError(f"prefix={prefix!r} is not allowed: expected 1-16 characters, a letter then "
                         "letters, digits or '_'")


def default_burst(rate_bits: int) -> int:
    """tbf bucket size in bytes for a rate: 10 ms worth of traffic, at least
    4 full frames (6056 bytes). Big enough that the token bucket never starves
    between timer wake-ups and GSO segments pass whole (a too small bucket
    shapes systematically below the rate), small enough that the initial burst
    is ~1% of a one-second transfer."""
    return max(int(rate_bits / 8 * 0.010), 4 * (MTU + ETH_HEADER))


class EmulatedCluster:
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

    def _cmd(self, argv: list[str], what: str, feature: str | None = None) -> None:
        out = subprocess.run(argv, capture_output=True, text=True)
        if out.returncode != 0:
            msg = out.stderr.strip() or out.stdout.strip() or f"exit code {out.returncode}"
            hint = f" (does this kernel support {_HINTS[feature]}?)" if feature else ""
            raise ClusterError(f"cannot {what}: `{' '.join(argv)}` failed: {msg}{hint}")

    def _tbf(self, ns: str, dev: str) -> list[str]:
        return [self._tc, "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                "rate", f"{self.rate_bits}bit", "burst", str(self.burst_bytes),
                "limit", str(self.queue_limit_bytes)]

    @property
    def queue_limit_bytes(self) -> int:
        """tbf ``limit``: the bucket plus ``queue_latency`` worth of traffic, and
        never fewer than ``MIN_QUEUE_FRAMES`` full frames (a queue of two or
        three packets at slow rates makes TCP drop and back off far below
        the rate)."""
        return self.burst_bytes + max(int(self.rate_bits / 8 * self.queue_latency_s), MIN_QUEUE_FRAMES * (MTU + ETH_HEADER))

    def _etc_files(self) -> None:
        """Per-namespace /etc/hosts and /etc/resolv.conf (``ip netns exec``
        bind-mounts ``/etc/netns/<ns>/*`` over ``/etc``): node names resolve
        locally, and no DNS query leaves the node (an unreachable resolver
        makes gloo's reverse lookups hang for seconds)."""
        hosts = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
            f"{self.address(i)} node{i}\n::ffff:{self.address(i)} node{i}\n" for i in range(self.nodes))
        for ns in self._created:
            d = Path("/etc/netns") / ns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text(hosts)
            (d / "resolv.conf").write_text("# gradpress cluster: no DNS inside emulated nodes\noptions timeout:1 attempts:1\n")

    def _build(self) -> None:
        ip, hub = self._ip, self.hub
        for ns in [hub] + [self.namespace(i) for i in range(self.nodes)]:
            self._cmd([ip, "netns", "add", ns], f"create network namespace {ns}", "netns")
            self._created.append(ns)
            self._cmd([ip, "-n", ns, "link", "set", "lo", "up"], f"bring up lo in {ns}", "netns")
        self._etc_files()
        self._cmd([ip, "-n", hub, "link", "add", "switch0", "type", "bridge"], "create the bridge", "bridge")
        self._cmd([ip, "-n", hub, "link", "set", "switch0", "up"], "bring up the bridge", "bridge")
        for i in range(self.nodes):
            ns, port, dev = self.namespace(i), self.switch_port(i), self.interface(i)
            self._cmd([ip, "-n", hub, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", ns],
                      f"create the veth pair of node {i}", "veth")
            self._cmd([ip, "-n", hub, "link", "set", port, "master", "switch0"], f"attach {port} to the bridge", "bridge")
            self._cmd(self._tbf(hub, port), f"shape switch->node {i}", "tbf")
            self._cmd([ip, "-n", hub, "link", "set", port, "up"], f"bring up {port}", "veth")
            self._cmd([ip, "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", dev], f"address node {i}", "veth")
            self._cmd(self._tbf(ns, dev), f"shape node {i}->switch", "tbf")
            self._cmd([ip, "-n", ns, "link", "set", dev, "up"], f"bring up {dev} in node {i}", "veth")

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

    def _teardown(self) -> list[str]:
        for p in self._procs:
            _kill_group(p, signal.SIGKILL)
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        errors = []
        # nodes first (their veths go with them), hub last
        for ns in sorted(self._created, key=lambda n: n == self.hub):
            _kill_netns_processes(self._ip, ns)
            out = subprocess.run([self._ip, "netns", "del", ns], capture_output=True, text=True)
            if out.returncode != 0 and ns in _netns_list(self._ip):
                errors.append(f"{ns}: {out.stderr.strip()}")
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        self._created.clear()
        self._up = False
        if self.log_dir is not None and self._own_log_dir and not self._keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        return errors

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

    # -- processes -------------------------------------------------------------
    def _require_up(self) -> None:
        if not self._up:
            raise ClusterError("the cluster is not up: use `with EmulatedCluster(...) as c:` or call start()")

    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside node ``i`` (``ip netns exec``) in its own process
        group; keyword arguments go to ``subprocess.Popen``. The process is
        killed at teardown if still running."""
        self._require_up()
        self._check_node(i)
        if isinstance(argv, (str, bytes)) or not argv:
            raise ValueError(f"argv={argv!r} is not allowed: expected a non-empty list of strings")
        kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen([self._ip, "netns", "exec", self.namespace(i), *map(str, argv)], **kwargs)
        self._procs = [q for q in self._procs if q.poll() is None]
        self._procs.append(p)
        return p

    def exec(self, i: int, argv: Sequence[str], *, timeout: float | None = 60, check: bool = False,
             input: str | None = None, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` in node ``i`` and wait; returns a ``CompletedProcess``
        with text ``stdout``/``stderr``. On timeout the process group is killed
        and ``subprocess.TimeoutExpired`` raised; with ``check`` a non-zero exit
        raises ``subprocess.CalledProcessError``."""
        p = self.popen(i, argv, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       env=None if env is None else {**os.environ, **env})
        try:
            out, err = p.communicate(input, timeout=timeout)
        except BaseException:
            _kill_group(p, signal.SIGKILL)
            p.communicate()
            raise
        done = subprocess.CompletedProcess(list(argv), p.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    def rank_env(self, rank: int) -> dict[str, str]:
        """The ``torch.distributed`` environment of the worker in node ``rank``."""
        self._check_node(rank)
        dev = self.interface(rank)
        return {
            "RANK": str(rank), "WORLD_SIZE": str(self.nodes),
            "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(rank), "NODE_RANK": str(rank),
            "MASTER_ADDR": self.address(0), "MASTER_PORT": str(self.master_port),
            "GLOO_SOCKET_IFNAME": dev, "TP_SOCKET_IFNAME": dev,
        }

    def _ensure_log_dir(self) -> Path:
        if self.log_dir is None:
            if self._logs_arg is not None:
                self._logs_arg.mkdir(parents=True, exist_ok=True)
                self.log_dir = self._logs_arg
            else:
                self.log_dir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-logs-"))
                self._own_log_dir = True
        return self.log_dir

    def run(self, command: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None,
            stream_rank0: bool = True, stdout: IO | None = None, kill_grace: float = 5.0) -> RunResult:
        """Run rank ``i`` of ``command`` in node ``i`` for every node, with
        ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
        ``MASTER_ADDR``, ``MASTER_PORT``, ``GLOO_SOCKET_IFNAME`` set (see
        :meth:`rank_env`) on top of the current environment and ``env``.

        Rank 0 writes to this process's stdout/stderr (or ``stdout``) when
        ``stream_rank0``; the other ranks (and rank 0 otherwise) write to
        ``<log_dir>/rank<i>.log``. When a rank fails, the others are
        terminated (SIGTERM, SIGKILL after ``kill_grace`` s), like torchrun;
        after ``timeout`` seconds all are. The tails of failed ranks' logs are
        printed to stderr and the log directory is kept."""
        self._require_up()
        if isinstance(command, (str, bytes)) or not command:
            raise ValueError(f"command={command!r} is not allowed: expected a non-empty list of strings")
        log_dir = self._ensure_log_dir()
        procs: list[subprocess.Popen] = []
        files: list[IO] = []
        result = RunResult(codes=[], log_dir=log_dir)
        t0 = time.monotonic()
        try:
            for rank in range(self.nodes):
                rank_env = {**os.environ, **(env or {}), **self.rank_env(rank)}
                if rank == 0 and stream_rank0:
                    out = stdout
                else:
                    f = open(log_dir / f"rank{rank}.log", "wb")  # noqa: SIM115
                    files.append(f)
                    out = f
                procs.append(self.popen(rank, command, env=rank_env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT if out is not None else None))
            failed_at: float | None = None
            while [p.poll() for p in procs].count(None):
                now = time.monotonic()
                if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                    failed_at = now
                    for r, p in enumerate(procs):
                        if p.poll() is None:
                            result.killed.add(r)
                            _kill_group(p, signal.SIGTERM)
                if timeout is not None and now - t0 > timeout and not result.timed_out:
                    result.timed_out = True
                    failed_at = now
                    for r, p in enumerate(procs):
                        if p.poll() is None:
                            result.killed.add(r)
                            _kill_group(p, signal.SIGTERM)
                if failed_at is not None and now - failed_at > kill_grace:
                    for p in procs:
                        if p.poll() is None:
                            _kill_group(p, signal.SIGKILL)
                time.sleep(0.02)
        except BaseException:
            for p in procs:
                _kill_group(p, signal.SIGKILL)
            for p in procs:
                p.wait()
            raise
        finally:
            for f in files:
                f.close()
        result.codes = [p.returncode for p in procs]
        result.seconds = time.monotonic() - t0
        if not result.ok:
            self._keep_logs = True
            self._report_failure(result, stream_rank0)
        return result

    def _report_failure(self, result: RunResult, stream_rank0: bool, tail: int = 30) -> None:
        what = "timed out" if result.timed_out else "failed"
        print(f"gradpress cluster: run {what}; exit codes by rank: {result.codes} (logs in {result.log_dir})",
              file=sys.stderr)
        for r, code in enumerate(result.codes):
            if code == 0 or r in result.killed or (r == 0 and stream_rank0):
                continue
            path = result.log(r)
            if path is None:
                continue
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            print(f"---- rank {r} (exit {code}), last {len(lines)} lines of {path} ----", file=sys.stderr)
            for line in lines:
                print(f"  {line}", file=sys.stderr)

    # -- link statistics -------------------------------------------------------
    def link_stats(self, i: int) -> dict[str, int]:
        """Bytes/packets/drops the two tbf qdiscs of node ``i``'s link have sent:
        ``tx_*`` node->switch, ``rx_*`` switch->node."""
        self._require_up()
        out: dict[str, int] = {}
        for side, ns, dev in (("tx", self.namespace(i), self.interface(i)), ("rx", self.hub, self.switch_port(i))):
            text = subprocess.run([self._tc, "-n", ns, "-s", "qdisc", "show", "dev", dev],
                                  capture_output=True, text=True).stdout
            m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)", text)
            if not m:
                raise ClusterError(f"cannot read tbf statistics of {dev} in {ns}: {text!r}")
            out[f"{side}_bytes"], out[f"{side}_packets"], out[f"{side}_drops"] = (int(m.group(k)) for k in (1, 2, 3))
        return out

    def __repr__(self) -> str:
        state = "up" if self._up else ("closed" if self._closed else "down")
        return f"EmulatedCluster(nodes={self.nodes}, bandwidth={self.rate_bits}bit, tag={self.tag!r}, {state})"


def _kill_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        if p.poll() is None:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass
