"""The emulated cluster (``gradpress cluster`` / ``EmulatedCluster``).

Root tests build real namespaces, bridges, veths and tbf qdiscs; they are
skipped only when not running as root. Goodput bound: over a tbf link at rate
R with 1500-byte frames TCP delivers R * 1448/1514 (TCP/IP headers with
timestamps and the Ethernet header count against the rate); we require
+-25% around that.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from gradpress.cluster import (
    ClusterError,
    EmulatedCluster,
    check_support,
    measure_goodput,
    parse_rate,
    parse_size,
    parse_time,
    transfer,
    worst_exit_code,
)
from gradpress.cluster import host as host_mod
from gradpress.cluster import netns as netns_mod

IS_ROOT = os.geteuid() == 0
_skip_unless_root = pytest.mark.skipif(not IS_ROOT, reason="the emulated cluster needs root (network namespaces, "
                                                           "veth, tc); run the suite as root to test it")


def needs_root(fn):
    """Mark a test as building real namespaces (marker ``cluster``); skip it only when not root."""
    return pytest.mark.cluster(_skip_unless_root(fn))
TCP_EFFICIENCY = 1448 / 1514
REPO = Path(__file__).resolve().parents[1]


# -- parsing and pure helpers (no root) -----------------------------------------------------------
@pytest.mark.parametrize("text,bits", [
    ("100mbit", 100_000_000), ("1gbit", 1_000_000_000), ("500kbit", 500_000), ("50mbit", 50_000_000),
    ("50MBit", 50_000_000), ("2.5gbit", 2_500_000_000), ("10mibit", 10 * 1024**2), ("1mbps", 8_000_000),
    ("64000", 64_000), (1_000_000, 1_000_000), ("1e6bit", 1_000_000), ("3kibps", 3 * 1024 * 8),
])
def test_parse_rate_like_tc(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("bad", ["", "fast", "100 mb it", "100mbits", "-5mbit", "0mbit", "1kbit", "5tbit", True, None])
def test_parse_rate_rejects_with_field_and_forms(bad):
    with pytest.raises(ValueError) as e:
        parse_rate(bad, "bandwidth")
    assert "bandwidth" in str(e.value) and "mbit" in str(e.value)


@pytest.mark.parametrize("text", ["1e400mbit", "1e999", "9e308gbit", "1e-400mbit"])
def test_parse_rate_size_time_refuse_huge_exponents(text):
    """1e400 overflowed ``10.0 ** 400`` (OverflowError, a traceback from the CLI) instead of a ValueError."""
    for parse, field in ((parse_rate, "bandwidth"), (parse_size, "burst"), (parse_time, "queue_latency")):
        with pytest.raises(ValueError, match=field):
            parse(text.replace("mbit", "").replace("gbit", ""), field)
    with pytest.raises(ValueError, match="bandwidth"):
        parse_rate(text, "bandwidth")


def test_parse_size_and_time():
    assert parse_size("32kb") == 32 * 1024 and parse_size("1514") == 1514 and parse_size("1mb") == 1024**2
    assert parse_time("50ms") == pytest.approx(0.05) and parse_time("1s") == 1.0 and parse_time("500") == pytest.approx(5e-4)
    for fn, bad in ((parse_size, "12parsecs"), (parse_time, "soon"), (parse_time, "0ms")):
        with pytest.raises(ValueError, match="expected"):
            fn(bad)


def test_constructor_validation_names_field():
    for kwargs, field in (({"nodes": 0}, "nodes"), ({"nodes": 251}, "nodes"), ({"bandwidth": "lots"}, "bandwidth"),
                          ({"burst": 100}, "burst"), ({"prefix": "bad-prefix!"}, "prefix"),
                          ({"subnet": "10.300.0"}, "subnet"), ({"master_port": 0}, "master_port")):
        args = {"nodes": 2, "bandwidth": "50mbit", **kwargs}
        with pytest.raises(ValueError, match=field):
            EmulatedCluster(args.pop("nodes"), args.pop("bandwidth"), **args)


def test_worst_exit_code():
    assert worst_exit_code([0, 0]) == 0
    assert worst_exit_code([0, 3, 1]) == 3
    assert worst_exit_code([-signal.SIGKILL, 0]) == 128 + signal.SIGKILL
    # a rank the cluster terminated because another failed does not mask the real failure
    assert worst_exit_code([-signal.SIGTERM, 3], ignore={0}) == 3


def test_clear_errors_when_not_root_or_tools_missing(monkeypatch):
    monkeypatch.setattr(netns_mod.os, "geteuid", lambda: 1000)
    support = check_support()
    assert not support.ok and not support.is_root and "root" in str(support)
    with pytest.raises(ClusterError, match="root"):
        EmulatedCluster(2, "50mbit").start()
    monkeypatch.setattr(netns_mod.os, "geteuid", lambda: 0)
    monkeypatch.setattr(host_mod, "_which", lambda name: None if name == "tc" else "/bin/true")  # the preflight looks it up there
    with pytest.raises(ClusterError, match="iproute2"):
        EmulatedCluster(2, "50mbit").start()
    assert "tc" in str(check_support())


def test_help_says_no_delay_emulation():
    from gradpress.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    text = sub.choices["cluster"].format_help()
    assert "netem" in text and "delay" in text


def test_cli_refuses_more_ranks_than_the_local_worker_cap(monkeypatch, capsys):
    """Every rank of ``gradpress cluster`` is a local process, as a worker of ``gradpress train --nproc`` and of
    ``bench e2e`` (nodes x workers per node), which refuse more than max(64, 8 x cores) since 77166c9;
    ``gradpress cluster --nodes N --workers-per-node 64 -- COMMAND`` built the namespaces and forked N x 64.
    Refused before any namespace, naming both options, the product and the cap; without a command (--keep,
    --measure: two processes) the nodes' limit is theirs alone."""
    from gradpress import cluster as cluster_pkg
    from gradpress.cli import main as cli_main

    cap = max(64, 8 * len(os.sched_getaffinity(0)))
    nodes = cap // 64 + 1
    assert nodes <= netns_mod.MAX_NODES  # any machine under ~2000 cores

    def built(*args, **kwargs):
        raise AssertionError("an EmulatedCluster was built")

    monkeypatch.setattr(cluster_pkg, "EmulatedCluster", built)
    code = cli_main(["cluster", "--nodes", str(nodes), "--workers-per-node", "64", "--bandwidth", "1gbit", "--", "true"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err == (f"gradpress cluster: error: --nodes x --workers-per-node must be an integer from 1 to {cap} (local "
                   f"workers on one machine: at most max(64, 8 x {len(os.sched_getaffinity(0))} cores)), got {nodes * 64}"), err


# -- real clusters (root) -------------------------------------------------------------------------
def _veth_count() -> int:
    return len(subprocess.run(["ip", "-o", "link", "show", "type", "veth"], capture_output=True, text=True).stdout.splitlines())


def _leftovers(marker: str) -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    etc = [p.name for p in Path("/etc/netns").glob(f"{marker}*")] if Path("/etc/netns").exists() else []
    return [line for line in (ns + links).splitlines() if marker in line] + etc


def _unique_prefix() -> str:
    return "gpt" + uuid.uuid4().hex[:8]


@needs_root
def test_support_check_passes_as_root():
    support = check_support()
    assert support.ok, str(support)


@needs_root
@pytest.mark.timing  # asserts goodput within 25% of the shaped rate: a benchmark (make timing)
def test_goodput_training_and_teardown(tmp_path):
    veths = _veth_count()
    prefix = _unique_prefix()
    with EmulatedCluster(2, "50mbit", prefix=prefix, logs=tmp_path / "logs") as c:
        assert c.address(0) == "10.77.0.1" and c.interface(1) == "eth0"
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(ns in names for ns in c.namespaces)
        addr = c.exec(1, ["ip", "-o", "-4", "addr", "show", "dev", c.interface(1)], check=True)
        assert isinstance(addr, subprocess.CompletedProcess) and "10.77.0.2/24" in addr.stdout
        # the nodes are isolated from the host: the host's interfaces are not visible in a node
        links = c.exec(0, ["ip", "-o", "link"], check=True).stdout
        assert "eth0" in links and len(links.splitlines()) == 2  # lo and eth0 only

        # bulk TCP 1 -> 0: goodput ~ rate x TCP efficiency (a too small tbf bucket lands ~7% low)
        goodput = measure_goodput(c, 1, 0, nbytes=6_000_000)
        expected = 50e6 * TCP_EFFICIENCY
        assert abs(goodput / expected - 1) < 0.25, f"goodput {goodput / 1e6:.2f} Mbit/s vs {expected / 1e6:.2f}"

        # full duplex: both directions at once carry well over one link's rate together (a
        # half-duplex or shared link would give ~1x); each direction alone is not held to
        # +-25% here because TCP's ACKs queue behind the other flow's data in the shaper
        # (measured 0.70-0.93 of the rate per direction)
        rates: dict[str, float] = {}
        threads = [threading.Thread(target=lambda s=s, d=d, p=p: rates.__setitem__(f"{s}{d}", measure_goodput(c, s, d, 4_000_000, p)))
                   for s, d, p in ((0, 1, 5301), (1, 0, 5302))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(rates.values()) > 1.5 * expected, f"duplex: {[f'{r / 1e6:.2f}' for r in rates.values()]} Mbit/s"
        for key, rate in rates.items():
            assert rate < 1.25 * expected, f"duplex {key}: {rate / 1e6:.2f} Mbit/s exceeds the shaped rate"

        # a 2-worker gradpress DDP step (topk, gloo on the shaped veths)
        out = tmp_path / "selftest"
        before = c.link_stats(1)
        result = c.run([sys.executable, "-m", "gradpress.cluster.selftest", "--spec", "topk:ratio=0.1",
                        "--steps", "2", "--out", str(out)], stream_rank0=False, timeout=120)
        assert result.ok, f"selftest failed {result.codes}: " + (result.log(1) or Path(os.devnull)).read_text()
        reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        assert reports[0]["param_sha256"] == reports[1]["param_sha256"]
        assert all(r["identical"] and r["stats"]["compressed_tensors"] > 0 for r in reports)
        assert {r["interface"] for r in reports} == {"eth0"} and reports[1]["master"] == c.address(0)
        after = c.link_stats(1)
        # what rank 1 handed to gradpress collectives really crossed its shaped link
        assert after["tx_bytes"] - before["tx_bytes"] > reports[1]["stats"]["bytes_sent"]
        tag = c.tag
    assert _leftovers(tag) == [] and _veth_count() == veths


@needs_root
@pytest.mark.timing  # asserts measured rates: a benchmark (make timing)
def test_incast_is_limited_by_the_switch_port():
    """Two senders into one node share its switch->node link (the hub-side tbf):
    their aggregate, over the time both were sending, stays at the rate (it
    would be ~2x if only the senders' links were shaped)."""
    with EmulatedCluster(3, "50mbit", prefix=_unique_prefix()) as c:
        for attempt in range(3):  # retry if slow process start-up kept the two flows apart
            reports: list[dict] = []
            threads = [threading.Thread(target=lambda s=s, p=p, out=reports: out.append(transfer(c, s, 1, 3_000_000, p)))
                       for s, p in ((0, 5401 + 2 * attempt), (2, 5402 + 2 * attempt))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            span = max(r["wall_last"] for r in reports) - min(r["wall_first"] for r in reports)
            overlap = min(r["wall_last"] for r in reports) - max(r["wall_first"] for r in reports)
            if overlap > 0.5 * span:
                break
        stats = c.link_stats(1)
        tag = c.tag
    assert overlap > 0.5 * span, f"the two transfers hardly overlapped: {reports}"
    aggregate = sum(r["bytes"] for r in reports) * 8 / span
    assert aggregate < 1.25 * 50e6 * TCP_EFFICIENCY, f"incast aggregate {aggregate / 1e6:.1f} Mbit/s exceeds the port rate"
    assert all(r["goodput_bps"] < 1.25 * 50e6 for r in reports)
    assert stats["rx_bytes"] > 6_000_000
    assert _leftovers(tag) == []


@needs_root
def test_names_taken_is_a_clear_error():
    c = EmulatedCluster(1, "10mbit", prefix=_unique_prefix())
    subprocess.run(["ip", "netns", "add", c.namespace(0)], check=True)
    try:
        with pytest.raises(ClusterError, match="already taken"):
            c.start()
    finally:
        subprocess.run(["ip", "netns", "del", c.namespace(0)], check=True)
    assert _leftovers(c.tag) == []


@needs_root
def test_run_timeout_kills_and_tears_down():
    with EmulatedCluster(2, "10mbit", prefix=_unique_prefix()) as c:
        result = c.run(["sleep", "30"], timeout=0.5, stream_rank0=False, kill_grace=1)
        assert result.timed_out and result.exit_code == 124
        tag = c.tag
    assert _leftovers(tag) == []


def _cli(prefix: str, *command: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gradpress", "cluster", "--nodes", "2", "--bandwidth", "50mbit",
                             "--prefix", prefix, "--", *command], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


@needs_root
def test_cli_failing_rank_returns_its_code_and_shows_its_log():
    prefix = _unique_prefix()
    p = _cli(prefix, "sh", "-c", 'if [ "$RANK" = 1 ]; then echo "boom from $RANK on $GLOO_SOCKET_IFNAME" >&2; '
                                 'exit 3; fi; echo "rank0 says hi"; sleep 30')
    out, err = p.communicate(timeout=60)
    assert p.returncode == 3, err
    assert "boom from 1 on eth0" in err and "rank0 says hi" in out
    assert _leftovers(prefix) == []


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_signal_tears_down(sig):
    prefix = _unique_prefix()
    marker = f"{31 + sig}.{uuid.uuid4().int % 1000:03d}"  # a unique sleep length to find stray processes
    p = _cli(prefix, "sleep", marker)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        procs = subprocess.run(["pgrep", "-f", f"^sleep {marker}$"], capture_output=True, text=True).stdout.split()
        if len(procs) == 2:
            break
        time.sleep(0.1)
    else:
        p.kill()
        pytest.fail(f"cluster did not start: {p.communicate()}")
    assert _leftovers(prefix)  # it is up
    p.send_signal(sig)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 128 + sig, err
    assert _leftovers(prefix) == []
    assert subprocess.run(["pgrep", "-f", f"^sleep {marker}$"], capture_output=True).stdout == b""


@needs_root
def test_setup_failure_names_the_feature_and_cleans_up(monkeypatch):
    """A qdisc the kernel does not know (as on a kernel without tbf) fails with a
    message naming the command and the feature, and leaves nothing behind."""
    real = EmulatedCluster._tbf
    monkeypatch.setattr(EmulatedCluster, "_tbf", lambda self, ns, dev: [a if a != "tbf" else "nosuchqdisc"
                                                                         for a in real(self, ns, dev)])
    c = EmulatedCluster(2, "10mbit", prefix=_unique_prefix())
    with pytest.raises(ClusterError, match="tbf") as e:
        c.start()
    assert "nosuchqdisc" in str(e.value) and "CONFIG_NET_SCH_TBF" in str(e.value)
    assert _leftovers(c.tag) == []


def test_workers_per_node_numbers_ranks_host_by_host():
    c = EmulatedCluster(2, "100mbit", workers_per_node=3, intra_bandwidth="1gbit", prefix=_unique_prefix())
    assert c.world == 6 and [c.node_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    env = c.rank_env(4)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["NODE_RANK"]) == \
        ("4", "6", "1", "3", "1")
    assert env["MASTER_ADDR"] == c.address(0) and c.intra_rate_bits == 10**9
    with pytest.raises(ValueError, match="rank=6"):
        c.rank_env(6)
    for bad in (0, 65, True, "2"):
        with pytest.raises(ValueError, match="workers_per_node"):
            EmulatedCluster(2, "100mbit", workers_per_node=bad)
    with pytest.raises(ValueError, match="intra_bandwidth"):
        EmulatedCluster(2, "100mbit", workers_per_node=2, intra_bandwidth="fast")


@needs_root
@pytest.mark.parametrize("intra", [None, "200mbit"])
def test_two_hosts_of_two_workers_run_hierarchical(tmp_path, intra):
    """2 hosts x 2 workers: ranks 0, 1 share node 0's namespace (and its link);
    the hierarchical strategy trains with identical replicas; with a shaped
    intra-host rate, lo carries a tbf at that rate."""
    prefix = _unique_prefix()
    with EmulatedCluster(2, "100mbit", workers_per_node=2, intra_bandwidth=intra, prefix=prefix,
                         logs=tmp_path / "logs") as c:
        out = tmp_path / "selftest"
        result = c.run([sys.executable, "-m", "gradpress.cluster.selftest", "--spec", "qsgd:levels=8",
                        "--strategy", "hierarchical", "--steps", "2", "--out", str(out)], stream_rank0=False,
                       timeout=180)
        assert result.ok, f"selftest failed {result.codes}: " + (result.log(1) or Path(os.devnull)).read_text()
        reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
        assert len({r["param_sha256"] for r in reports}) == 1 and all(r["identical"] for r in reports)
        assert {r["world_size"] for r in reports} == {4}
        qdisc = c.exec(0, ["tc", "qdisc", "show", "dev", "lo"], check=True).stdout
        assert ("tbf" in qdisc) == (intra is not None), qdisc
        if intra is not None:
            assert "200Mbit" in qdisc
        tag = c.tag
    assert _leftovers(tag) == []
