"""Host plumbing that needs no cluster object: the root and iproute2
preflight, listing namespaces, killing processes (those in a namespace, or a
process group), and deleting namespaces left by earlier runs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

from gradpress.cluster.outcomes import ClusterError

__all__ = ["DEFAULT_PREFIX", "cleanup_stale"]

DEFAULT_PREFIX = "gpc"

#: matched whole (``fullmatch``): ``$`` would also accept a trailing newline ("gpc\n")
_PREFIX_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,15}")


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


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"prefix={prefix!r} is not allowed: expected 1-16 characters, a letter then "
                         "letters, digits or '_'")



def _kill_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        if p.poll() is None:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass
