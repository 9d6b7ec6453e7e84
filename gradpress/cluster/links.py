"""The links of an emulated cluster: building the namespaces, the bridge, the
veth pairs and the ``tc tbf`` qdiscs (both directions of every link), tearing
them down again, and reading the qdiscs' counters. :class:`LinksMixin` is
part of :class:`gradpress.cluster.netns.EmulatedCluster`, which describes the
topology.

Invariants:

- Everything lives in namespaces this run created; nothing is added to the
  root namespace (veth pairs are created directly inside the hub and node
  namespaces), and private addresses exist only on the node veths.
- Teardown deletes the nodes' namespaces first (their veths go with them),
  the hub last, and every ``/etc/netns/<ns>`` this run wrote.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
from pathlib import Path

from gradpress.cluster.host import _kill_group, _kill_netns_processes, _netns_list
from gradpress.cluster.outcomes import ClusterError

__all__ = ["LinksMixin", "default_burst", "ETH_HEADER", "MTU", "MIN_QUEUE_FRAMES"]

#: Ethernet frame overhead that tbf counts on top of the IP packet (header, no FCS).
ETH_HEADER = 14
MTU = 1500
MIN_QUEUE_FRAMES = 8

_HINTS = {
    "netns": "network namespaces (CONFIG_NET_NS) and a writable /run/netns",
    "bridge": "Linux bridges (CONFIG_BRIDGE; try `modprobe bridge`)",
    "veth": "veth pairs (CONFIG_VETH; try `modprobe veth`)",
    "tbf": "the tbf qdisc (CONFIG_NET_SCH_TBF; try `modprobe sch_tbf`)",
}


def default_burst(rate_bits: int) -> int:
    """tbf bucket size in bytes for a rate: 10 ms worth of traffic, at least
    4 full frames (6056 bytes). Big enough that the token bucket never starves
    between timer wake-ups and GSO segments pass whole (a too small bucket
    shapes systematically below the rate), small enough that the initial burst
    is ~1% of a one-second transfer."""
    return max(int(rate_bits / 8 * 0.010), 4 * (MTU + ETH_HEADER))


class LinksMixin:
    """Builds, removes and reads the links of :class:`~gradpress.cluster.netns.EmulatedCluster`
    (uses its names, rate, burst and queue settings)."""

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

    def _intra_tbf(self, ns: str) -> list[str]:
        """tbf on a node's ``lo`` (traffic between its own workers), at
        ``intra_rate_bits``, bucket and queue sized as for the links."""
        rate = self.intra_rate_bits
        burst = default_burst(rate)
        limit = burst + max(int(rate / 8 * self.queue_latency_s), MIN_QUEUE_FRAMES * (MTU + ETH_HEADER))
        return [self._tc, "-n", ns, "qdisc", "replace", "dev", "lo", "root", "tbf",
                "rate", f"{rate}bit", "burst", str(burst), "limit", str(limit)]

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
            if self.intra_rate_bits is not None:
                # lo's 64 KiB frames would not fit the bucket: frames of a NIC's size
                self._cmd([ip, "-n", ns, "link", "set", "lo", "mtu", str(MTU)], f"set lo's MTU in node {i}", "netns")
                self._cmd(self._intra_tbf(ns), f"shape inside node {i}", "tbf")

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
