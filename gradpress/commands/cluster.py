"""``gradpress cluster``: run a command on N emulated hosts with shaped links.

Thin front end over :class:`gradpress.cluster.EmulatedCluster` (see
``docs/cluster.md``): builds the namespaces, runs rank i of COMMAND in node i,
returns the worst exit code, always tears down (also on Ctrl-C / SIGTERM).
"""

from __future__ import annotations

import argparse
import signal
import sys

EPILOG = """\
how it works: a hub network namespace holds a Linux bridge (the switch); each
node is a namespace joined to it by a veth pair. tc tbf shapes both directions
of every link at RATE (node->switch on the node's eth0, switch->node on the
switch port), so each node has its own full-duplex link. With --workers-per-node K,
rank r of COMMAND runs in node r // K with RANK=r, WORLD_SIZE, LOCAL_RANK=r % K,
LOCAL_WORLD_SIZE=K (default K=1: LOCAL_RANK=0, LOCAL_WORLD_SIZE=1), MASTER_ADDR
(node 0), MASTER_PORT and GLOO_SOCKET_IFNAME=eth0 set; a node's K workers share its
link. Rank 0's output goes to stdout; the others' to rank<i>.log under --logs (or a
temp dir), shown on failure.

limits: bandwidth only -- there is NO delay/latency emulation (netem is not
available on these machines; --queue-latency only sizes the tbf queue). All
nodes share this machine's CPU cores. Needs root and iproute2 (ip, tc).

examples:
  gradpress cluster --check
  gradpress cluster --nodes 2 --bandwidth 50mbit -- python3 -m gradpress.cluster.selftest
  gradpress cluster --nodes 4 --bandwidth 100mbit -- gradpress train ...
  gradpress cluster --nodes 2 --bandwidth 1gbit --measure
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cluster",
        help="run COMMAND on N emulated hosts (network namespaces) with tc-shaped links (root)",
        description="Run rank i of COMMAND in emulated host i: N network namespaces behind a "
                    "bridge, each link shaped with tc tbf at RATE in both directions. Bandwidth "
                    "only: no delay emulation (netem is not available).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="gradpress cluster --nodes N --bandwidth RATE [options] -- COMMAND [ARG ...]\n"
              "       gradpress cluster --check | --cleanup [--prefix NAME]",
    )
    p.add_argument("--nodes", type=int, metavar="N", help="number of emulated hosts (1..250; with a COMMAND, nodes x K ranks: at most "
                   "max(64, 8 x cores) local processes, as train --nproc)")
    p.add_argument("--bandwidth", metavar="RATE",
                   help="link rate per direction, tc syntax: 500kbit, 50mbit, 100mbit, 1gbit, 10mibit, 12mbps")
    p.add_argument("--workers-per-node", dest="workers_per_node", type=int, default=1, metavar="K",
                   help="ranks per node (default 1); rank r runs in node r // K with LOCAL_RANK r %% K")
    p.add_argument("--intra-bandwidth", dest="intra_bandwidth", default=None, metavar="RATE",
                   help="rate between a node's own workers (tc syntax; default: unshaped loopback)")
    p.add_argument("--burst", metavar="SIZE", default=None,
                   help="tbf bucket size (tc syntax, e.g. 64kb); default: 10 ms of RATE, at least 4 frames")
    p.add_argument("--queue-latency", metavar="TIME", default="5ms",
                   help="tbf queue length as time at RATE (tc 'latency', default 5ms, at least 8 frames); "
                        "this is NOT a link delay")
    p.add_argument("--keep", action="store_true", help="leave the namespaces up afterwards (remove with --cleanup)")
    p.add_argument("--prefix", default=None, metavar="NAME",
                   help="namespace name prefix (default gpc); names are NAME-<pid>-<seq>-hub / -n<i>")
    p.add_argument("--logs", metavar="DIR", default=None, help="write rank<i>.log files here (default: a temp dir)")
    p.add_argument("--master-port", type=int, default=29500, help="MASTER_PORT for the workers (default 29500)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="terminate all ranks after this long (exit code 124)")
    p.add_argument("--check", action="store_true", help="report whether this machine can host a cluster and exit")
    p.add_argument("--cleanup", action="store_true",
                   help="delete namespaces left by --keep runs or killed runs with this --prefix and exit")
    p.add_argument("--measure", action="store_true",
                   help="measure TCP goodput node 1 -> node 0 (6 MB per 50 Mbit/s of RATE), then run COMMAND if given")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command every rank runs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gradpress.cluster import (
        DEFAULT_PREFIX,
        ClusterError,
        ClusterInterrupted,
        EmulatedCluster,
        check_support,
        cleanup_stale,
        format_rate,
        measure_goodput,
    )

    prefix = args.prefix or DEFAULT_PREFIX
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if args.check:
        support = check_support()
        print(support)
        return 0 if support.ok else 1
    try:
        if args.cleanup:
            removed = cleanup_stale(prefix)
            print(f"removed {len(removed)} namespace(s)" + (": " + ", ".join(removed) if removed else ""))
            return 0
        if args.nodes is None or args.bandwidth is None:
            raise ValueError("--nodes and --bandwidth are required (or use --check / --cleanup)")
        if args.measure and args.nodes < 2:
            raise ValueError(f"nodes={args.nodes} is not allowed with --measure: expected >= 2")
        if not command and not args.keep and not args.measure:
            raise ValueError("COMMAND is missing: expected `gradpress cluster --nodes N --bandwidth RATE -- COMMAND ...`")
        if command and args.nodes >= 1 and args.workers_per_node >= 1:  # out of their own ranges: named below
            from gradpress.train.config import check_nproc

            # every rank is a local process, as a worker of train --nproc and bench e2e: the same cap
            check_nproc(args.nodes * args.workers_per_node, "--nodes x --workers-per-node")
        cluster = EmulatedCluster(args.nodes, args.bandwidth, burst=args.burst, queue_latency=args.queue_latency,
                                  workers_per_node=args.workers_per_node, intra_bandwidth=args.intra_bandwidth,
                                  prefix=prefix, master_port=args.master_port, logs=args.logs, keep=args.keep)
        with cluster:
            print(f"gradpress cluster: {args.nodes} node(s) at {format_rate(cluster.rate_bits)} per direction "
                  f"(burst {cluster.burst_bytes} B, queue {cluster.queue_limit_bytes} B), namespaces {cluster.tag}-*",
                  file=sys.stderr, flush=True)
            code = 0
            if args.measure:
                nbytes = max(200_000, int(6_000_000 * cluster.rate_bits / 50e6))
                bps = measure_goodput(cluster, 1, 0, nbytes=nbytes)
                print(f"goodput node1->node0: {format_rate(bps)} = {bps / cluster.rate_bits:.3f} x rate "
                      f"({nbytes} bytes; TCP/IP+Ethernet overhead makes ~0.956 the ideal)")
            if command:
                result = cluster.run(command, timeout=args.timeout)
                code = result.exit_code
        return code
    except ClusterInterrupted as exc:
        print(f"gradpress cluster: {exc}; cluster torn down", file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt:
        print("gradpress cluster: interrupted; cluster torn down", file=sys.stderr)
        return 128 + signal.SIGINT
    except ClusterError as exc:
        print(f"gradpress cluster: error: {exc}", file=sys.stderr)
        return 1
