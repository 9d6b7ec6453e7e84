"""Written for survivors of the ``cluster`` group of ``make mutants`` (gradpress/cluster/: units, links,
outcomes, bulk, host, netns): the pure parts of the emulated cluster, in one process, no namespace.

Rates, sizes and times are checked against values computed here from the units' definitions (SI x1000,
IEC x1024, bytes x8, tc's bare numbers); the tbf parameters against docs/cluster.md ("burst: 10 ms of
RATE, at least 4 frames"; "limit = bucket + max(queue_latency x rate, 8 frames)", a frame 1500 + 14
bytes); the layout against the topology of gradpress/cluster/netns.py, with every command recorded
instead of run. An autouse guard makes any command of a cluster or of the host helpers fail the test
unless the test installed its own stand-in, so no mutant can build or delete a namespace here.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gradpress.cluster import bulk, units
from gradpress.cluster import host as host_mod
from gradpress.cluster import links as links_mod
from gradpress.cluster.netns import EmulatedCluster
from gradpress.cluster.outcomes import ClusterError, ClusterInterrupted, RunResult, Support, worst_exit_code

pytestmark = pytest.mark.mutants

FRAME = 1500 + 14  # an MTU-sized IP packet plus the Ethernet header, as tbf counts it
_NETNS_LIST = host_mod._netns_list  # the guard below replaces it


@pytest.fixture(autouse=True)
def no_commands(monkeypatch):
    """Nothing a test here does may run ``ip`` or ``tc`` for real (a test replaces these with its own)."""
    def refused(*args, **kwargs):
        raise AssertionError(f"a real command would have run: {args!r}")

    monkeypatch.setattr(links_mod.subprocess, "run", refused)  # the same module object for host and links
    monkeypatch.setattr(host_mod, "_netns_list", refused)
    monkeypatch.setattr(links_mod, "_netns_list", refused)


def _cluster(nodes: int = 2, bandwidth: str = "50mbit", **kwargs) -> EmulatedCluster:
    c = EmulatedCluster(nodes, bandwidth, prefix="gpmut", **kwargs)
    c._ip, c._tc = "IP", "TC"
    return c


# -- units -------------------------------------------------------------------------------------------------------
SI = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
IEC = {"ki": 1024.0, "mi": 1024.0**2, "gi": 1024.0**3, "ti": 1024.0**4}


@pytest.mark.parametrize("prefix", [*SI, *IEC])
def test_every_rate_unit_is_its_definition_in_any_case(prefix):
    mult = {**SI, **IEC}[prefix]
    number = 0.75 if prefix.startswith("t") else 3  # inside 8 kbit .. 1 tbit for every multiplier (x8 for bytes)
    if prefix in ("k", "ki"):
        number = 300
    for unit, bits_per in ((f"{prefix}bit", 1), (f"{prefix}bps", 8)):
        want = round(number * mult * bits_per)
        if want > 10**12:
            with pytest.raises(ValueError, match="out of range"):
                units.parse_rate(f"{number}{unit}")
            continue
        assert units.parse_rate(f"{number}{unit}") == want, unit
        assert units.parse_rate(f"{number}{unit.upper()}") == want, unit


def test_rate_bounds_rounding_and_number_forms():
    assert units.parse_rate("8000") == 8000 and units.parse_rate("8kbit") == 8000
    assert units.parse_rate("1000bps") == 8000 and units.parse_rate("1tbit") == 10**12 and units.parse_rate(10**12) == 10**12
    for bad in ("7999", "7999bit", 10**12 + 1, "1tibit", "0.126tbps"):
        with pytest.raises(ValueError, match=r"out of range: allowed 8kbit \.\. 1tbit"):
            units.parse_rate(bad)
    assert units.parse_rate("8000.4") == 8000 and units.parse_rate("8000.6") == 8001  # round to nearest
    assert units.parse_rate(".5mbit") == 500_000 and units.parse_rate("5.mbit") == 5_000_000
    assert units.parse_rate("1E3kbit") == 10**6 and units.parse_rate("1e-3gbit") == 10**6
    assert units.parse_rate(" 5 mbit ") == 5_000_000 and units.parse_rate(2.5e6) == 2_500_000
    assert units.parse_rate("20000bit") == 20_000 and units.parse_rate("1250bps") == 10_000
    assert isinstance(units.parse_rate("1.5mbit"), int)
    with pytest.raises(ValueError) as e:
        units.parse_rate("5xbit", "intra_bandwidth")
    assert str(e.value).startswith("intra_bandwidth='5xbit': unknown rate unit 'xbit'; expected ")
    for bad in ([5], None, True, b"5mbit"):
        with pytest.raises(ValueError, match=r"^bandwidth=.* is not allowed: expected a positive number"):
            units.parse_rate(bad)


def test_every_size_unit_is_its_definition_and_the_bounds():
    table = {"": 1, "b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2, "g": 1024**3, "gb": 1024**3,
             "kbit": 1024 / 8, "mbit": 1024**2 / 8, "gbit": 1024**3 / 8}
    for unit, mult in table.items():
        number = 1 if unit.startswith("g") else 3
        assert units.parse_size(f"{number}{unit.upper()}") == math.ceil(number * mult), unit
    assert units.parse_size("1") == 1 and units.parse_size("1.5") == 2 and units.parse_size("0.1k") == 103
    assert units.parse_size("2gb") == 2**31 and units.parse_size(2**31) == 2**31
    for bad in ("0.5", "0", 2**31 + 1, "2.0001gb"):
        with pytest.raises(ValueError, match=r"^burst=.* is out of range: allowed 1 byte \.\. 2gb"):
            units.parse_size(bad)
    with pytest.raises(ValueError, match=r"^burst='3tb': unknown size unit 'tb'"):
        units.parse_size("3tb")


def test_every_time_unit_is_its_definition_and_the_bounds():
    table = {"": 1e-6, "us": 1e-6, "usec": 1e-6, "usecs": 1e-6, "ms": 1e-3, "msec": 1e-3, "msecs": 1e-3,
             "s": 1.0, "sec": 1.0, "secs": 1.0}
    for unit, mult in table.items():
        assert units.parse_time(f"7{unit.upper()}") == pytest.approx(7 * mult, rel=1e-12), unit
    assert units.parse_time("60s") == 60.0 and units.parse_time("1us") == pytest.approx(1e-6)
    for bad in ("60.001s", "0", "0s", "60000001"):
        with pytest.raises(ValueError, match=r"^latency=.* is out of range: allowed > 0 \.\. 60s"):
            units.parse_time(bad)
    with pytest.raises(ValueError, match=r"^latency='5min': unknown time unit 'min'"):
        units.parse_time("5min")


@pytest.mark.parametrize("bits,text", [
    (47.8e6, "47.8 Mbit/s"), (1e9, "1 Gbit/s"), (2.5e9, "2.5 Gbit/s"), (1e6, "1 Mbit/s"), (999_999, "1e+03 kbit/s"),
    (1e3, "1 kbit/s"), (999, "999 bit/s"), (0, "0 bit/s"), (1.5e12, "1.5e+03 Gbit/s"),
])
def test_format_rate_picks_the_largest_unit_not_above_the_rate(bits, text):
    assert units.format_rate(bits) == text


# -- tbf parameters and the layout's commands (links) ---------------------------------------------------------------
@pytest.mark.parametrize("rate", [8_000, 1_000_000, 4 * FRAME * 800, 4 * FRAME * 800 + 1, 4 * FRAME * 800 - 1,
                                  10_000_000, 50_000_000, 10**12])
def test_default_burst_is_10ms_of_traffic_and_at_least_4_frames(rate):
    want = max(math.floor(rate / 8 * 0.010), 4 * FRAME)
    assert links_mod.default_burst(rate) == want and isinstance(links_mod.default_burst(rate), int)


@pytest.mark.parametrize("bandwidth,latency", [("50mbit", "5ms"), ("1mbit", "5ms"), ("1gbit", "20ms"),
                                               ("100mbit", 0.0005)])
def test_tbf_commands_carry_rate_burst_and_limit_by_the_documented_rules(bandwidth, latency):
    c = _cluster(bandwidth=bandwidth, queue_latency=latency)
    rate = units.parse_rate(bandwidth)
    lat = latency if isinstance(latency, float) else units.parse_time(latency)
    burst = max(math.floor(rate / 8 * 0.010), 4 * FRAME)
    limit = burst + max(math.floor(rate / 8 * lat), 8 * FRAME)
    assert c.burst_bytes == burst and c.queue_limit_bytes == limit
    assert c._tbf("NS", "DEV") == ["TC", "-n", "NS", "qdisc", "replace", "dev", "DEV", "root", "tbf", "rate",
                                   f"{rate}bit", "burst", str(burst), "limit", str(limit)]
    c2 = _cluster(bandwidth="10mbit", queue_latency=latency, workers_per_node=2, intra_bandwidth=bandwidth)
    assert c2._intra_tbf("NS") == ["TC", "-n", "NS", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate",
                                   f"{rate}bit", "burst", str(burst), "limit", str(limit)]
    c3 = _cluster(bandwidth=bandwidth, queue_latency=latency, burst="3000")
    assert c3.queue_limit_bytes == 3000 + max(math.floor(rate / 8 * lat), 8 * FRAME)


@pytest.mark.parametrize("intra", [None, "200mbit"])
def test_build_runs_the_documented_layout_in_order(monkeypatch, intra):
    c = _cluster(nodes=2, bandwidth="50mbit", workers_per_node=2 if intra else 1, intra_bandwidth=intra)
    ran: list[tuple[list[str], str, str | None]] = []
    monkeypatch.setattr(c, "_cmd", lambda argv, what, feature=None: ran.append((list(argv), what, feature)))
    monkeypatch.setattr(c, "_etc_files", lambda: ran.append((["etc"], list(c._created), None)))
    c._build()
    hub, n0, n1 = c.hub, f"{c.tag}-n0", f"{c.tag}-n1"
    want = []
    for ns in (hub, n0, n1):
        want += [(["IP", "netns", "add", ns], f"create network namespace {ns}", "netns"),
                 (["IP", "-n", ns, "link", "set", "lo", "up"], f"bring up lo in {ns}", "netns")]
    want += [(["etc"], [hub, n0, n1], None),
             (["IP", "-n", hub, "link", "add", "switch0", "type", "bridge"], "create the bridge", "bridge"),
             (["IP", "-n", hub, "link", "set", "switch0", "up"], "bring up the bridge", "bridge")]
    for i, ns in enumerate((n0, n1)):
        port = f"port{i}"
        want += [(["IP", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns],
                  f"create the veth pair of node {i}", "veth"),
                 (["IP", "-n", hub, "link", "set", port, "master", "switch0"], f"attach {port} to the bridge", "bridge"),
                 (c._tbf(hub, port), f"shape switch->node {i}", "tbf"),
                 (["IP", "-n", hub, "link", "set", port, "up"], f"bring up {port}", "veth"),
                 (["IP", "-n", ns, "addr", "add", f"10.77.0.{i + 1}/24", "dev", "eth0"], f"address node {i}", "veth"),
                 (c._tbf(ns, "eth0"), f"shape node {i}->switch", "tbf"),
                 (["IP", "-n", ns, "link", "set", "eth0", "up"], f"bring up eth0 in node {i}", "veth")]
        if intra:
            want += [(["IP", "-n", ns, "link", "set", "lo", "mtu", "1500"], f"set lo's MTU in node {i}", "netns"),
                     (c._intra_tbf(ns), f"shape inside node {i}", "tbf")]
    assert ran == want
    assert c._created == [hub, n0, n1]


def _completed(argv, kw, code, out="", err=""):
    """What ``subprocess.run(argv, **kw)`` returns for a command that printed ``out``/``err`` and exited ``code``:
    output only where captured, bytes unless ``text``."""
    if not kw.get("capture_output"):
        return subprocess.CompletedProcess(argv, code, None, None)
    return subprocess.CompletedProcess(argv, code, *((out, err) if kw.get("text") else (out.encode(), err.encode())))


def test_cmd_names_the_command_its_message_and_the_feature(monkeypatch):
    c = _cluster()
    answers = {"ok": (0, "fine", ""), "err": (2, "out", "  boom \n"), "out": (3, "  said this ", ""), "none": (4, "", ""),
               "sig": (-signal.SIGKILL, "", "")}
    monkeypatch.setattr(links_mod.subprocess, "run", lambda argv, **kw: _completed(argv, kw, *answers[argv[1]]))
    assert c._cmd(["X", "ok"], "do it", "tbf") is None
    with pytest.raises(ClusterError) as e:
        c._cmd(["X", "err"], "shape it", "tbf")
    assert str(e.value) == ("cannot shape it: `X err` failed: boom (does this kernel support the tbf qdisc "
                            "(CONFIG_NET_SCH_TBF; try `modprobe sch_tbf`)?)")
    with pytest.raises(ClusterError) as e:
        c._cmd(["X", "out"], "add it")
    assert str(e.value) == "cannot add it: `X out` failed: said this"
    with pytest.raises(ClusterError) as e:
        c._cmd(["X", "none"], "add it", "veth")
    assert str(e.value) == ("cannot add it: `X none` failed: exit code 4 (does this kernel support veth pairs "
                            "(CONFIG_VETH; try `modprobe veth`)?)")
    with pytest.raises(ClusterError) as e:  # killed by a signal: a negative code is a failure too
        c._cmd(["X", "sig"], "add it")
    assert str(e.value) == f"cannot add it: `X sig` failed: exit code {-signal.SIGKILL}"


def test_link_stats_reads_both_qdiscs_of_a_node(monkeypatch):
    c = _cluster(nodes=3)
    shows = {(c.namespace(2), "eth0"): " qdisc tbf 8001: root refcnt 2 rate 50Mbit burst 62500b lat 5ms\n"
                                        " Sent 123456 bytes 789 pkt (dropped 3, overlimits 40 requeues 0)\n",
             (c.hub, "port2"): " qdisc tbf 8002: root\n Sent 98 bytes 7 pkt (dropped 0, overlimits 6 requeues 0)\n"}
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        assert argv[:3] == ["TC", "-n", argv[2]] and argv[3:7] == ["-s", "qdisc", "show", "dev"]
        return _completed(argv, kw, 0, shows[(argv[2], argv[7])])

    monkeypatch.setattr(links_mod.subprocess, "run", run)
    with pytest.raises(ClusterError, match="not up"):
        c.link_stats(2)
    c._up = True
    try:
        assert c.link_stats(2) == {"tx_bytes": 123456, "tx_packets": 789, "tx_drops": 3,
                                   "rx_bytes": 98, "rx_packets": 7, "rx_drops": 0}
        assert len(calls) == 2
        shows[(c.hub, "port2")] = "qdisc noqueue 0: root\n"
        with pytest.raises(ClusterError, match=f"cannot read tbf statistics of port2 in {c.hub}"):
            c.link_stats(2)
    finally:
        c._up = False


# -- host helpers ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", ["a", "Z", "gpc", "a_1", "A" + "b" * 15])
def test_prefix_accepted(prefix):
    host_mod._check_prefix(prefix)


@pytest.mark.parametrize("prefix", ["", "1a", "_a", "a-b", "a b", "a" * 17, "gpc\n", 5, None])
def test_prefix_refused_naming_the_field_and_the_rule(prefix):
    with pytest.raises(ValueError) as e:
        host_mod._check_prefix(prefix)
    assert str(e.value) == (f"prefix={prefix!r} is not allowed: expected 1-16 characters, a letter then letters, "
                            "digits or '_'")


def test_preflight_needs_root_then_ip_and_tc(monkeypatch):
    found = {"ip": "/x/ip", "tc": "/x/tc"}
    monkeypatch.setattr(host_mod, "_which", lambda name: found[name])
    monkeypatch.setattr(host_mod.os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterError, match=r"^the emulated cluster needs root \(euid 0\)"):
        host_mod._preflight()
    monkeypatch.setattr(host_mod.os, "geteuid", lambda: 0)
    assert host_mod._preflight() == ("/x/ip", "/x/tc")
    for missing, said in ((["tc"], "tc not found"), (["ip"], "ip not found"), (["ip", "tc"], "ip and tc not found")):
        monkeypatch.setattr(host_mod, "_which", lambda name, m=missing: None if name in m else found[name])
        with pytest.raises(ClusterError) as e:
            host_mod._preflight()
        assert str(e.value).startswith(f"{said} in PATH: install iproute2")


def test_netns_list_takes_the_first_word_of_every_nonblank_line(monkeypatch):
    monkeypatch.setattr(host_mod.subprocess, "run", lambda argv, **kw: _completed(
        argv, kw, 0, "gpc-1-0-n0 (id: 3)\n\n   \ngpc-1-0-hub\nother (id: 0)\n") if argv == ["IP", "netns", "list"] else None)
    assert _NETNS_LIST("IP") == ["gpc-1-0-n0", "gpc-1-0-hub", "other"]


@pytest.fixture
def alive():
    """A process of this test's own that lives until the test ends: its pid."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


def test_pid_alive(monkeypatch, alive):
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert host_mod._pid_alive(alive.pid) and not host_mod._pid_alive(p.pid)
    assert alive.poll() is None  # asked, not signalled

    def denied(pid, sig):
        raise PermissionError(1, "not yours")

    monkeypatch.setattr(host_mod, "os", SimpleNamespace(kill=denied))  # host's os only: the fixture still kills
    assert host_mod._pid_alive(12345)  # it exists, owned by another user


def test_cleanup_stale_deletes_dead_and_own_namespaces_nodes_first(monkeypatch, tmp_path, alive):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me, owner, alive = os.getpid(), alive, alive.pid
    names = [f"gpz-{dead.pid}-0-hub", f"gpz-{dead.pid}-0-n0", f"gpz-{me}-1-n1", f"gpz-{alive}-0-n0",
             f"gpz-{dead.pid}-2-n0", "gpzz-1-0-n0", "gpz-1-0-node", f"gpx-{dead.pid}-0-n0"]
    etc = tmp_path / "netns"
    for n in names + [f"gpz-{dead.pid}-7-hub", "gpz-nope"]:
        (etc / n).mkdir(parents=True)
    monkeypatch.setattr(host_mod, "Path", lambda p: etc if p == "/etc/netns" else Path(p))
    monkeypatch.setattr(host_mod, "_preflight", lambda: ("IP", "TC"))
    monkeypatch.setattr(host_mod, "_netns_list", lambda ip: list(names))
    killed, deleted = [], []
    monkeypatch.setattr(host_mod, "_kill_netns_processes", lambda ip, ns: killed.append(ns))

    def run(argv, **kw):
        assert argv[:3] == ["IP", "netns", "del"]
        deleted.append(argv[3])
        return _completed(argv, kw, 1 if argv[3].endswith("-2-n0") else 0)

    monkeypatch.setattr(host_mod.subprocess, "run", run)
    removed = host_mod.cleanup_stale("gpz")
    want = [f"gpz-{dead.pid}-0-n0", f"gpz-{me}-1-n1", f"gpz-{dead.pid}-0-hub"]
    assert removed == want
    assert deleted == killed == [f"gpz-{dead.pid}-0-n0", f"gpz-{me}-1-n1", f"gpz-{dead.pid}-2-n0",
                                 f"gpz-{dead.pid}-0-hub"]
    left = sorted(p.name for p in etc.iterdir())
    assert left == sorted(set(names) - set(want) | {"gpz-nope"})  # the orphan went too; a failed deletion kept its dir
    killed.clear(), deleted.clear()
    assert host_mod.cleanup_stale("gpz", include_alive=True) == [
        f"gpz-{dead.pid}-0-n0", f"gpz-{me}-1-n1", f"gpz-{alive}-0-n0", f"gpz-{dead.pid}-0-hub"]
    assert owner.poll() is None
    monkeypatch.setattr(host_mod, "_preflight", lambda: pytest.fail("the prefix is checked first"))
    with pytest.raises(ValueError, match="prefix='g-z'"):
        host_mod.cleanup_stale("g-z")


# -- the cluster's settings and names (netns) ------------------------------------------------------------------------
def test_constructor_bounds_are_inclusive_and_named():
    for kwargs in ({"nodes": 1}, {"nodes": 250}, {"burst": FRAME}, {"queue_latency": 60}, {"queue_latency": 1e-9},
                   {"workers_per_node": 64}, {"subnet": "255.249.199"}, {"subnet": "0.9.10"}, {"master_port": 1},
                   {"master_port": 65535}, {"nodes": 2, "intra_bandwidth": None}):
        args = {"nodes": 2, **kwargs}
        c = EmulatedCluster(args.pop("nodes"), "10mbit", **args)
        assert c.intra_rate_bits is None
    assert EmulatedCluster(1, "10mbit", queue_latency="250us").queue_latency_s == pytest.approx(250e-6)
    assert EmulatedCluster(1, "10mbit", burst="2kb").burst_bytes == 2048
    for kwargs, message in (
            ({"burst": FRAME - 1}, f"burst={FRAME - 1!r} ({FRAME - 1} bytes) is too small: a full frame is {FRAME} "
                                   f"bytes; allowed >= {FRAME} bytes"),
            ({"queue_latency": 0}, "queue_latency=0 is out of range: allowed > 0 .. 60 s"),
            ({"queue_latency": 60.5}, "queue_latency=60.5 is out of range: allowed > 0 .. 60 s"),
            ({"queue_latency": -1.0}, "queue_latency=-1.0 is out of range: allowed > 0 .. 60 s"),
            ({"queue_latency": True}, "queue_latency=True is not allowed"),
            ({"workers_per_node": 0}, "workers_per_node=0 is not allowed: expected an integer 1..64"),
            ({"subnet": "256.0.0"}, "subnet='256.0.0' is not allowed"), ({"subnet": "10.77"}, "subnet='10.77' is"),
            ({"subnet": "10.77.0.1"}, "subnet='10.77.0.1' is"), ({"subnet": "1.2.260"}, "subnet='1.2.260' is"),
            ({"master_port": 65536}, "master_port=65536 is not allowed: expected an integer 1..65535"),
            ({"master_port": True}, "master_port=True is not allowed"),
            ({"nodes": True}, "nodes=True is not allowed: expected an integer 1..250"),
            ({"nodes": "2"}, "nodes='2' is not allowed")):
        args = {"nodes": 2, **kwargs}
        with pytest.raises(ValueError) as e:
            EmulatedCluster(args.pop("nodes"), "10mbit", **args)
        assert str(e.value).startswith(message), str(e.value)


def test_names_addresses_and_ranks_of_the_nodes():
    c = EmulatedCluster(3, "10mbit", workers_per_node=2, prefix="gpq", subnet="192.168.5")
    assert c.tag.startswith(f"gpq-{os.getpid()}-") and c.hub == f"{c.tag}-hub"
    assert c.namespaces == [f"{c.tag}-n0", f"{c.tag}-n1", f"{c.tag}-n2", f"{c.tag}-hub"]
    assert [c.address(i) for i in range(3)] == ["192.168.5.1", "192.168.5.2", "192.168.5.3"]
    assert [c.node_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    for bad in (-1, 6, True, 1.0):
        with pytest.raises(ValueError) as e:
            c.node_of(bad)
        assert str(e.value) == f"rank={bad!r} is not allowed: expected an integer 0..5"
    for bad in (-1, 3, True, 0.0):
        for name in (c.namespace, c.address, c.interface, c.switch_port):
            with pytest.raises(ValueError) as e:
                name(bad)
            assert str(e.value) == f"node={bad!r} is not allowed: expected an integer 0..2"
    one = EmulatedCluster(1, "10mbit")
    assert one.address(0) == "10.77.0.1" and one.namespaces == [f"{one.tag}-n0", one.hub]


# -- outcomes ---------------------------------------------------------------------------------------------------------------
def test_support_messages():
    assert str(Support(True, True)) == "emulated cluster supported (root, iproute2, netns, bridge, veth, tbf)"
    assert str(Support(False, True, ("no tc", "no veth"))) == "emulated cluster not supported: no tc; no veth"


def test_run_result_exit_code_ok_and_logs(tmp_path):
    assert RunResult([0, 0]).ok and RunResult([0, 0]).exit_code == 0
    assert not RunResult([0, 0], timed_out=True).ok and RunResult([0, 0], timed_out=True).exit_code == 124
    assert RunResult([0, 3], timed_out=True).exit_code == 124
    assert not RunResult([0, 1]).ok and RunResult([0, 1]).exit_code == 1
    assert RunResult([-signal.SIGTERM, 2], killed={0}).exit_code == 2
    assert RunResult([-signal.SIGTERM, 0], killed={0}).exit_code == 128 + signal.SIGTERM  # nothing else failed
    assert RunResult([0]).log(0) is None
    (tmp_path / "rank1.log").write_text("x")
    r = RunResult([0, 0], log_dir=tmp_path)
    assert r.log(1) == tmp_path / "rank1.log" and r.log(0) is None


def test_worst_exit_code_by_the_shell_convention():
    assert worst_exit_code([]) == 0 and worst_exit_code([0]) == 0
    assert worst_exit_code([1, 2, 255]) == 255 and worst_exit_code([-1, 200]) == 200
    assert worst_exit_code([-signal.SIGINT, 0, 1]) == 128 + signal.SIGINT
    assert worst_exit_code([-signal.SIGKILL, 5], ignore=[0]) == 5
    assert worst_exit_code([-signal.SIGTERM, -signal.SIGKILL], ignore=(0,)) == 128 + signal.SIGKILL
    # every failed rank ignored: the worst of them all
    assert worst_exit_code([-signal.SIGTERM, -signal.SIGKILL], ignore={0, 1}) == 128 + signal.SIGTERM


def test_cluster_interrupted_names_the_signal():
    e = ClusterInterrupted(signal.SIGHUP)
    assert isinstance(e, KeyboardInterrupt) and e.signum == signal.SIGHUP and str(e) == "received SIGHUP"


# -- the bulk receiver (bulk) -----------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_receive_counts_goodput_from_the_first_to_the_last_byte_without_the_first_chunk():
    port, nbytes, first, gap = _free_port(), 300_000, 1000, 0.3
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(bulk.receive("127.0.0.1", port, nbytes, timeout=10)))
    t.start()
    deadline = time.monotonic() + 10
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    with sock:
        t_start = time.time()
        sock.sendall(b"a" * first)
        time.sleep(gap)  # the first chunk arrives alone
        t0 = time.time()
        sock.sendall(b"b" * (nbytes - first) + b"extra")
        assert sock.recv(1) == b"k"  # the acknowledgement, once every byte asked for arrived
        t1 = time.time()
    t.join(10)
    assert out["bytes"] >= nbytes and gap * 0.5 <= out["seconds"] <= t1 - t_start + 0.01
    assert out["goodput_bps"] == pytest.approx((out["bytes"] - first) * 8 / out["seconds"], rel=1e-12)
    assert out["wall_last"] - out["wall_first"] == pytest.approx(out["seconds"], abs=1e-6)
    assert t0 - 0.01 <= out["wall_last"] <= t1 + 0.01 and out["wall_first"] >= t_start - 0.01
