"""Bulk TCP transfer between two emulated nodes, to measure a link's goodput.

Standard library only, so it starts in milliseconds when run as a script in a
node (``python3 bulk.py recv ...`` / ``python3 bulk.py send ...``); it does
not import gradpress or torch.

Goodput is what the receiving application reads per second, measured from the
first byte to the last one (the first chunk is excluded from the byte count,
so connection setup and slow start's first round trip do not count). Over a
tbf link at rate R with 1500-byte frames it is about R * 1448/1514 = 0.956 R
(TCP/IP headers with timestamps: 52 bytes, Ethernet header: 14 bytes, both
counted by tbf).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time

CHUNK = 1 << 16


def receive(bind: str, port: int, nbytes: int, timeout: float = 30.0) -> dict:
    with socket.create_server((bind, port), reuse_port=False) as srv:
        srv.settimeout(timeout)
        print("listening", file=sys.stderr, flush=True)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(timeout)
            got = 0
            first = 0
            t_first = t_last = 0.0
            buf = bytearray(CHUNK)
            while got < nbytes:
                n = conn.recv_into(buf)
                if n == 0:
                    break
                t_last = time.perf_counter()
                if got == 0:
                    t_first, first = t_last, n
                got += n
            conn.sendall(b"k")
    seconds = t_last - t_first
    counted = got - first
    # wall-clock times too: all nodes share this machine's clock, so concurrent
    # transfers can be put on one time line (aggregate rate of an incast)
    wall_last = time.time()
    return {"bytes": got, "seconds": seconds, "goodput_bps": counted * 8 / seconds if seconds > 0 else 0.0,
            "wall_first": wall_last - seconds, "wall_last": wall_last}


def send(host: str, port: int, nbytes: int, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    payload = b"\x5a" * CHUNK
    t0 = time.perf_counter()
    with sock:
        left = nbytes
        while left > 0:
            sent = sock.send(payload[: min(left, CHUNK)])
            left -= sent
        sock.recv(1)  # the receiver's ack: everything arrived
    seconds = time.perf_counter() - t0
    return {"bytes": nbytes, "seconds": seconds, "goodput_bps": nbytes * 8 / seconds}


def measure_goodput(cluster, src: int, dst: int, nbytes: int = 6_000_000, port: int = 5201,
                    timeout: float = 60.0) -> float:
    """Send ``nbytes`` over TCP from node ``src`` to node ``dst`` of an
    :class:`~gradpress.cluster.EmulatedCluster`; return the receiver's goodput
    in bits per second."""
    return float(transfer(cluster, src, dst, nbytes, port, timeout)["goodput_bps"])


def transfer(cluster, src: int, dst: int, nbytes: int = 6_000_000, port: int = 5201, timeout: float = 60.0) -> dict:
    """Like :func:`measure_goodput` but return the receiver's whole report:
    ``bytes``, ``seconds`` (first to last byte), ``goodput_bps``,
    ``wall_first``/``wall_last`` (``time.time()`` of the first/last byte)."""
    script = [sys.executable, __file__]
    recv = cluster.popen(dst, [*script, "recv", "--host", cluster.address(dst), "--port", str(port),
                               "--bytes", str(nbytes), "--timeout", str(timeout)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        sent = cluster.exec(src, [*script, "send", "--host", cluster.address(dst), "--port", str(port),
                                  "--bytes", str(nbytes), "--timeout", str(timeout)], timeout=timeout)
        out, err = recv.communicate(timeout=timeout)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.communicate()
    if sent.returncode != 0 or recv.returncode != 0:
        raise RuntimeError(f"bulk transfer {src}->{dst} failed: sender {sent.returncode} {sent.stderr.strip()!r}; "
                           f"receiver {recv.returncode} {err.strip()!r}")
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["send", "recv"])
    p.add_argument("--host", default="0.0.0.0", help="recv: address to bind; send: address to connect to")
    p.add_argument("--port", type=int, default=5201)
    p.add_argument("--bytes", type=int, default=6_000_000)
    p.add_argument("--timeout", type=float, default=30.0)
    a = p.parse_args(argv)
    fn = receive if a.mode == "recv" else send
    print(json.dumps(fn(a.host, a.port, a.bytes, a.timeout)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
